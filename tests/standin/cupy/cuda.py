"""cupy.cuda of the stand-in: devices, streams, events, pinned memory (see cupy/__init__).

The current device is per host thread, as in CuPy (CUDA's cudaSetDevice): a thread starts on
device 0 whatever another thread made current (`Device(i).use()`, `runtime.setDevice`).
"""
import os
import threading

import numpy as _np

PINNED = {"bytes": 0}
_THREAD_DEVICES = {}  # host thread ident -> the device it made current (absent: device 0)


class runtime:  # noqa: N801 (CuPy's name)
    @staticmethod
    def getDeviceCount():  # noqa: N802
        return int(os.environ.get("ZMPI_STANDIN_DEVICES", "1"))

    @staticmethod
    def getDevice():  # noqa: N802
        """The calling thread's current device."""
        return _THREAD_DEVICES.get(threading.get_ident(), 0)

    @staticmethod
    def setDevice(device):  # noqa: N802
        Device(device).use()

    @staticmethod
    def getDeviceProperties(device):  # noqa: N802
        Device(device)  # refuses a device that does not exist
        return {"name": b"zmpi CuPy stand-in", "totalGlobalMem": 0}


def get_local_runtime_version():
    """The CUDA runtime CuPy finds (CUDA 13.0, as cupy-cuda13x brings: zmpi.backend reads it
    to decide whether bfloat16 compiles)."""
    return 13000


def thread_devices():
    """Stand-in only: {host thread ident: device id} of the threads that made one current."""
    return dict(_THREAD_DEVICES)


class Device:
    """A CUDA device; `Device()` is the calling thread's current one."""

    def __init__(self, device=None):
        if device is None:
            device = runtime.getDevice()
        if not 0 <= device < runtime.getDeviceCount():
            raise ValueError(f"invalid device {device}")
        self.id = device

    compute_capability = "90"  # an H100's, as CuPy gives it

    def use(self):
        """Make this device current in the calling thread (only)."""
        _THREAD_DEVICES[threading.get_ident()] = self.id

    def synchronize(self):
        pass


class Event:
    """Marks a point of a stream. The work queued on a side stream before it runs when the
    event (or the stream) is synchronized, or when a stream waits for it; `done` answers
    False once while such work is pending (as a copy still in flight would), then runs it."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._ops = []
        self._asked = False

    def _run(self):
        for op in self._ops:
            op()
        self._ops = []

    @property
    def done(self):
        if self._ops and not self._asked:
            self._asked = True
            return False
        self._run()
        return True

    def synchronize(self):
        self._run()

    def record(self, stream=None):
        self._ops = [] if stream is None else list(stream._pending)


class Stream:
    """The null stream runs work at once (the stand-in's arithmetic is eager). A created
    stream queues its asynchronous copies (`get(..., stream=s, blocking=False)`,
    `set(..., stream=s)`) until an event recorded after them is waited for, or the stream is
    synchronized: code that reads a copy's destination too early reads poison."""

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self._null = null  # not CuPy's `null`, the class's null stream
        self._pending = []  # callables, in order; each runs once

    def _queue(self, op):
        if self._null:
            op()
            return
        def once():  # runs once, then leaves the queue (and drops what it holds)
            if once in self._pending:
                self._pending.remove(once)
                op()
        self._pending.append(once)

    def record(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event):
        event.synchronize()

    def synchronize(self):
        ops, self._pending = self._pending, []
        for op in ops:
            op()

    def use(self):
        global _current
        _current = self
        return self

    def __enter__(self):
        return self.use()

    def __exit__(self, *exc):
        global _current
        _current = _NULL


_NULL = Stream(null=True)
_current = _NULL


def get_current_stream():
    return _current


_ALLOCATOR = [None]  # None: the default pool's malloc


def get_allocator():
    """The callable that gives device memory: size -> memory (the default pool's `malloc`)."""
    if _ALLOCATOR[0] is None:
        from cupy import get_default_memory_pool

        return get_default_memory_pool().malloc
    return _ALLOCATOR[0]


def set_allocator(allocator=None):
    """Allocate device memory with `allocator` from now on (None: the default pool; in CuPy,
    None means plain cudaMalloc, so restore what `get_allocator()` gave instead)."""
    _ALLOCATOR[0] = allocator


def alloc_pinned_memory(size):
    PINNED["bytes"] += size
    return bytearray(size)


def pinned_bytes():
    """Stand-in only: page-locked bytes allocated so far."""
    return PINNED["bytes"]


_ = _np

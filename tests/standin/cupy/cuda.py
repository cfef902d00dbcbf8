"""cupy.cuda of the stand-in: devices, streams, events, pinned memory (see cupy/__init__)."""
import os

import numpy as _np

PINNED = {"bytes": 0}


class runtime:  # noqa: N801 (CuPy's name)
    @staticmethod
    def getDeviceCount():  # noqa: N802
        return int(os.environ.get("ZMPI_STANDIN_DEVICES", "1"))


class Device:
    current = 0

    def __init__(self, device_id=0):
        if not 0 <= device_id < runtime.getDeviceCount():
            raise ValueError(f"invalid device {device_id}")
        self.id = device_id

    def use(self):
        Device.current = self.id

    def synchronize(self):
        pass


class Event:
    done = True  # the stand-in's work is finished when it is queued

    def synchronize(self):
        pass

    def record(self, stream=None):
        pass


class Stream:
    def __init__(self, null=False, non_blocking=False):
        self.non_blocking = non_blocking

    def record(self, event=None):
        return event or Event()

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

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


def alloc_pinned_memory(nbytes):
    PINNED["bytes"] += nbytes
    return bytearray(nbytes)


def pinned_bytes():
    """Stand-in only: page-locked bytes allocated so far."""
    return PINNED["bytes"]


_ = _np

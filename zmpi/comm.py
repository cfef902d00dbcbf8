"""Comm: the one door to MPI. Collectives on flat buffers, with call and byte counters.

Every array collective in zmpi goes through a `Comm`, which wraps an mpi4py communicator and
uses only mpi4py's buffer (upper-case) methods; pickling (lower-case) methods are used only by
`bcast_object`/`allgather_object`, for small Python objects.

Run a program under MPI as usual:

    mpiexec -n 4 python train.py          # Comm() wraps MPI.COMM_WORLD
    python train.py                       # works too: a size-1 Comm (MPI singleton)

With more than one rank, `Comm()` installs `install_abort_on_exception()`: an uncaught
exception on any rank prints its traceback (tagged with the rank) and aborts the whole job,
instead of leaving the other ranks waiting forever in their next collective (MPICH's
behaviour under a plain `mpiexec -n K python script.py`).

Buffers. Every buffer is a contiguous array (any shape; it is treated as flat 1-D) of
float64, float32, float16, bfloat16 (`ml_dtypes.bfloat16`), int32, int64 or uint8. Sizes are
checked locally before MPI is called, so a mismatch raises ValueError on the rank that has it
rather than hanging or corrupting memory. (A mismatch *between* ranks, e.g. rank 0 passes 10
elements and rank 1 passes 12, cannot be seen locally; that is the caller's contract.)

float16 and bfloat16. float16 travels as MPI's native 16-bit float when the library has one
(MPICH: MPIX_C_FLOAT16); bfloat16 has no MPI datatype, so it travels as 2-byte words
(MPI_UINT16_T) and is reduced with a user-defined, commutative `MPI.Op` that views both
buffers as bfloat16, applies the op in float32 and rounds back to bfloat16 (round to nearest
even) after every pairwise step - the same rounding a native bf16 reduction would do, and no
extra traffic (upcasting whole buckets to float32 would double it). Allgather and broadcast
just move the 2-byte words. The same user op reduces float16 if an MPI lacks a native one.
A user op runs on the host, so a device buffer that needs one is always staged.

Device buffers (CuPy). Whether MPI is CUDA-aware is asked of the MPI library itself
(`cuda_support()`: MPIX_GPU_query_support / MPIX_Query_cuda_support through ctypes, as mpi4py
4.1 wraps neither; override with ZMPI_CUDA_AWARE=0|1). If it is, the device buffer is passed
directly once the kernels queued before the call have finished (an event on the current
stream, not a device-wide synchronize), and a non-blocking collective runs blocking on Open
MPI, whose non-blocking collectives do not take device memory. Otherwise the buffer is staged:
copied into a pinned host buffer (pooled and reused by shape and dtype, registered with the
engine's ledger) on a side stream, the MPI op runs on the host, and the result is copied back
on the current stream when the request is waited for, so later kernels see it; an in-place
allgather copies in only this rank's block. Nothing blocks at launch: the request waits in
the Comm's queue until its copy has landed and starts then (at the next collective on that
Comm, or at its wait), in call order, so GPU work, copies and MPI overlap. `staged_bytes`
counts what crossed. All of this lives in `Comm._run` and `Request`.

Counters. `comm.counters[op]` is an `OpCounter(calls, bytes, sent)` for op in
'allreduce', 'reduce_scatter', 'allgather', 'broadcast', 'allreduce_scalar', 'object'
(blocking and non-blocking calls count under the same name, when they are called).
`bytes` is the logical payload: allreduce buf.nbytes, reduce_scatter send.nbytes, allgather
recv.nbytes (the full gathered buffer), broadcast buf.nbytes, allreduce_scalar 8, object the
pickled size. `sent` is what this rank sends under bandwidth-optimal ring algorithms, for a
full buffer of B bytes on N ranks:

    allreduce        2 (N-1)/N B   (reduce-scatter then allgather)
    reduce_scatter     (N-1)/N B
    allgather          (N-1)/N B
    broadcast          B on the root, 0 elsewhere
    allreduce_scalar   as allreduce, B = 8
    object           bcast_object as broadcast; allgather_object as allgather

computed per call in integers as B*k*(N-1)//N (k = 2 for allreduce, 1 otherwise). This is
exact for reduce_scatter and allgather (B is a multiple of N there) and rounds down by less
than one byte per call for allreduce when N does not divide 2(N-1)B. It is a model, not a
measurement of what MPICH's algorithm choice sent; it is the quantity the ZeRO paper's
communication analysis counts (stages 0-2: 2 Psi per step, stage 3: 3 Psi).
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import asdict, dataclass

import numpy as np

from zmpi import backend  # before mpi4py.MPI (MPI_Init): it picks this rank's GPU
from zmpi.memory import ring_bytes

# isort: split
from mpi4py import MPI

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "allreduce_scalar", "object")


@dataclass
class OpCounter:
    """Totals for one collective: calls, logical payload bytes, ring-model bytes sent."""

    calls: int = 0
    bytes: int = 0
    sent: int = 0


# --------------------------------------------------------------------------- datatypes, ops


@dataclass(frozen=True)
class _Wire:
    """How one numpy dtype travels over MPI."""

    datatype: MPI.Datatype
    as_words: bool  # no MPI type: pass the buffer viewed as uint16, reduce with a user op


_FLOAT16_T = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
_WIRES = {
    np.dtype(np.float64): _Wire(MPI.DOUBLE, False),
    np.dtype(np.float32): _Wire(MPI.FLOAT, False),
    np.dtype(np.float16): (
        _Wire(_FLOAT16_T, False) if _FLOAT16_T != MPI.DATATYPE_NULL else _Wire(MPI.UINT16_T, True)
    ),
    backend.BFLOAT16: _Wire(MPI.UINT16_T, True),
    np.dtype(np.int32): _Wire(MPI.INT32_T, False),
    np.dtype(np.int64): _Wire(MPI.INT64_T, False),
    np.dtype(np.uint8): _Wire(MPI.UINT8_T, False),
}
_NATIVE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_NUMPY_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
_USER_OPS: dict = {}  # (op name, dtype) -> MPI.Op, created on first use


def _wire(dtype) -> _Wire:
    dtype = np.dtype(dtype)
    if dtype not in _WIRES:
        names = ", ".join(str(d) for d in _WIRES)
        raise ValueError(f"dtype {dtype} is not supported by Comm; supported: {names}")
    return _WIRES[dtype]


def _user_op(op: str, dtype) -> MPI.Op:
    """A commutative MPI.Op that reduces 2-byte words as `dtype`, computing in float32."""
    key = (op, np.dtype(dtype))
    if key not in _USER_OPS:
        fn = _NUMPY_OPS[op]

        def reduce_words(inbuf, inoutbuf, datatype):
            a = np.frombuffer(inbuf, dtype=key[1])
            b = np.frombuffer(inoutbuf, dtype=key[1])
            b[...] = fn(a.astype(np.float32), b.astype(np.float32))  # rounds to nearest even

        _USER_OPS[key] = MPI.Op.Create(reduce_words, commute=True)
    return _USER_OPS[key]


def _check_op(op: str) -> str:
    if op not in _NATIVE_OPS:
        raise ValueError(f"unknown op {op!r}; valid: {', '.join(_NATIVE_OPS)}")
    return op


def _flat(arr, what: str):
    """A 1-D view of a contiguous array; TypeError/ValueError otherwise."""
    if not hasattr(arr, "flags") or not hasattr(arr, "dtype"):
        raise TypeError(f"{what} must be a numpy or cupy array, got {type(arr).__name__}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (shape {arr.shape})")
    _wire(arr.dtype)
    return arr.reshape(-1)


def _same_dtype(send, recv):
    if send.dtype != recv.dtype:
        raise ValueError(f"send dtype {send.dtype} != recv dtype {recv.dtype}")


# --------------------------------------------------------------------------- staging, requests


class _StagingPool:
    """Host buffers for staging device arrays, reused by (shape, dtype); pinned under CuPy.
    Every buffer is registered (host, comm_buffer, "staging") with the ledger given to
    `account_in` (the engine's), so pinned memory shows in the ledger's host column."""

    def __init__(self):
        self._free: dict = {}
        self._all: list = []
        self.nbytes = 0  # total ever allocated (the pool never shrinks)
        self._ledger = None  # weak: a ledger holds its engine's buffers, which must not
        # outlive the engine

    @property
    def ledger(self):
        return None if self._ledger is None else self._ledger()

    def acquire(self, shape, dtype) -> np.ndarray:
        """A free buffer of this shape and dtype: one whose last copy has landed, else the
        oldest (waiting for its copy), else a new one."""
        free = self._free.get((shape, np.dtype(dtype)))
        if free:
            at = next((i for i, (_, fence) in enumerate(free)
                       if fence is None or fence.ready()), 0)
            buf, fence = free.pop(at)
            if fence is not None:
                fence.wait()
            return buf
        buf = backend.pinned_empty(shape, dtype)
        self.nbytes += buf.nbytes
        self._all.append(buf)
        ledger = self.ledger
        if ledger is not None:
            ledger.register(buf, "comm_buffer", "host", "staging")
        return buf

    def account_in(self, ledger) -> None:
        """Move the accounting of every staging buffer, now and later, to `ledger`."""
        previous = self.ledger
        for buf in self._all:
            if previous is not None:
                previous.release(buf)
            ledger.register(buf, "comm_buffer", "host", "staging")
        self._ledger = weakref.ref(ledger)

    def release(self, buf: np.ndarray, fence=None):
        """Return `buf`; `fence` (None, or an object with ready()/wait()) says when the copy
        still reading it has landed."""
        self._free.setdefault((buf.shape, buf.dtype), []).append((buf, fence))


_POOL = _StagingPool()


def staging_nbytes() -> int:
    """Bytes of pinned host memory held for staging (for the memory ledger)."""
    return _POOL.nbytes


def account_staging_in(ledger) -> None:
    """Register the staging buffers with `ledger` (the engine calls it)."""
    _POOL.account_in(ledger)


class Request:
    """A collective, queued or started. `wait()` (idempotent) completes it and returns the
    result array; `test()` starts it if its inputs are ready, completes it if MPI has finished,
    and says whether it is done (it never blocks).

    A collective on device buffers may wait to start: MPI may only read the buffers once the
    GPU has written them (its device-to-host staging copy, or the kernels that wrote a buffer
    MPI reads directly, are still queued on a stream). Such a request sits in its Comm's
    queue until its `inputs` (objects with ready()/wait(): backend.HostCopy, StreamPoint) are
    ready; the Comm starts queued requests in order, never one before an earlier one, so
    every rank starts the same collectives in the same order. With host staging, completion
    queues the copy of the result back to the device on the current stream (later GPU work
    is ordered after it) and returns the host buffer to the pool once that copy has landed.
    """

    def __init__(self, comm, op, start, blocking, result, keep=(), inputs=(), copy_back=(),
                 held=(), what=None):
        self.op = op
        self._what = what or op  # for the watchdog: the op, dtype, size
        self._comm = comm
        self._start_mpi = start  # () -> the MPI call's Request (None when blocking)
        self._blocking = blocking
        self._mpi = None
        self.result = result  # the caller's output array
        self._keep = keep  # arrays MPI reads or writes: alive until done
        self._inputs = list(inputs)  # copies / stream points MPI must wait for
        self._copy_back = copy_back  # ((host, device), ...)
        self._held = held  # staging buffers to return to the pool
        self.started = False
        self.done = False
        self._failed: BaseException | None = None  # what starting it raised

    def ready_to_start(self) -> bool:
        """True once the data MPI reads is in place (never blocks)."""
        self._inputs = [i for i in self._inputs if not i.ready()]
        return not self._inputs

    def start(self) -> None:
        """Start this collective and every one queued before it on its Comm, waiting for
        their inputs (local copies only: never for another rank)."""
        if not self.started:
            if self._failed is not None or self not in self._comm._queue:
                raise RuntimeError(f"this {self.op} never reached MPI: starting it failed "
                                   f"({self._failed!r})") from self._failed
            self._comm._start_queued(through=self)

    def _start(self) -> None:
        for i in self._inputs:
            i.wait()
        self._inputs = []
        if self._blocking:
            with _watched(self._what):
                self._start_mpi()
        else:
            self._mpi = self._start_mpi()
            _PROGRESS.started()
        self.started = True

    def test(self) -> bool:
        if not self.started and self._failed is None:
            self._comm._start_queued(block=False)  # start it (and those before) if ready
        if self.started and not self.done and (self._mpi is None or self._mpi.Test()):
            self._finish()
        return self.done

    def wait(self):
        if not self.done:
            self.start()
            if self._mpi is not None:
                with _watched(f"the wait for a non-blocking {self.op}"):
                    self._mpi.Wait()
            self._finish()
        return self.result

    def _finish(self):
        if not self._blocking:
            _PROGRESS.finished()
        fence = None
        for host, device in self._copy_back:
            fence = backend.to_device_async(host, device)
        for buf in self._held:
            _POOL.release(buf, fence)
        self._keep = self._held = self._copy_back = ()
        self._mpi = None
        self.done = True


class _Progress:
    """Drives MPI's progress engine from a daemon thread while non-blocking collectives are in
    flight. MPICH (and Open MPI without its progress thread) advances a non-blocking
    collective only inside an MPI call on this rank, and backward computes a whole unit
    between two calls: a bucket launched there would sit until the next launch, its rounds of
    a multi-round algorithm one per launch, and wait at the end of the step. The thread calls
    MPI_Iprobe on a private communicator every `interval` seconds (about 10 us each) while
    anything is in flight, and sleeps on a condition otherwise. Needs MPI_THREAD_MULTIPLE
    (mpi4py asks for it) and a core of its own: on a core that computes, its wake-ups take
    the GIL and the core from compute (measured on 2 cores: at 2 ranks 3-5% longer steps at
    stages 0, 2 and 3, at 4 ranks up to 1.7x). ZMPI_PROGRESS_THREAD: `auto` (the default) runs
    it only where the node has two cores or more per rank, 1 always, 0 never."""

    def __init__(self, interval: float = 1e-3):
        self.interval = interval
        self._in_flight = 0
        self._cond = threading.Condition()
        self._thread = None
        self._stopping = False
        self.mode = os.environ.get("ZMPI_PROGRESS_THREAD", "auto").strip()
        if self.mode not in ("auto", "0", "1"):
            raise ValueError(f"ZMPI_PROGRESS_THREAD must be auto, 0 or 1, got {self.mode!r}")
        self.polls = 0  # Iprobe calls made (for tests)
        self.ranks_on_node = 1  # set by Comm()

    def wanted(self) -> bool:
        """Whether this rank should have the thread (`auto`: a spare core per rank)."""
        if self.mode == "auto":
            return 2 * self.ranks_on_node <= backend.host_cores()
        return self.mode == "1"

    def started(self) -> None:
        """A non-blocking collective entered MPI."""
        with self._cond:
            self._in_flight += 1
            if self._thread is None and not self._stopping and self.wanted() \
                    and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                self._probe = MPI.COMM_SELF.Dup()
                self._thread = threading.Thread(target=self._run, name="zmpi-progress",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.stop)  # runs before mpi4py's MPI_Finalize (registered first)
            self._cond.notify()

    def finished(self) -> None:
        """A non-blocking collective completed."""
        with self._cond:
            self._in_flight -= 1

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._in_flight <= 0 and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            self._probe.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            self.polls += 1
            time.sleep(self.interval)


_PROGRESS = _Progress()


def wait_all(requests):
    """Wait for every request (one MPI Waitall for those in flight); returns their results."""
    for r in requests:
        r.start()
    pending = [r for r in requests if not r.done and r._mpi is not None]
    if pending:
        with _watched(f"a wait for {len(pending)} non-blocking collectives"):
            MPI.Request.Waitall([r._mpi for r in pending])
        for r in pending:
            r._mpi = None  # completed; wait() below only finishes (copies back, frees)
    return [r.wait() for r in requests]


# --------------------------------------------------------------------------- failure behaviour

_abort_installed = False
# mpiexec forwards a rank's output asynchronously and drops what is in flight when the job is
# aborted: a rank that has something to say waits this long before it calls MPI_Abort.
_FORWARD_S = 0.25


def install_abort_on_exception():
    """Make an uncaught exception on any rank print its traceback and abort the MPI job.

    Wraps `sys.excepthook` (once per process): prints the traceback with every line tagged
    `[rank r]` to stderr, then calls `MPI.COMM_WORLD.Abort(1)`, so the other ranks do not
    wait forever in their next collective. Equivalent to launching with `python -m mpi4py`.
    A KeyboardInterrupt (Ctrl-C, which mpiexec forwards to every rank) prints one line on
    rank 0 instead of a traceback per rank, and aborts with exit code 130.
    """
    global _abort_installed
    if _abort_installed:
        return
    previous = sys.excepthook

    def abort_hook(exc_type, exc, tb):
        if MPI.Is_finalized() or not MPI.Is_initialized():
            return previous(exc_type, exc, tb)
        world = MPI.COMM_WORLD
        if issubclass(exc_type, KeyboardInterrupt):
            _interrupted()
        tag = f"[rank {world.Get_rank()}] "
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        lines = [f"uncaught exception on rank {world.Get_rank()} of {world.Get_size()}, "
                 "aborting the MPI job", *text.rstrip("\n").split("\n")]
        try:
            sys.stdout.flush()
            sys.stderr.write("".join(tag + line + "\n" for line in lines))
            sys.stderr.flush()
            time.sleep(_FORWARD_S)
        finally:
            world.Abort(1)

    sys.excepthook = abort_hook
    _abort_installed = True
    if threading.current_thread() is threading.main_thread():
        _watch_interrupts()


_INTERRUPT = threading.Lock()


def _interrupted():
    """Ctrl-C reached this rank (mpiexec forwards it to every rank): rank 0 says so in one
    line, the others give it a second to do that, and the job is aborted (exit code 130).
    Once per process (the main thread and the watcher thread may both get here)."""
    if not _INTERRUPT.acquire(blocking=False):
        time.sleep(60)  # the other caller is aborting the job
        return
    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        sys.stderr.write(f"zmpi: interrupted; ending all {world.Get_size()} ranks\n")
        sys.stderr.flush()
        time.sleep(_FORWARD_S)
    else:
        time.sleep(1.0)
    world.Abort(130)


def _watch_interrupts():
    """Act on SIGINT even while the main thread is blocked inside MPI (where Python cannot
    raise KeyboardInterrupt): the C-level handler writes the signal number to a pipe
    (`signal.set_wakeup_fd`) that a daemon thread reads. By design any SIGINT ends a
    multi-rank job, even where the program catches KeyboardInterrupt: one rank surviving
    Ctrl-C would leave the others waiting."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch():
        while True:
            if signal.SIGINT in os.read(read_fd, 64):
                _interrupted()

    threading.Thread(target=watch, name="zmpi-interrupts", daemon=True).start()


class CollectiveMismatch(RuntimeError):
    """The ranks of a communicator called different collectives (debug check)."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _call_site(frame=None) -> str:
    """Where a collective was called from `frame`'s stack (default: this call's): the
    innermost frame outside this module, and the innermost outside the zmpi package (the
    user's line), as 'file:line in function (from file:line in function)'."""
    def describe(f):
        path = os.path.relpath(f.f_code.co_filename)
        path = f.f_code.co_filename if path.startswith("..") else path
        return f"{path}:{f.f_lineno} in {f.f_code.co_name}"

    frame = frame or sys._getframe(1)
    inner = user = None
    while frame is not None and user is None:
        name = frame.f_code.co_filename
        if inner is None and name != __file__ and not name.endswith("contextlib.py"):
            inner = frame
        if not os.path.abspath(name).startswith(_PACKAGE + os.sep):
            user = frame
        frame = frame.f_back
    if inner is None:
        return "?"
    return describe(inner) + (f" (from {describe(user)})" if user not in (None, inner) else "")


class _Watchdog:
    """Aborts the job when this process waits in one collective longer than `timeout` seconds.

    A daemon thread sleeps and checks the waits in progress (no spinning); on expiry it prints,
    tagged with the rank, which collective is waited for and where it was called, gives the
    other waiting ranks two seconds to say the same, and calls MPI_Abort.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._waits = {}  # token -> (what, frame, start)
        self._thread = threading.Thread(target=self._run, name="zmpi-watchdog", daemon=True)
        self._thread.start()

    def begin(self, what: str, frame) -> object:
        token = object()
        self._waits[token] = (what, frame, time.monotonic())
        return token

    def end(self, token) -> None:
        del self._waits[token]

    def _run(self):
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            # no loop variable may hold a frame between checks: a frame keeps its locals,
            # and so the buffers of a finished collective, alive
            for what, frame, waited in [(w, f, now - s) for w, f, s in list(self._waits.values())
                                        if now - s > self.timeout]:
                self._expire(what, frame, waited)

    @staticmethod
    def _expire(what, frame, waited):
        site = _call_site(frame)
        world = MPI.COMM_WORLD
        sys.stderr.write(f"[rank {world.Get_rank()}] zmpi watchdog: waited {waited:.0f} s "
                         f"(ZMPI_COLLECTIVE_TIMEOUT) in {what}, called at {site}; a rank "
                         "that does not call it (or hangs before it) stops the job; "
                         "aborting\n")
        sys.stderr.flush()
        time.sleep(2.0)
        world.Abort(3)


_WATCHDOG = None


def _watchdog():
    """The process's watchdog (ZMPI_COLLECTIVE_TIMEOUT seconds, default 1800; 0: none)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        text = os.environ.get("ZMPI_COLLECTIVE_TIMEOUT", "1800").strip()
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"ZMPI_COLLECTIVE_TIMEOUT={text!r}: expected seconds") from None
        _WATCHDOG = _Watchdog(timeout) if timeout > 0 else False
    return _WATCHDOG


_WAITED = [0.0]  # seconds this process spent blocked in MPI (every communicator)


def waited_seconds() -> float:
    """Seconds this process has spent blocked in MPI so far: blocking collectives and waits
    for non-blocking ones (exposed communication, for profiles)."""
    return _WAITED[0]


class _watched:  # noqa: N801 (used as a function-like context manager)
    """`with _watched(what):` around a blocking MPI wait: the watchdog's view of it (the frame
    of the function holding the `with` is kept for the call site; it is alive meanwhile), and
    the time it takes, added to `waited_seconds()`."""

    def __init__(self, what: str):
        self.what, self.dog, self.token = what, _watchdog(), None

    def __enter__(self):
        if self.dog:
            self.token = self.dog.begin(self.what, sys._getframe(1))
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        _WAITED[0] += time.perf_counter() - self.start
        if self.token is not None:
            self.dog.end(self.token)


@functools.lru_cache(maxsize=1)
def _libmpi():
    """The MPI library this process loaded (ctypes), found in /proc/self/maps; None if not.
    Looked up once: every Comm (sub-communicators included) asks."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libmpi" in line
                            and line.split()[-1].startswith("/")})
    except OSError:
        return None
    loaded = []
    for path in paths:
        try:
            loaded.append(ctypes.CDLL(path))
        except OSError:
            continue
    for lib in loaded:  # e.g. Cray's libmpi_gtl_cuda sorts before the MPI itself
        if hasattr(lib, "MPIX_GPU_query_support") or hasattr(lib, "MPIX_Query_cuda_support"):
            return lib
    return loaded[0] if loaded else None


def cuda_support() -> tuple[bool, str]:
    """(whether MPI takes CUDA device buffers, how that was decided). ZMPI_CUDA_AWARE=0|1
    overrides; else MPI's own answer: `MPIX_GPU_query_support(CUDA)` or
    `MPIX_Query_cuda_support()` from the loaded libmpi (MPICH, Open MPI; mpi4py 4.1 does not
    wrap them), or `MPI.Query_cuda_support` where mpi4py has it; else False."""
    import ctypes

    env = os.environ.get("ZMPI_CUDA_AWARE", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"ZMPI_CUDA_AWARE={env!r}: expected 0 or 1")
        return env == "1", "ZMPI_CUDA_AWARE"
    lib = _libmpi()
    if lib is not None and hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
            return bool(supported.value), "MPIX_GPU_query_support"
    if lib is not None and hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query()), "MPI.Query_cuda_support"
        except (MPI.Exception, NotImplementedError):
            pass
    return False, "no query available"


def mpi_flavour() -> str:
    """'Open MPI', 'MPICH' (and its derivatives: Intel MPI, Cray MPICH, MVAPICH) or 'other'."""
    version = MPI.Get_library_version()
    if "Open MPI" in version:
        return "Open MPI"
    if any(name in version for name in ("MPICH", "Intel(R) MPI", "MVAPICH", "CRAY MPICH")):
        return "MPICH"
    return "other"


# --------------------------------------------------------------------------- Comm


_QUEUES: dict[int, list] = {}  # MPI communicator handle -> its queued requests


class Comm:
    """A communicator: rank, size, node-local rank, collectives and counters.

    Constructing one is collective over `mpi_comm` (it splits off the node-local group).
    """

    def __init__(self, mpi_comm=None):
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        local = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        local.Free()
        _PROGRESS.ranks_on_node = max(_PROGRESS.ranks_on_node, self.local_size)
        self.is_cuda_aware, self.cuda_aware_source = cuda_support()
        # Open MPI's CUDA support covers blocking collectives only (its non-blocking ones reduce
        # on the host: ompi #9845, #12045): there a device buffer's collective runs blocking.
        self.nonblocking_on_device = mpi_flavour() != "Open MPI"
        self.counters = {op: OpCounter() for op in OPS}
        self.staged_bytes = {"to_host": 0, "to_device": 0}  # device buffers staged via the host
        # collectives waiting for their inputs, in call order; one queue per MPI communicator,
        # shared by every Comm wrapping it (MPI's ordering rule is per communicator)
        self._queue: list[Request] = _QUEUES.setdefault(self.mpi.py2f(), [])
        self.check_collectives = False
        self._calls = 0  # collectives started on this communicator (the debug check's index)
        if os.environ.get("ZMPI_DEBUG", "").strip() not in ("", "0"):
            self.enable_collective_checks()
        if MPI.COMM_WORLD.Get_size() > 1:
            install_abort_on_exception()
        _watchdog()

    # ---- the debug check

    def enable_collective_checks(self) -> None:
        """Before every collective, compare what each rank is about to call (index, op, dtype,
        element counts); a mismatch raises CollectiveMismatch on every rank, naming what each
        called and where, instead of deadlocking or corrupting memory. Costs one small
        pickled allgather per collective. On the world communicator, a rank that ends the
        program while another waits in a collective is reported the same way."""
        if self.check_collectives:
            return
        self.check_collectives = True
        if self.mpi == MPI.COMM_WORLD and self.size > 1:
            atexit.register(self._check_at_exit)

    def _check_call(self, op: str, dtype=None, counts=(), site=None) -> None:
        """The debug check: every rank's (index, op, dtype, counts), compared."""
        self._calls += 1
        mine = (self._calls, op, None if dtype is None else str(np.dtype(dtype)),
                tuple(int(c) for c in counts))
        with _watched(f"the collective check of {op} ({self.size} ranks)"):
            everyone = self.mpi.allgather((mine, site or _call_site()))
        if any(call != everyone[0][0] for call, _ in everyone):
            lines = [f"rank {r}: call #{c[0]} {c[1]}"
                     + (f" {c[2]} x {'/'.join(map(str, c[3]))}" if c[2] else "") + f" at {site}"
                     for r, (c, site) in enumerate(everyone)]
            raise CollectiveMismatch("the ranks called different collectives on a "
                                     f"{self.size}-rank communicator:\n  " + "\n  ".join(lines))

    def _check_at_exit(self) -> None:
        if MPI.Is_finalized():
            return
        try:
            self._start_queued()  # the check is a collective: after what is queued
            self._check_call("end of program", site="exit")
        except CollectiveMismatch as e:
            sys.stderr.write(f"[rank {self.rank}] {e}\n")
            sys.stderr.flush()
            time.sleep(_FORWARD_S)
            MPI.COMM_WORLD.Abort(4)

    def __repr__(self):
        return f"Comm(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"

    # ---- counters

    def reset_counters(self):
        for c in self.counters.values():
            c.calls = c.bytes = c.sent = 0

    def counters_snapshot(self) -> dict:
        """{op: {'calls', 'bytes', 'sent'}} as plain dicts (a copy)."""
        return {op: asdict(c) for op, c in self.counters.items()}

    def _ring(self, nbytes: int, k: int = 1) -> int:
        """Bytes one rank sends in a ring collective over k passes of nbytes: k(N-1)/N nbytes,
        rounded down."""
        return ring_bytes(nbytes, self.size, k)

    def _count(self, op: str, nbytes: int, sent: int):
        """The one counting point for every collective (see the module docstring)."""
        c = self.counters[op]
        c.calls += 1
        c.bytes += int(nbytes)
        c.sent += int(sent)

    # ---- the one path for buffer collectives

    def _run(self, op, calls, send, recv, result, reduces: bool, blocking: bool) -> Request:
        """Check (debug), stage device buffers through host memory if needed, queue the MPI
        call, and start it as soon as its inputs are in place (blocking: now, watched by the
        watchdog).

        `calls` = (blocking call, non-blocking call), each `call(sendspec, recvspec)` making
        the mpi4py call; `send=None` means in place (MPI.IN_PLACE: recv holds the input too;
        for an in-place allgather only this rank's block of it). `result` is what wait()
        returns. A device buffer that MPI takes directly (CUDA-aware) runs blocking where
        the MPI's non-blocking collectives do not support device memory (Open MPI).
        """
        if self.check_collectives:
            self._start_queued()  # the check is a collective too: keep the order
            self._check_call(op, recv.dtype, (0 if send is None else send.size, recv.size))
        wire = _wire(recv.dtype)
        keep = (send, recv, result)
        on_device = any(backend.is_device_array(a) for a in (send, recv))
        stage = on_device and (not self.is_cuda_aware or (reduces and wire.as_words))
        if on_device and not stage and not self.nonblocking_on_device:
            blocking = True
        inputs, held, copy_back = [], [], []
        if on_device and not stage:
            inputs.append(backend.StreamPoint())  # MPI reads device memory the GPU writes
        if stage:
            def staged(a, copy_in: bool):
                if not backend.is_device_array(a):
                    return a
                host = _POOL.acquire(a.shape, a.dtype)
                held.append(host)
                if copy_in and op == "allgather" and send is None:  # MPI reads only our block
                    n = a.shape[0] // self.size
                    mine = slice(self.rank * n, (self.rank + 1) * n)
                    inputs.append(backend.HostCopy(a[mine], host[mine]))
                    self.staged_bytes["to_host"] += host[mine].nbytes
                elif copy_in:
                    inputs.append(backend.HostCopy(a, host))
                    self.staged_bytes["to_host"] += host.nbytes
                return host

            send_h = None if send is None else staged(send, copy_in=True)
            recv_h = staged(recv, copy_in=send is None)
            if recv_h is not recv:
                copy_back.append((recv_h, recv))
                self.staged_bytes["to_device"] += recv.nbytes
            send, recv = send_h, recv_h

        def spec(a):
            if a is None:
                return MPI.IN_PLACE
            return [a.view(np.uint16) if wire.as_words else a, wire.datatype]

        call = calls[0] if blocking else calls[1]
        req = Request(self, op, lambda: call(spec(send), spec(recv)), blocking, result, keep,
                      inputs, copy_back, held,
                      what=f"{op} ({recv.dtype} x {recv.size}, {self.size} ranks)")
        self._queue.append(req)
        if blocking:
            req.wait()
        else:
            self._start_queued(through=None, block=False)
        return req

    def _start_queued(self, through: Request | None = None, block: bool = True) -> None:
        """Start queued requests in order: all of them (`through=None`), or up to and
        including `through`; without `block`, only while the next one's inputs are ready."""
        while self._queue:
            if not block and not self._queue[0].ready_to_start():
                return
            req = self._queue.pop(0)
            try:
                req._start()
            except BaseException as e:  # its own wait() must not pass for a completion
                req._failed = e
                raise
            if req is through:
                return

    def _reduce_op(self, op: str, dtype):
        _check_op(op)
        if _wire(dtype).as_words:
            return _user_op(op, dtype)
        return _NATIVE_OPS[op]

    # ---- allreduce

    def _allreduce(self, buf, op, blocking):
        flat = _flat(buf, "buf")
        mpi_op = self._reduce_op(op, flat.dtype)
        self._count("allreduce", flat.nbytes, self._ring(flat.nbytes, 2))
        calls = (lambda s, r: self.mpi.Allreduce(s, r, mpi_op),
                 lambda s, r: self.mpi.Iallreduce(s, r, mpi_op))
        return self._run(f"allreduce({op})", calls, None, flat, buf, True, blocking)

    def allreduce(self, buf, op: str = "sum"):
        """In place: buf <- op over ranks of buf (same size and dtype on every rank).
        op: 'sum' | 'max' | 'min'. Returns buf."""
        return self._allreduce(buf, op, True).result

    def iallreduce(self, buf, op: str = "sum") -> Request:
        """Non-blocking `allreduce`; buf is undefined until the request's wait()."""
        return self._allreduce(buf, op, False)

    # ---- reduce-scatter

    def _reduce_scatter(self, send, recv, op, blocking):
        send_f, recv_f = _flat(send, "send"), _flat(recv, "recv")
        _same_dtype(send_f, recv_f)
        if send_f.size != recv_f.size * self.size:
            raise ValueError(
                f"reduce_scatter: send.size ({send_f.size}) must equal recv.size "
                f"({recv_f.size}) * comm size ({self.size})"
            )
        mpi_op = self._reduce_op(op, send_f.dtype)
        self._count("reduce_scatter", send_f.nbytes, self._ring(send_f.nbytes))
        calls = (lambda s, r: self.mpi.Reduce_scatter_block(s, r, mpi_op),
                 lambda s, r: self.mpi.Ireduce_scatter_block(s, r, mpi_op))
        return self._run(f"reduce_scatter({op})", calls, send_f, recv_f, recv, True, blocking)

    def reduce_scatter(self, send, recv, op: str = "sum"):
        """recv <- block `rank` of (op over ranks of send). Not in place.
        send.size == recv.size * size; block r is send[r*n:(r+1)*n], n = recv.size.
        Returns recv."""
        return self._reduce_scatter(send, recv, op, True).result

    def ireduce_scatter(self, send, recv, op: str = "sum") -> Request:
        """Non-blocking `reduce_scatter`; leave send and recv alone until wait()."""
        return self._reduce_scatter(send, recv, op, False)

    # ---- allgather

    def _allgather(self, send, recv, blocking):
        recv_f = _flat(recv, "recv" if send is not None else "buf")
        send_f = None
        if send is not None:
            send_f = _flat(send, "send")
            _same_dtype(send_f, recv_f)
            if recv_f.size != send_f.size * self.size:
                raise ValueError(
                    f"allgather: recv.size ({recv_f.size}) must equal send.size "
                    f"({send_f.size}) * comm size ({self.size})"
                )
        elif recv_f.size % self.size:
            raise ValueError(
                f"allgather_inplace: buf.size ({recv_f.size}) is not a multiple of comm size "
                f"({self.size})"
            )
        self._count("allgather", recv_f.nbytes, self._ring(recv_f.nbytes))
        calls = (self.mpi.Allgather, self.mpi.Iallgather)
        return self._run("allgather", calls, send_f, recv_f, recv, False, blocking)

    def allgather(self, send, recv):
        """recv[r*n:(r+1)*n] <- send of rank r, n = send.size; recv.size == n * size.
        Not in place. Returns recv."""
        return self._allgather(send, recv, True).result

    def iallgather(self, send, recv) -> Request:
        """Non-blocking `allgather`."""
        return self._allgather(send, recv, False)

    def allgather_inplace(self, buf):
        """In place: buf holds this rank's block at buf[rank*n:(rank+1)*n], n = buf.size // size;
        afterwards every block is filled from its rank. Returns buf."""
        return self._allgather(None, buf, True).result

    def iallgather_inplace(self, buf) -> Request:
        """Non-blocking `allgather_inplace`."""
        return self._allgather(None, buf, False)

    # ---- broadcast, barrier, scalars, objects

    def broadcast(self, buf, root: int = 0):
        """In place: buf <- buf of `root` (same size and dtype on every rank). Returns buf."""
        flat = _flat(buf, "buf")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} not in [0, {self.size})")
        self._count("broadcast", flat.nbytes, flat.nbytes if self.rank == root else 0)
        bcast = (lambda s, r: self.mpi.Bcast(r, root),) * 2
        return self._run(f"broadcast(root={root})", bcast, None, flat, buf, False, True).result

    def barrier(self):
        """Block until every rank of this Comm has called barrier()."""
        self._start_queued()
        if self.check_collectives:
            self._check_call("barrier")
        with _watched(f"barrier ({self.size} ranks)"):
            self.mpi.Barrier()

    def allreduce_scalar(self, x: float, op: str = "sum") -> float:
        """op over ranks of one Python float (reduced as float64); returns the result."""
        buf = np.array([float(x)], dtype=np.float64)
        mpi_op = self._reduce_op(op, buf.dtype)
        self._count("allreduce_scalar", buf.nbytes, self._ring(buf.nbytes, 2))
        scalar = (lambda s, r: self.mpi.Allreduce(s, r, mpi_op),) * 2
        self._run(f"allreduce_scalar({op})", scalar, None, buf, buf, True, True)
        return float(buf[0])

    def bcast_object(self, obj, root: int = 0):
        """Pickled broadcast of a small Python object; returns root's object on every rank.
        Counted under 'object' with its pickled size, as a broadcast."""
        self._start_queued()
        if self.check_collectives:
            self._check_call(f"bcast_object(root={root})")
        with _watched(f"bcast_object ({self.size} ranks)"):
            obj = self.mpi.bcast(obj, root=root)
        nbytes = len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        self._count("object", nbytes, nbytes if self.rank == root else 0)
        return obj

    def allgather_object(self, obj) -> list:
        """Pickled allgather of a small Python object; returns [object of rank 0, ...].
        Counted under 'object' with the total pickled size, as an allgather."""
        self._start_queued()
        if self.check_collectives:
            self._check_call("allgather_object")
        with _watched(f"allgather_object ({self.size} ranks)"):
            objs = self.mpi.allgather(obj)
        nbytes = sum(len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in objs)
        self._count("object", nbytes, self._ring(nbytes))
        return objs

    wait_all = staticmethod(wait_all)

    # ---- sub-communicators

    def split(self, color: int, key: int | None = None) -> Comm | None:
        """Collective: a new Comm of the ranks that passed the same color, ordered by key
        (default: this rank), with its own counters. color=MPI.UNDEFINED returns None."""
        self._start_queued()
        sub = self.mpi.Split(color, self.rank if key is None else key)
        return None if sub == MPI.COMM_NULL else Comm(sub)

    def free(self):
        """Release the MPI communicator of a split Comm (no-op for COMM_WORLD)."""
        self._start_queued()
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.mpi.Free()

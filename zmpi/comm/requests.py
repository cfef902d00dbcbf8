"""Requests: `Request` (a collective or point-to-point message, queued or started),
`wait_all`, the request queue of each MPI communicator (`_QUEUES`, `start_queued`), the
progress thread (`_Progress`) that drives MPI while non-blocking operations are in flight,
and the MPI calls of a point-to-point message (`message_calls`, `_Message`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time

from zmpi import backend
from zmpi.comm.staging import _POOL
from zmpi.comm.watchdog import _watched
from zmpi.comm.wire import _spec, header_mismatch, header_payload, message_header, message_tags
from zmpi.kernels import host as host_kernels

# isort: split
import numpy as np
from mpi4py import MPI

_QUEUES: dict[int, list] = {}  # MPI communicator handle -> its queued requests


class Request:
    """A collective or point-to-point message, queued or started. `wait()` (idempotent)
    completes it and returns the result array; `test()` starts it if its inputs are ready,
    completes it if MPI has finished, and says whether it is done (it never blocks).

    A collective on device buffers may wait to start: MPI may only read the buffers once the
    GPU has written them (its device-to-host staging copy, or the kernels that wrote a buffer
    MPI reads directly, are still queued on a stream). Such a request sits in its Comm's
    queue until its `inputs` (objects with ready()/wait(): backend.HostCopy, StreamPoint) are
    ready; the Comm starts queued requests in order, never one before an earlier one, so
    every rank starts the same collectives in the same order. With host staging, completion
    queues the copy of the result back to the device on the current stream (later GPU work
    is ordered after it) and returns the host buffer to the pool once that copy has landed.
    A reduction that travelled as float32 (`zmpi.comm.wire`) is then rounded into the
    caller's 16-bit buffer (`narrow`), on the current stream for a device buffer.
    A receive whose message did not fit its buffer (`_Message.problem`) completes, and its
    wait() and test() then raise ValueError, every time.
    """

    def __init__(self, comm, op, start, blocking, result, keep=(), inputs=(), copy_back=(),
                 held=(), what=None, narrow=()):
        self.op = op
        self._what = what or op  # for the watchdog: the op, dtype, size (or () -> that)
        self._comm = comm
        self._start_mpi = start  # () -> the MPI call's Request (None when blocking)
        self._blocking = blocking
        self._mpi = None
        self.result = result  # the caller's output array
        self._keep = keep  # arrays MPI reads or writes: alive until done
        self._inputs = list(inputs)  # copies / stream points MPI must wait for
        self._copy_back = copy_back  # ((host, device), ...)
        self._held = held  # staging buffers to return to the pool
        self._narrow = narrow  # ((float32 result, caller's 16-bit output), ...)
        self.started = False
        self.done = False
        self._failed: BaseException | None = None  # what starting it raised
        self._error: BaseException | None = None  # what completing it found (a message)

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
        if self._error is not None:
            raise self._error
        return self.done

    def wait(self):
        if not self.done:
            self.start()
            if self._mpi is not None:
                with _watched(f"the wait for a non-blocking {self.op}"):
                    self._mpi.Wait()
            self._finish()
        if self._error is not None:
            raise self._error
        return self.result

    def _finish(self):
        if not self._blocking:
            _PROGRESS.finished()
        fence = None
        for host, device in self._copy_back:
            fence = backend.to_device_async(host, device)
        for buf in self._held:
            _POOL.release(buf, fence)
        for wide, out in self._narrow:  # after the copy back, on the same stream
            host_kernels.cast_(out, wide)
        problem = getattr(self._mpi, "problem", None)  # a message that did not fit
        self._error = None if problem is None else problem()
        self._keep = self._held = self._copy_back = self._narrow = ()
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
    it only where the node has two cores or more per rank, 1 always, 0 never.

    Under CuPy the current device is per host thread, and the progress MPI makes in this
    thread may touch device memory or record events (a CUDA-aware MPI): before each poll the
    thread makes the rank's GPU (`backend.device_id`, chosen by `backend.select_device`)
    current if it is not already, so it never works on (or creates a context on) device 0
    by default. Before any device is chosen it stays on CuPy's default, as the main thread
    does. Under NumPy it touches no GPU module."""

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
        self.pokes = 0  # Iprobe calls `poke` made from the caller's thread (for tests)
        self._probe = None  # the private communicator probed (made at the first probe)
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
                self._thread = threading.Thread(target=self._run, name="zmpi-progress",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.stop)  # runs before mpi4py's MPI_Finalize (registered first)
            self._cond.notify()

    def finished(self) -> None:
        """A non-blocking collective completed."""
        with self._cond:
            self._in_flight -= 1

    def poke(self) -> None:
        """Drive MPI's progress once from the calling thread, if anything non-blocking is in
        flight and no progress thread does it (see `make_progress`)."""
        if self._in_flight <= 0 or self._thread is not None:
            return
        self._probe_once()
        self.pokes += 1

    def _probe_once(self) -> None:
        """One MPI_Iprobe on a private communicator (nothing matches): MPI's progress runs."""
        if self._probe is None:
            self._probe = MPI.COMM_SELF.Dup()
        self._probe.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        bound = None  # the device this thread made current
        while True:
            with self._cond:
                while self._in_flight <= 0 and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            if backend.is_gpu and backend.device_id not in (None, bound):
                bound = backend.device_id
                backend.xp.cuda.Device(bound).use()
            self._probe_once()
            self.polls += 1
            time.sleep(self.interval)


_PROGRESS = _Progress()


def wait_all(requests):
    """Wait for every request (one MPI Waitall for those in flight); returns their results."""
    for r in requests:
        r.start()
    # collectives: one Waitall; messages (each a _Message) are waited for one by one below
    pending = [r for r in requests if not r.done and isinstance(r._mpi, MPI.Request)]
    if pending:
        with _watched(f"a wait for {len(pending)} non-blocking collectives"):
            MPI.Request.Waitall([r._mpi for r in pending])
        for r in pending:
            r._mpi = None  # completed; wait() below only finishes (copies back, frees)
    return [r.wait() for r in requests]


def make_progress() -> None:
    """Let MPI move what is in flight, once, from this thread, where no progress thread does
    (one MPI_Iprobe; nothing when nothing is in flight). The engine calls it between units.
    Without a single-copy path between processes (CMA, XPMEM; a container's seccomp profile
    often forbids CMA) MPI moves a message above its eager limit only inside MPI calls on
    both ranks: a pipeline's activation waited for its sender's next op, a bucket's reduction
    for the end of backward. Measured on 2 ranks with Open MPI 5 and single copy off: a 1 MiB
    message behind 20 ms of compute arrived after 21 ms, with a call between matmuls after
    9 ms (64 KiB: 1.5 ms), and pipeline steps went from 1.2-1.5x slower than with single copy
    to as fast. MPICH moves only a few KiB per call there (its own progress thread helps:
    MPIR_CVAR_ASYNC_PROGRESS=1)."""
    _PROGRESS.poke()


def start_queued(queue: list, through: Request | None = None, block: bool = True) -> None:
    """Start the requests of `queue` in order: all of them (`through=None`), or up to and
    including `through`; without `block`, only while the next one's inputs are ready."""
    while queue:
        if not block and not queue[0].ready_to_start():
            return
        req = queue.pop(0)
        try:
            req._start()
        except BaseException as e:  # its own wait() must not pass for a completion
            req._failed = e
            raise
        if req is through:
            return


class _Message:
    """The MPI requests of one non-blocking point-to-point message (its header and payload),
    driven by a Request as it drives one MPI request (Test, Wait). An MPI error in them (a
    payload larger than the receive buffer: MPI_ERR_TRUNCATE) is kept, not raised, and
    `problem()` (called once both completed) turns it, or a header that does not match the
    buffer, into the exception the Request raises: `check(error)` -> exception or None."""

    def __init__(self, requests, keep=(), check=None):
        self._requests, self._keep, self._check = list(requests), keep, check
        self._error: BaseException | None = None

    def Test(self) -> bool:  # noqa: N802 (mpi4py's names)
        try:
            return MPI.Request.Testall(self._requests)
        except MPI.Exception as e:
            self._error = e
            self.Wait()  # the rest (the failed one has completed)
            return True

    def Wait(self) -> None:  # noqa: N802
        try:
            MPI.Request.Waitall(self._requests)
        except MPI.Exception as e:
            self._error = self._error or e

    def problem(self) -> BaseException | None:
        return self._check(self._error) if self._check is not None else self._error


def message_calls(mpi, op: str, flat, peer: int, tag: int) -> tuple:
    """The (blocking, non-blocking) calls of a point-to-point message on communicator `mpi`,
    each `call(sendspec, recvspec)`, as `Comm._launch` takes them: op 'send' sends `flat`'s
    header (`wire.message_header`), then its payload, to rank `peer`; 'recv' receives them
    from `peer` into `flat` and raises ValueError if the header does not match `flat` (a
    blocking recv takes the payload off the wire first; an irecv's wait() raises it)."""
    data, head = message_tags(tag)
    if op == "send":
        header = [message_header(flat), MPI.INT64_T]
        return (lambda s, r: (mpi.Send(header, peer, head), mpi.Send(s, peer, data)),
                lambda s, r: _Message([mpi.Isend(header, peer, head), mpi.Isend(s, peer, data)],
                                      keep=header))
    header = [np.zeros(2, np.int64), MPI.INT64_T]

    def mismatch(error=None):  # the exception the header calls for, else `error`
        problem = header_mismatch(header[0], flat, peer, tag)
        if problem is None:
            return error
        found = ValueError(problem)
        found.__cause__ = error  # MPI's truncation error, if the payload did not fit
        return found

    def receive(s, r):
        mpi.Recv(header, peer, head)
        found = mismatch()
        if found is not None:
            mpi.Recv(_spec(header_payload(header[0])), peer, data)  # out of the way
            raise found
        mpi.Recv(r, peer, data)

    return receive, lambda s, r: _Message([mpi.Irecv(header, peer, head),
                                           mpi.Irecv(r, peer, data)], keep=header, check=mismatch)

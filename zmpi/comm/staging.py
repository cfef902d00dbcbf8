"""The host staging of device buffers, for an MPI that does not take them: a pool of pinned
host buffers, its ledger accounting, and `stage`, which swaps a call's device arrays for
pooled host ones.

Device buffers (CuPy). Whether MPI is CUDA-aware is asked of the MPI library itself
(`zmpi.comm.mpi_info.cuda_support`). If it is, the device buffer is passed directly once the
kernels queued before the call have finished (an event on the current stream, not a
device-wide synchronize), and a non-blocking collective runs blocking on Open MPI, whose
non-blocking collectives do not take device memory. Otherwise the buffer is staged: copied
into a pinned host buffer (pooled and reused by shape and dtype, registered with the engine's
ledger) on a side stream, the MPI op runs on the host, and the result is copied back on the
current stream when the request is waited for, so later kernels see it; an in-place
allgather copies in only this rank's block. Nothing blocks at launch: the request waits in
the Comm's queue until its copy has landed and starts then (at the next collective on that
Comm, or at its wait), in call order, so GPU work, copies and MPI overlap
(`zmpi.comm.requests`). `Comm.staged_bytes` counts what crossed. Point-to-point messages of
device buffers take the same path.
"""

from __future__ import annotations

import weakref

import numpy as np

from zmpi import backend


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



def stage(send, recv, copy_recv_in: bool, staged_bytes: dict, block=None):
    """Host stand-ins for the device arrays among `send` and `recv` (either may be None):
    returns (send, recv, inputs, held, copy_back), the arrays MPI is given, the copies to
    the host it must wait for, the pool buffers it holds, and the ((host, device), ...) pairs
    to copy back when it completes (recv, if staged). `send` is copied in; `recv` only with
    `copy_recv_in` (in place), and then only `recv[block]` when a slice is given (an in-place
    allgather reads only this rank's block). `staged_bytes` ({'to_host', 'to_device'}) counts
    the bytes that cross."""
    inputs, held, copy_back = [], [], []

    def staged(a, copy_in: bool):
        if a is None or not backend.is_device_array(a):
            return a
        host = _POOL.acquire(a.shape, a.dtype)
        held.append(host)
        if copy_in and block is not None:  # MPI reads only our block
            inputs.append(backend.HostCopy(a[block], host[block]))
            staged_bytes["to_host"] += host[block].nbytes
        elif copy_in:
            inputs.append(backend.HostCopy(a, host))
            staged_bytes["to_host"] += host.nbytes
        return host

    send_h = staged(send, copy_in=True)
    recv_h = staged(recv, copy_in=copy_recv_in)
    if recv_h is not recv:
        copy_back.append((recv_h, recv))
        staged_bytes["to_device"] += recv.nbytes
    return send_h, recv_h, inputs, held, copy_back

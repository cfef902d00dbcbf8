"""Comm: a communicator's rank, size and node-local rank, its collectives on flat buffers,
point-to-point messages, counters, split/free, and the pickled object collectives.

Every array collective in zmpi goes through a `Comm`, which wraps an mpi4py communicator and
uses only mpi4py's buffer (upper-case) methods; pickling (lower-case) methods are used only by
`bcast_object`/`allgather_object`, for small Python objects. Every buffer operation takes one
path, `Comm._launch`: device buffers staged (`staging`) or handed to a CUDA-aware MPI, the
request queued in call order and started when its inputs are in place (`requests`), every
blocking wait watched by the watchdog (`watchdog._watched`).

Point-to-point. `send`/`recv`/`isend`/`irecv` move one buffer between two ranks, on the same
path: counted, queued in call order with the collectives, watched, device buffers staged or
handed to a CUDA-aware MPI (never made blocking: Open MPI's point-to-point takes device
memory). Each message is a 16-byte header (dtype, count) and the payload, on wire tags 2t+1
and 2t for user tag t (so t <= (MPI_TAG_UB - 1) // 2); a receiver whose buffer differs in
dtype or size raises ValueError naming both (`wire.header_mismatch`). Messages are not
collective: the debug collective check neither checks nor numbers them.

Counters. `comm.counters[op]` is an `OpCounter(calls, bytes, sent)` per op in `OPS`: what
each counts, and the ring model of `sent`, are in `zmpi.comm.wire`'s docstring.
"""

from __future__ import annotations

import atexit
import os
import pickle
import time
from dataclasses import asdict

import numpy as np

from zmpi import backend  # before mpi4py.MPI (MPI_Init): it picks this rank's GPU
from zmpi.comm.checks import check_at_exit, check_call, check_settings_alike
from zmpi.comm.faults import gather_peers, install_abort_on_exception
from zmpi.comm.mpi_info import cuda_support, mpi_flavour
from zmpi.comm.requests import _PROGRESS, _QUEUES, Request, message_calls, start_queued, wait_all
from zmpi.comm.staging import stage
from zmpi.comm.watchdog import _watchdog, _watched
from zmpi.comm.wire import (
    OPS,
    OpCounter,
    _flat,
    _reduce_op,
    _same_dtype,
    _spec,
    _wire,
    widened,
)
from zmpi.memory import ring_bytes

# isort: split
from mpi4py import MPI


class Comm:
    """A communicator: rank, size, node-local rank, collectives, messages and counters.

    Constructing one is collective over `mpi_comm` (it splits off the node-local group).
    """

    def __init__(self, mpi_comm=None):
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        # collectives waiting for their inputs, in call order; one queue per MPI communicator,
        # shared by every Comm wrapping it (MPI's ordering rule is per communicator): another
        # Comm's queued ones go before this constructor's collectives
        self._queue: list[Request] = _QUEUES.setdefault(self.mpi.py2f(), [])
        self._start_queued()
        local = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = local.Get_rank(), local.Get_size()
        if self.mpi == MPI.COMM_WORLD and self.local_size > 1:
            gather_peers(local)  # once: whom an abort ends on this host
        local.Free()
        _PROGRESS.ranks_on_node = max(_PROGRESS.ranks_on_node, self.local_size)
        self.is_cuda_aware, self.cuda_aware_source = cuda_support()
        # Open MPI's CUDA support covers blocking collectives only (its non-blocking ones reduce
        # on the host: ompi #9845, #12045): there a device buffer's collective runs blocking.
        self.nonblocking_on_device = mpi_flavour() != "Open MPI"
        self.counters = {op: OpCounter() for op in OPS}
        self.staged_bytes = {"to_host": 0, "to_device": 0}  # device buffers staged via the host
        self.check_collectives = False
        self._calls = 0  # collectives started on this communicator (the debug check's index)
        debug = os.environ.get("ZMPI_DEBUG", "").strip() not in ("", "0")
        if MPI.COMM_WORLD.Get_size() > 1:  # before the settings check: its error said once
            install_abort_on_exception()
        if self.size > 1:  # which MPI calls a rank makes: alike on every rank, or an error
            check_settings_alike(self.mpi, {
                "the backend (ZMPI_BACKEND: CuPy or NumPy)": backend.is_gpu,
                "whether MPI is CUDA-aware (ZMPI_CUDA_AWARE), on the GPU backend":
                    backend.is_gpu and self.is_cuda_aware,
                "the collective check (ZMPI_DEBUG)": debug})
        if debug:
            self.enable_collective_checks()
        _watchdog()

    # ---- the debug check

    def enable_collective_checks(self) -> None:
        """Before every collective, compare what each rank is about to call (index, op, dtype,
        element counts); a mismatch raises CollectiveMismatch on every rank, naming what each
        called and where, instead of deadlocking or corrupting memory. Costs one small
        pickled allgather per collective. On the world communicator, a rank that ends the
        program while another waits in a collective is reported the same way.
        Point-to-point messages are not collective and are not checked (their header is)."""
        if self.check_collectives:
            return
        self.check_collectives = True
        if self.mpi == MPI.COMM_WORLD and self.size > 1:
            atexit.register(check_at_exit, self)

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
        """The one counting point for every collective and message (see the module
        docstring)."""
        c = self.counters[op]
        c.calls += 1
        c.bytes += int(nbytes)
        c.sent += int(sent)

    # ---- the one path for buffer collectives and messages

    def _run(self, op, calls, send, recv, result, blocking: bool, into=None) -> Request:
        """A collective: check (debug), then `_launch`. `send=None` means in place
        (MPI.IN_PLACE: recv holds the input too; for an in-place allgather only this rank's
        block of it). `into`: the caller's flat output when `recv` is its float32 stand-in
        (a reduction that travels as float32, `wire.widened`); recv is rounded into it when
        the request completes. The debug check and the watchdog name the caller's dtype."""
        dtype = recv.dtype if into is None else into.dtype
        if self.check_collectives:
            self._start_queued()  # the check is a collective too: keep the order
            check_call(self, op, dtype, (0 if send is None else send.size, recv.size))
        block = None
        if op == "allgather" and send is None:  # MPI reads only our block
            n = recv.shape[0] // self.size
            block = slice(self.rank * n, (self.rank + 1) * n)
        wide, size, ranks = None if into is None else recv.dtype, recv.size, self.size
        return self._launch(op, calls, send, recv, result, blocking,
                            copy_recv_in=send is None, block=block,
                            narrow=() if into is None else ((recv, into),),
                            what=lambda: f"{op} ({dtype} x {size}"
                            f"{'' if wide is None else f' as {wide}'}, {ranks} ranks)")

    def _launch(self, op, calls, send, recv, result, blocking: bool, *, copy_recv_in: bool,
                what, block=None, collective: bool = True, narrow=()) -> Request:
        """Stage device buffers through host memory if needed, queue the MPI call, and start
        it as soon as its inputs are in place (blocking: now, watched by the watchdog).

        `calls` = (blocking call, non-blocking call), each `call(sendspec, recvspec)` making
        the mpi4py call (the non-blocking one returns an MPI request or a `_Message`); send
        or recv None is passed as MPI.IN_PLACE. `what`: () -> the watchdog's name for it, made
        only if shown (numpy's str(dtype) takes 8 us). `result` is what wait() returns; `narrow`,
        the ((float32 recv, caller's output), ...) to round back when it completes. A device
        buffer is staged unless MPI is CUDA-aware, and a collective on it runs blocking where
        the MPI's non-blocking collectives do not support device memory (Open MPI). On one
        rank a collective's result is its input: it completes at once, copying send into recv
        where they differ, and neither MPI nor the host sees the buffers (a single GPU would
        otherwise send every gradient bucket over PCIe and back).
        """
        wire = _wire(recv.dtype if recv is not None else send.dtype)
        keep = (send, recv, result)
        local = collective and self.size == 1  # the result is the input: no MPI, no staging
        on_device = not local and (backend.is_device_array(send)
                                   or backend.is_device_array(recv))
        staged = on_device and not self.is_cuda_aware
        if local or (on_device and not staged and not self.nonblocking_on_device and collective):
            blocking = True
        inputs, held, copy_back = [], [], []
        if on_device and not staged:
            inputs.append(backend.StreamPoint())  # MPI reads device memory the GPU writes
        if staged:
            send, recv, inputs, held, copy_back = stage(send, recv, copy_recv_in,
                                                        self.staged_bytes, block)
        if local:
            start = (lambda: None) if send is None else (lambda: backend.copy_(recv, send))
        else:
            call = calls[0] if blocking else calls[1]
            start = lambda: call(_spec(send, wire), _spec(recv, wire))  # noqa: E731
        req = Request(self, op, start, blocking, result, keep, inputs, copy_back, held,
                      what=what, narrow=narrow)
        self._queue.append(req)
        if blocking:
            req.wait()
        else:
            self._start_queued(through=None, block=False)
        return req

    def _start_queued(self, through: Request | None = None, block: bool = True) -> None:
        """Start queued requests in order: all of them (`through=None`), or up to and
        including `through`; without `block`, only while the next one's inputs are ready."""
        start_queued(self._queue, through, block)

    def _widened(self, a, copy: bool):
        """`wire.widened(a, copy)` where the reduction travels, `a` itself on one rank: nothing
        travels there (`_launch`), so a bfloat16 buffer is not copied to float32 and back (two
        cast kernels a bucket on a GPU)."""
        return a if self.size == 1 else widened(a, copy)

    # ---- allreduce

    def _allreduce(self, buf, op, blocking):
        flat = _flat(buf, "buf")
        mpi_op = _reduce_op(op)
        wide = self._widened(flat, copy=True)
        self._count("allreduce", flat.nbytes, self._ring(wide.nbytes, 2))
        calls = (lambda s, r: self.mpi.Allreduce(s, r, mpi_op),
                 lambda s, r: self.mpi.Iallreduce(s, r, mpi_op))
        return self._run(f"allreduce({op})", calls, None, wide, buf, blocking,
                         into=None if wide is flat else flat)

    def allreduce(self, buf, op: str = "sum"):
        """In place: buf <- op over ranks of buf (same size and dtype on every rank).
        op: 'sum' | 'max' | 'min' (MPI's predefined ops; bfloat16, and float16 on an MPI
        without a float16 type, are reduced in float32 and rounded once). Returns buf."""
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
        mpi_op = _reduce_op(op)
        wide_send, wide_recv = self._widened(send_f, True), self._widened(recv_f, False)
        self._count("reduce_scatter", send_f.nbytes, self._ring(wide_send.nbytes))
        calls = (lambda s, r: self.mpi.Reduce_scatter_block(s, r, mpi_op),
                 lambda s, r: self.mpi.Ireduce_scatter_block(s, r, mpi_op))
        return self._run(f"reduce_scatter({op})", calls, wide_send, wide_recv, recv, blocking,
                         into=None if wide_recv is recv_f else recv_f)

    def reduce_scatter(self, send, recv, op: str = "sum"):
        """recv <- block `rank` of (op over ranks of send). Not in place.
        send.size == recv.size * size; block r is send[r*n:(r+1)*n], n = recv.size.
        op as for `allreduce`. Returns recv."""
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
        return self._run("allgather", calls, send_f, recv_f, recv, blocking)

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

    # ---- all-to-all

    def _alltoall(self, send, recv, blocking):
        send_f, recv_f = _flat(send, "send"), _flat(recv, "recv")
        _same_dtype(send_f, recv_f)
        if send_f.size != recv_f.size or send_f.size % self.size:
            raise ValueError(f"alltoall: send.size ({send_f.size}) and recv.size "
                             f"({recv_f.size}) must be equal and a multiple of comm size "
                             f"({self.size})")
        self._count("alltoall", send_f.nbytes, self._ring(send_f.nbytes))
        return self._run("alltoall", (self.mpi.Alltoall, self.mpi.Ialltoall), send_f, recv_f,
                         recv, blocking)

    def alltoall(self, send, recv):
        """recv[r*n:(r+1)*n] <- block `rank` of rank r's send, n = send.size // size: block
        j of send, send[j*n:(j+1)*n], goes to rank j. Not in place; send.size == recv.size,
        a multiple of size. Returns recv."""
        return self._alltoall(send, recv, True).result

    def ialltoall(self, send, recv) -> Request:
        """Non-blocking `alltoall`; leave send and recv alone until wait()."""
        return self._alltoall(send, recv, False)

    # ---- broadcast, barrier, scalars, objects

    def broadcast(self, buf, root: int = 0):
        """In place: buf <- buf of `root` (same size and dtype on every rank). Returns buf."""
        flat = _flat(buf, "buf")
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root {root} not in [0, {self.size})")
        self._count("broadcast", flat.nbytes, flat.nbytes if self.rank == root else 0)
        bcast = (lambda s, r: self.mpi.Bcast(r, root),) * 2
        return self._run(f"broadcast(root={root})", bcast, None, flat, buf, True).result

    def barrier(self, idle: bool = False):
        """Block until every rank of this Comm has called barrier(). `idle`: wait asleep (an
        Ibarrier tested every millisecond) instead of in MPI's spinning progress, leaving the
        cores to the ranks that compute (where ranks outnumber them)."""
        self._start_queued()
        if self.check_collectives:
            check_call(self, "barrier")
        with _watched(f"barrier ({self.size} ranks)"):
            if not idle:
                self.mpi.Barrier()
                return
            request = self.mpi.Ibarrier()
            while not request.Test():
                time.sleep(1e-3)

    def allreduce_scalar(self, x: float, op: str = "sum") -> float:
        """op over ranks of one Python float (reduced as float64); returns the result."""
        buf = np.array([float(x)], dtype=np.float64)
        mpi_op = _reduce_op(op)
        self._count("allreduce_scalar", buf.nbytes, self._ring(buf.nbytes, 2))
        scalar = (lambda s, r: self.mpi.Allreduce(s, r, mpi_op),) * 2
        self._run(f"allreduce_scalar({op})", scalar, None, buf, buf, True)
        return float(buf[0])

    def bcast_object(self, obj, root: int = 0):
        """Pickled broadcast of a small Python object; returns root's object on every rank.
        Counted under 'object' with its pickled size, as a broadcast."""
        self._start_queued()
        if self.check_collectives:
            check_call(self, f"bcast_object(root={root})")
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
            check_call(self, "allgather_object")
        with _watched(f"allgather_object ({self.size} ranks)"):
            objs = self.mpi.allgather(obj)
        nbytes = sum(len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in objs)
        self._count("object", nbytes, self._ring(nbytes))
        return objs

    # ---- point-to-point messages

    def _message(self, op, buf, peer, tag, blocking) -> Request:
        """send or recv (`requests.message_calls`: a header, then the payload; the receiver
        checks the header against its buffer). Not collective: no debug check, and a device
        buffer takes the collectives' path (CUDA-aware, else staged) but never the Open MPI
        blocking fallback (its point-to-point takes device memory)."""
        flat = _flat(buf, "buf")
        if not 0 <= peer < self.size:
            raise ValueError(f"{op}: rank {peer} not in [0, {self.size})")
        # MPI attaches TAG_UB to MPI_COMM_WORLD, where every communicator's tags are bounded;
        # Open MPI answers None when a communicator split from it is asked
        top = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - 1) // 2
        if not 0 <= tag <= top:
            raise ValueError(f"{op}: tag {tag} not in [0, {top}]")
        calls = message_calls(self.mpi, op, flat, peer, tag)
        send, recv = (flat, None) if op == "send" else (None, flat)
        self._count(op, flat.nbytes, flat.nbytes if op == "send" else 0)
        where = "to" if op == "send" else "from"
        dtype, size = flat.dtype, flat.size
        return self._launch(op, calls, send, recv, buf, blocking, copy_recv_in=False,
                            collective=False,
                            what=lambda: f"{op} ({dtype} x {size} {where} rank {peer}, tag {tag})")

    def send(self, buf, dest: int, tag: int = 0):
        """Send buf to rank `dest`, which receives it with recv(buf of the same dtype and
        size, source=this rank, tag). Blocks until buf may be reused (for a large message:
        until dest receives it). Returns buf."""
        return self._message("send", buf, dest, tag, True).result

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into buf the message rank `source` sent with `tag`; messages between two
        ranks with one tag arrive in the order sent. A message of another dtype or size
        raises ValueError (after taking it off the wire). Returns buf."""
        return self._message("recv", buf, source, tag, True).result

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        """Non-blocking `send`; leave buf alone until the request's wait()."""
        return self._message("send", buf, dest, tag, False)

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        """Non-blocking `recv`; buf is undefined until wait(), which raises ValueError if the
        message did not match buf's dtype and size."""
        return self._message("recv", buf, source, tag, False)

    wait_all = staticmethod(wait_all)

    # ---- sub-communicators

    def split(self, color: int, key: int | None = None) -> Comm | None:
        """Collective: a new Comm of the ranks that passed the same color, ordered by key
        (default: this rank), with its own counters. color=MPI.UNDEFINED returns None."""
        self._start_queued()
        with _watched(f"split ({self.size} ranks)"):
            sub = self.mpi.Split(color, self.rank if key is None else key)
        return None if sub == MPI.COMM_NULL else Comm(sub)

    def free(self):
        """Release the MPI communicator of a split Comm (no-op for COMM_WORLD)."""
        self._start_queued()
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.mpi.Free()

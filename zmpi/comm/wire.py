"""How buffers travel over MPI: datatypes, reduction ops, the checks every buffer passes, the
header of a point-to-point message, and the counters' op names (`OPS`, `OpCounter`).

Buffers. Every buffer is a contiguous array (any shape; it is treated as flat 1-D) of
float64, float32, float16, bfloat16 (`ml_dtypes.bfloat16`), int32, int64 or uint8. Sizes are
checked locally before MPI is called, so a mismatch raises ValueError on the rank that has it
rather than hanging or corrupting memory. (A mismatch *between* ranks, e.g. rank 0 passes 10
elements and rank 1 passes 12, cannot be seen locally; that is the caller's contract. A
point-to-point message carries a header, so there the receiver does see it: `message_header`.)

float16 and bfloat16. float16 travels as MPI's native 16-bit float when the library has one
(MPICH: MPIX_C_FLOAT16) and is then reduced natively. bfloat16 has no MPI datatype, and
neither has float16 on an MPI without MPIX_C_FLOAT16: such a buffer moves as 2-byte words
(MPI_UINT16_T) in allgather, broadcast and point-to-point messages, and a reduction of it
travels as float32. The buffer is converted to float32 where it lives (host or device),
reduced with MPI's predefined SUM/MAX/MIN, and the result is rounded back to its dtype once
(to nearest even) when the request completes (`reduction_dtype`, `widened`). No reduction
runs a Python-level (user-defined) MPI.Op, so a CUDA-aware MPI reduces every device buffer
on the device. The price: such a reduction sends 4 bytes an element instead of 2 (the
counters count the float32 bytes) and holds float32 copies of its buffers while in flight.
Its result is the float32 reduction rounded once, not rounded after every pairwise step.

Counters. `comm.counters[op]` is an `OpCounter(calls, bytes, sent)` for op in
'allreduce', 'reduce_scatter', 'allgather', 'alltoall', 'broadcast', 'allreduce_scalar',
'object', 'send', 'recv' (blocking and non-blocking calls count under the same name, when
they are called). `bytes` is the logical payload: allreduce buf.nbytes, reduce_scatter
send.nbytes, allgather recv.nbytes (the full gathered buffer), alltoall send.nbytes,
broadcast buf.nbytes, allreduce_scalar 8,
object the pickled size, send and recv buf.nbytes. `sent` is what this rank sends under
bandwidth-optimal ring algorithms, for a full buffer of B bytes on the wire on N ranks (B is
the buffer's nbytes, except that a reduction of a 16-bit float the MPI has no type for -
bfloat16, or float16 without MPIX_C_FLOAT16 - travels as float32: B = 2 nbytes, see
above):

    allreduce        2 (N-1)/N B   (reduce-scatter then allgather)
    reduce_scatter     (N-1)/N B
    allgather          (N-1)/N B
    alltoall           (N-1)/N B   (every block but this rank's own; no ring involved)
    broadcast          B on the root, 0 elsewhere
    allreduce_scalar   as allreduce, B = 8
    object           bcast_object as broadcast; allgather_object as allgather
    send, recv         B for send, 0 for recv (the 16-byte header is not counted)

computed per call in integers as B*k*(N-1)//N (k = 2 for allreduce, 1 otherwise). This is
exact for reduce_scatter, allgather and alltoall (B is a multiple of N there) and rounds down
by less than one byte per call for allreduce when N does not divide 2(N-1)B. It is a model, not a
measurement of what MPICH's algorithm choice sent; it is the quantity the ZeRO paper's
communication analysis counts (stages 0-2: 2 Psi per step, stage 3: 3 Psi).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zmpi import backend  # before mpi4py.MPI: it picks this rank's GPU
from zmpi.kernels import host as host_kernels

# isort: split
from mpi4py import MPI

OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall", "broadcast", "allreduce_scalar",
       "object", "send", "recv")


@dataclass
class OpCounter:
    """Totals for one op: calls, logical payload bytes, ring-model bytes sent."""

    calls: int = 0
    bytes: int = 0
    sent: int = 0


@dataclass(frozen=True)
class _Wire:
    """How one numpy dtype travels over MPI."""

    datatype: MPI.Datatype
    as_words: bool  # no MPI type: moved as 2-byte words (uint16), reduced as float32


def _native_float16() -> MPI.Datatype:
    """MPI's 16-bit float if this library both names and reduces it, else DATATYPE_NULL.
    mpi4py may name FLOAT16_T where the library refuses it at the call (MPI_ERR_TYPE, seen
    with a system MPI on an H100 machine), so one element is summed on COMM_SELF first."""
    datatype = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
    if datatype == MPI.DATATYPE_NULL:
        return datatype
    one, out = np.ones(1, np.float16), np.zeros(1, np.float16)
    try:
        MPI.COMM_SELF.Allreduce([one, datatype], [out, datatype], MPI.SUM)
    except MPI.Exception:
        return MPI.DATATYPE_NULL
    return datatype if out[0] == 1 else MPI.DATATYPE_NULL


_FLOAT16_T = _native_float16()
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


def _wire(dtype) -> _Wire:
    dtype = np.dtype(dtype)
    if dtype not in _WIRES:
        names = ", ".join(str(d) for d in _WIRES)
        raise ValueError(f"dtype {dtype} is not supported by Comm; supported: {names}")
    return _WIRES[dtype]


def _spec(a, wire: _Wire | None = None):
    """mpi4py's [buffer, datatype] for array `a` (None: MPI.IN_PLACE), as `wire` (default:
    a's own dtype's) says it travels."""
    if a is None:
        return MPI.IN_PLACE
    wire = wire or _wire(a.dtype)
    return [a.view(np.uint16) if wire.as_words else a, wire.datatype]


def _check_op(op: str) -> str:
    if op not in _NATIVE_OPS:
        raise ValueError(f"unknown op {op!r}; valid: {', '.join(_NATIVE_OPS)}")
    return op


def _reduce_op(op: str) -> MPI.Op:
    """MPI's predefined op for `op` ('sum' | 'max' | 'min'); every reduction uses one."""
    return _NATIVE_OPS[_check_op(op)]


def reduction_dtype(dtype) -> np.dtype:
    """The dtype a reduction of `dtype` travels and is reduced in: float32 for a 16-bit float
    the MPI has no type for (bfloat16; float16 without MPIX_C_FLOAT16), else `dtype`."""
    return np.dtype(np.float32) if _wire(dtype).as_words else np.dtype(dtype)


def widened(a, copy: bool):
    """`a` itself if a reduction of its dtype travels as that dtype; else a float32 array of
    its shape in the same memory (host or device): a copy of `a` (rounding nothing) with
    `copy`, uninitialised without (an output)."""
    wide = reduction_dtype(a.dtype)
    if wide == a.dtype:
        return a
    if copy:
        return host_kernels.astype(a, wide)
    return backend.array_module(a).empty(a.shape, dtype=wide)


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


# --------------------------------------------------------------------------- point-to-point

_DTYPES = list(_WIRES)  # a header's dtype code: the index here


def message_tags(tag: int) -> tuple[int, int]:
    """(payload tag, header tag) on the wire of a point-to-point message with user `tag`: user
    tags never meet a header, and a header never meets a payload."""
    return 2 * tag, 2 * tag + 1


def message_header(flat) -> np.ndarray:
    """The header a point-to-point message is sent after: int64 [dtype code, element count]
    (16 bytes, not counted), so that a receiver sees a dtype or size that differs from its
    buffer's instead of silently reading the bytes as its own dtype or MPI truncating them."""
    return np.array([_DTYPES.index(np.dtype(flat.dtype)), flat.size], np.int64)


def header_mismatch(header, flat, source: int, tag: int) -> str | None:
    """What is wrong with receiving the message `header` announces into `flat`; None if
    nothing."""
    code, count = int(header[0]), int(header[1])
    dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"<dtype code {code}>"
    if dtype == flat.dtype and count == flat.size:
        return None
    return (f"recv: rank {source} sent {dtype} x {count} (tag {tag}), but the receive buffer "
            f"is {flat.dtype} x {flat.size}: dtype and size must match the send's")


def header_payload(header) -> np.ndarray:
    """A buffer that takes the payload `header` announces (to drain a message refused)."""
    return np.empty(int(header[1]), _DTYPES[int(header[0])])

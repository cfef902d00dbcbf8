"""How buffers travel over MPI: datatypes, reduction ops, the checks every buffer passes, the
header of a point-to-point message, and the counters' op names (`OPS`, `OpCounter`).

Buffers. Every buffer is a contiguous array (any shape; it is treated as flat 1-D) of
float64, float32, float16, bfloat16 (`ml_dtypes.bfloat16`), int32, int64 or uint8. Sizes are
checked locally before MPI is called, so a mismatch raises ValueError on the rank that has it
rather than hanging or corrupting memory. (A mismatch *between* ranks, e.g. rank 0 passes 10
elements and rank 1 passes 12, cannot be seen locally; that is the caller's contract. A
point-to-point message carries a header, so there the receiver does see it: `message_header`.)

float16 and bfloat16. float16 travels as MPI's native 16-bit float when the library has one
(MPICH: MPIX_C_FLOAT16); bfloat16 has no MPI datatype, so it travels as 2-byte words
(MPI_UINT16_T) and is reduced with a user-defined, commutative `MPI.Op` that views both
buffers as bfloat16, applies the op in float32 and rounds back to bfloat16 (round to nearest
even) after every pairwise step - the same rounding a native bf16 reduction would do, and no
extra traffic (upcasting whole buckets to float32 would double it). Allgather, broadcast and
point-to-point messages just move the 2-byte words. The same user op reduces float16 if an
MPI lacks a native one. A user op runs on the host, so a device buffer that needs one is
always staged (`zmpi.comm.staging`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zmpi import backend  # before mpi4py.MPI (MPI_Init): it picks this rank's GPU

# isort: split
from mpi4py import MPI

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "allreduce_scalar", "object",
       "send", "recv")


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


def _spec(a, wire: _Wire | None = None):
    """mpi4py's [buffer, datatype] for array `a` (None: MPI.IN_PLACE), as `wire` (default:
    a's own dtype's) says it travels."""
    if a is None:
        return MPI.IN_PLACE
    wire = wire or _wire(a.dtype)
    return [a.view(np.uint16) if wire.as_words else a, wire.datatype]


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


def _reduce_op(op: str, dtype) -> MPI.Op:
    """The MPI.Op that reduces `dtype` with `op` ('sum' | 'max' | 'min'): native, else user."""
    _check_op(op)
    if _wire(dtype).as_words:
        return _user_op(op, dtype)
    return _NATIVE_OPS[op]


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

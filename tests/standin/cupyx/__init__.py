"""cupyx of the cupy stand-in: pinned host arrays (counted)."""
import numpy as _np
from cupy import cuda as _cuda


def empty_pinned(shape, dtype=float):
    dtype = _np.dtype(dtype)
    count = int(_np.prod(shape, dtype=_np.int64))
    buf = _cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return _np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)

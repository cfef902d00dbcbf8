"""Parameter: a named pair of arrays (`data`, `grad`) that layers read at call time.

A Parameter owns nothing for long. It is created with its own host arrays, and the ZeRO engine
then rebinds `p.data` and `p.grad` to views into its flat buffers (after copying the values), or
sets them to None while ZeRO-3 has the unit's parameters released. Layers therefore read
`p.data` / `p.grad` at every call and never keep references to them across calls.
"""

import numpy

from zmpi import host_kernels
from zmpi.backend import array_module, compute_dtype


class Parameter:
    """A trainable tensor.

    Attributes (plain, rebindable by the engine):
      data: array of shape `shape` in the storage dtype (float32, float64, float16 or bfloat16),
            or None while released.
      grad: array with the same shape and dtype as `data` (zeros at construction), or None while
            released. Layers *accumulate* into it (`+=`); the engine zeroes it.
      shape: the logical shape, fixed at construction (still known while data is None).
    """

    def __init__(self, data):
        self.data = data
        self.grad = array_module(data).zeros_like(data)
        self.shape = tuple(data.shape)

    @property
    def size(self):
        """Number of elements (from the fixed logical shape)."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def dtype(self):
        """Storage dtype of `data`, or None while released."""
        return None if self.data is None else self.data.dtype

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


def live(p, what="data"):
    """Return `p.data` (or `p.grad`), raising RuntimeError if the engine has released it."""
    a = getattr(p, what)
    if a is None:
        raise RuntimeError(
            f"{p!r}.{what} is None: the parameter is released (ZeRO-3); gather it before use"
        )
    return a


def compute_data(p):
    """Return `p.data` in the dtype arithmetic runs in (`compute_dtype(p.data.dtype)`).

    float32/float64 storage returns `p.data` itself (no copy); float16/bfloat16 storage returns
    an upcast copy (on NumPy: float32). Call it at every use; do not keep the result.
    """
    data = live(p, "data")
    return host_kernels.astype(data, compute_dtype(data))


def accumulate_grad_(p, dW):
    """p.grad += dW, with dW in the compute dtype and p.grad in the storage dtype.

    The add runs in dW's dtype and is rounded once to the storage dtype, so a float16/bfloat16
    gradient accumulates without an extra rounding of dW. In place: p.grad may be a view into
    the engine's flat gradient buffer.
    """
    grad = live(p, "grad")
    if grad.dtype == dW.dtype:
        grad += dW
    else:
        # A float16 overflow to inf here is expected: the loss scaler detects it and skips
        # the step, so NumPy's cast warning is noise (CuPy does not warn).
        with numpy.errstate(over="ignore", invalid="ignore"):
            total = host_kernels.astype(grad, dW.dtype)  # a copy
            total += dW
            host_kernels.cast_(grad, total)

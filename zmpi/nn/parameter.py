"""Parameter: a named pair of arrays (`data`, `grad`) that layers read at call time.

A Parameter owns nothing for long. It is created with its own host arrays, and the ZeRO engine
then rebinds `p.data` and `p.grad` to views into its flat buffers (after copying the values), or
sets them to None while ZeRO-3 has the unit's parameters released. Layers therefore read
`p.data` / `p.grad` at every call and never keep references to them across calls.
"""

import numpy

from zmpi.backend import array_module, compute_dtype
from zmpi.kernels import host as host_kernels


class Parameter:
    """A trainable tensor.

    Attributes (plain, rebindable by the engine):
      data: array of shape `shape` in the storage dtype (float32, float64, float16 or bfloat16),
            or None while released.
      grad: array with the same shape and dtype as `data` (zeros at construction), or None while
            released. Layers *accumulate* into it (`accumulate_grad_`); the engine zeroes it.
      grad_zeroed: the array object `grad` was when it was last known to hold zeros (set by
            `mark_grads_zeroed`, cleared by the first write), or None: while it is `grad`, the
            first gradient is written into it rather than added (one pass, no read; see
            `grad_out`). Rebinding `grad` to another array makes it stale, never wrong.
      shape: the logical shape, fixed at construction (still known while data is None).
    """

    def __init__(self, data):
        self.data = data
        self.grad = array_module(data).zeros_like(data)
        self.grad_zeroed = self.grad
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


def mark_grads_zeroed(params) -> None:
    """Record that each parameter's current `grad` holds zeros (whoever zeroed it says so)."""
    for p in params:
        p.grad_zeroed = p.grad


def grad_out(p, dtype):
    """p.grad, for the caller to write the whole of this gradient into (an `out=`), when it
    holds zeros and is a C-contiguous array of `dtype`: then writing is adding, and the layer
    saves the pass of `accumulate_grad_` (which it still calls; with p.grad itself it does
    nothing), and p.grad is no longer known to hold zeros. Else None (and `accumulate_grad_`
    may still write instead of adding)."""
    grad = p.grad
    if grad is None or p.grad_zeroed is not grad or grad.dtype != dtype \
            or not grad.flags.c_contiguous:
        return None
    p.grad_zeroed = None
    return grad


def accumulate_grad_(p, dW):
    """p.grad += dW, with dW in the compute dtype and p.grad in the storage dtype.

    The add runs in dW's dtype and is rounded once to the storage dtype, so a float16/bfloat16
    gradient accumulates without an extra rounding of dW. In place: p.grad may be a view into
    the engine's flat gradient buffer. When p.grad holds zeros (`grad_zeroed`) dW is written
    (cast) into it, one pass; when dW is p.grad itself (written through `grad_out`), nothing
    is left to do.
    """
    grad = live(p, "grad")
    if dW is grad:
        return
    if p.grad_zeroed is grad:
        p.grad_zeroed = None
        with numpy.errstate(over="ignore", invalid="ignore"):  # as below
            host_kernels.cast_(grad, dW)
        return
    if grad.dtype == dW.dtype:
        grad += dW
    else:
        # A float16 overflow to inf here is expected: the loss scaler detects it and skips
        # the step, so NumPy's cast warning is noise (CuPy does not warn).
        with numpy.errstate(over="ignore", invalid="ignore"):
            total = host_kernels.astype(grad, dW.dtype)  # a copy
            total += dW
            host_kernels.cast_(grad, total)

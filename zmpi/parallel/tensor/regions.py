"""Where a tensor-parallel region begins and ends: Megatron-LM's conjugate operators f and g
(Shoeybi et al. 2019, section 3), as Modules with explicit forward and backward.

    f = CopyToTensorRegion(tp)      forward: identity       backward: allreduce(dy) over tp
    g = ReduceFromTensorRegion(tp)  forward: allreduce(x)   backward: identity

f sits where a replicated activation enters a region whose ranks each compute a part of the
result from it (ColumnParallelLinear's input): each rank's backward yields only its part of
the input gradient, and f sums them. g sits where the region ends in a sum of per-rank partial
results (RowParallelLinear's output). f's forward is g's backward and the other way round.

`tp` is a zmpi Comm (`mesh.tp_comm`); every allreduce is one `tp.allreduce` of a contiguous
buffer, so it is counted in that Comm's counters. With tp.size == 1 both are identities and
never communicate. The sum runs in the activations' compute dtype (`compute_dtype`: float32
for float16/bfloat16 activations on the host, float64 stays float64).

`inplace=True` lets the operator reduce the array it is handed (when it is already contiguous
and in the compute dtype) instead of a copy: for a caller that has just made that array and
does not read it again (the parallel linear layers pass their fresh matmul results).
"""

from zmpi.backend import array_module, compute_dtype
from zmpi.nn.base import Module


def allreduce_sum(tp, a, inplace: bool = False):
    """The elementwise sum of `a` over the ranks of `tp`, in `compute_dtype(a)`: one
    `tp.allreduce` of a contiguous buffer (`a` itself when `inplace` allows it, else a copy).
    With tp.size == 1: `a` in the compute dtype, without communicating."""
    dtype = compute_dtype(a)
    if tp.size == 1:
        return a.astype(dtype, copy=False)
    if inplace and a.dtype == dtype and a.flags.c_contiguous:
        buf = a
    else:
        buf = array_module(a).array(a, dtype=dtype, order="C", copy=True)
    return tp.allreduce(buf)


class CopyToTensorRegion(Module):
    """Megatron's f: forward returns x unchanged; backward returns the sum of dy over the
    ranks of `tp` (one allreduce of dy's size)."""

    def __init__(self, tp, inplace: bool = False):
        self.tp = tp
        self.inplace = inplace

    def forward(self, x):
        self._save(True)  # nothing to keep; marks that a backward may follow
        return x

    def backward(self, dy):
        self._pop()
        return allreduce_sum(self.tp, dy, self.inplace)


class ReduceFromTensorRegion(Module):
    """Megatron's g: forward returns the sum of x over the ranks of `tp` (one allreduce of
    x's size); backward returns dy unchanged."""

    def __init__(self, tp, inplace: bool = False):
        self.tp = tp
        self.inplace = inplace

    def forward(self, x):
        self._save(True)
        return allreduce_sum(self.tp, x, self.inplace)

    def backward(self, dy):
        self._pop()
        return dy

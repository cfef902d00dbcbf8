"""The tensor-parallel linear layers of Megatron-LM (Shoeybi et al. 2019, section 3).

The full layer is zmpi.nn.Linear: y = x @ W + b, W (in, out). Over a tensor-parallel Comm `tp`
of T ranks, rank r holds:

    ColumnParallelLinear  W[:, r*out/T : (r+1)*out/T] and that slice of b (split by output
                          features); input x replicated, output y_r = f(x) @ W_r + b_r, this
                          rank's out/T columns of y (not gathered)
    RowParallelLinear     W[r*in/T : (r+1)*in/T, :] and the whole b (split by input features);
                          input x_r, this rank's in/T columns of x; output y = g(x_r @ W_r) + b,
                          replicated (b added once, after the sum)

So Column -> elementwise -> Row (Megatron's MLP: fc, GELU, proj) needs one allreduce forward
(g) and one backward (f), each of the activations' size (B, T, C).

sequence_parallel=True (Korthikanti et al. 2022; regions.py): the input and output outside
the pair are this rank's sequence shard (B, S/T, C) of a sequence of S positions, instead of
replicated. The column layer's f becomes GatherFromSequenceRegion (allgather forward,
reduce-scatter backward) and the row layer's g ReduceScatterToSequenceRegion (reduce-scatter
forward, allgather backward). The row layer adds its bias to its shard and computes the bias
gradient from the gathered dy, so that gradient is whole, and the same, on every rank, as
without sequence parallelism. Each rank sends the same bytes as with f and g.

Initialisation: the full (in, out) weight is drawn from `rng` exactly as Linear draws it (and
the generator advances the same way), then this rank keeps its slice; one layer's full matrix
is held for a moment, never the whole model. Every rank of `tp` must pass the same seed (or
generators in the same state); then the T slices put together are the Linear that the same
seed makes, and a model built from one generator matches its serial twin layer by layer.

Each Parameter carries `tp_split`: the axis along which it is split over `tp` (0 or 1), or None
for a parameter every rank holds whole (RowParallelLinear's bias), and, when split, `tp_index`:
the indices along that axis it holds. A gradient norm over the model counts split parameters
on every tp rank and replicated ones once; gathering a parameter puts each slice back there.
"""

import math

import numpy

from zmpi.backend import array_module
from zmpi.nn import functional as F
from zmpi.nn.base import Module
from zmpi.nn.layers import Linear
from zmpi.nn.parameter import Parameter, accumulate_grad_, compute_data
from zmpi.parallel.tensor.regions import (
    CopyToTensorRegion,
    GatherFromSequenceRegion,
    ReduceFromTensorRegion,
    ReduceScatterToSequenceRegion,
)


def split_size(features: int, tp, what: str) -> int:
    """features / tp.size; ValueError unless it divides evenly."""
    if features % tp.size:
        raise ValueError(f"{what}={features} is not divisible by the tensor-parallel size "
                         f"{tp.size}: every rank must hold an equal slice")
    return features // tp.size


def _full_weight(rng, in_features, out_features, std):
    """The whole (in, out) float64 weight, drawn as zmpi.nn.Linear draws it."""
    std = 1.0 / math.sqrt(in_features) if std is None else std
    return rng.normal(0.0, std, (in_features, out_features))


def split_parameter(full, held, axis, dtype):
    """A Parameter holding the entries `held` (indices along `axis`) of the full array `full`,
    contiguous, in `dtype`; marked `tp_split = axis` and `tp_index = held`, which say where the
    slice sits in the full tensor (what gathering it back, or a checkpoint, needs)."""
    held = numpy.asarray(held)
    p = Parameter(numpy.ascontiguousarray(numpy.take(full, held, axis=axis)).astype(dtype))
    p.tp_split, p.tp_index = axis, held
    return p


def replicated_parameter(full, dtype):
    """A Parameter every tensor rank holds whole (`tp_split = None`)."""
    p = Parameter(numpy.array(full, dtype=dtype))
    p.tp_split = None
    return p


def contiguous(features: int, tp, what: str):
    """This rank's equal, contiguous share of `features` entries: an index array."""
    local = split_size(features, tp, what)
    return numpy.arange(tp.rank * local, (tp.rank + 1) * local)


class ColumnParallelLinear(Linear):
    """y_r = x @ W[:, cols_r] + b[cols_r]: this rank's out_features / tp.size output features.
    x (..., in_features) replicated -> y (..., out_features / tp.size).

    weight (in_features, out_features / T), tp_split 1; bias (out_features / T,), tp_split 0.
    copy_input: put f (CopyToTensorRegion) at the input, so backward returns the full input
    gradient, summed over tp. Pass False where the caller already has f at the input (several
    column layers reading one x under a single f); backward then returns this rank's part.
    sequence_parallel: x is this rank's sequence shard (B, T/tp, in_features), gathered by
    GatherFromSequenceRegion in f's place; backward returns the shard's gradient.
    """

    def __init__(self, in_features, out_features, tp, bias=True, rng=None,
                 dtype=numpy.float32, std=None, copy_input=True, sequence_parallel=False):
        rng = numpy.random.default_rng(rng)
        full = _full_weight(rng, in_features, out_features, std)
        self._build(full, numpy.zeros(out_features) if bias else None, tp,
                    contiguous(out_features, tp, "out_features"), dtype, copy_input,
                    sequence_parallel)

    @classmethod
    def from_full(cls, weight, bias, tp, columns, dtype, copy_input=True,
                  sequence_parallel=False):
        """The column-parallel layer holding `columns` (indices) of the full `weight` (in, out)
        and `bias` (out,) or None: what a tensor-parallel plan makes of a built Linear."""
        layer = cls.__new__(cls)
        layer._build(weight, bias, tp, columns, dtype, copy_input, sequence_parallel)
        return layer

    def _build(self, weight, bias, tp, columns, dtype, copy_input, sequence_parallel):
        self.in_features, self.out_features = weight.shape
        self.weight = split_parameter(weight, columns, 1, dtype)
        self.bias = None if bias is None else split_parameter(bias, columns, 0, dtype)
        self.f = None if not copy_input else GatherFromSequenceRegion(tp) \
            if sequence_parallel else CopyToTensorRegion(tp, inplace=True)

    def forward(self, x):  # Linear's, on this rank's columns, after f
        return super().forward(self.f.forward(x) if self.f is not None else x)

    def backward(self, dy):
        dx = super().backward(dy)
        return self.f.backward(dx) if self.f is not None else dx  # f: sum over tp


class RowParallelLinear(Module):
    """y = sum over tp of (x_r @ W[rows_r, :]) + b.  x_r (..., in_features / tp.size), this
    rank's slice of the input's last axis (a ColumnParallelLinear's output) -> y
    (..., out_features), the same on every rank.

    weight (in_features / T, out_features), tp_split 0; bias (out_features,), replicated
    (tp_split None): added after the allreduce, so it is counted once.
    sequence_parallel: g is ReduceScatterToSequenceRegion, so y is this rank's sequence shard
    (B, T/tp, out_features), and backward takes the shard's dy. The bias gradient is summed
    over the gathered dy: whole, and the same, on every rank.
    """

    def __init__(self, in_features, out_features, tp, bias=True, rng=None,
                 dtype=numpy.float32, std=None, sequence_parallel=False):
        rng = numpy.random.default_rng(rng)
        full = _full_weight(rng, in_features, out_features, std)
        self._build(full, numpy.zeros(out_features) if bias else None, tp,
                    contiguous(in_features, tp, "in_features"), dtype, sequence_parallel)

    @classmethod
    def from_full(cls, weight, bias, tp, rows, dtype, sequence_parallel=False):
        """The row-parallel layer holding `rows` (indices) of the full `weight` (in, out) and
        the whole `bias` (out,) or None."""
        layer = cls.__new__(cls)
        layer._build(weight, bias, tp, rows, dtype, sequence_parallel)
        return layer

    def _build(self, weight, bias, tp, rows, dtype, sequence_parallel):
        self.in_features, self.out_features = weight.shape
        self.weight = split_parameter(weight, rows, 0, dtype)
        self.bias = None if bias is None else replicated_parameter(bias, dtype)
        self.g = ReduceScatterToSequenceRegion(tp) if sequence_parallel else \
            ReduceFromTensorRegion(tp, inplace=True)

    def forward(self, x):
        W = compute_data(self.weight)  # (Cin / T, Cout)
        if x.shape[-1] != W.shape[0]:
            raise ValueError(f"RowParallelLinear takes this rank's slice of the input: last "
                             f"axis {W.shape[0]} (in_features {self.in_features} / tensor-"
                             f"parallel size), got shape {tuple(x.shape)}")
        partial, (x, _) = F.linear_forward(x.astype(W.dtype, copy=False), W, None)
        y = self.g.forward(partial)  # sum over tp: allreduce (sequence parallel: its shard)
        if self.bias is not None:
            y += compute_data(self.bias)
        self._save(x)
        return y

    def backward(self, dy):
        x = self._pop()
        W = compute_data(self.weight)
        dy = self.g.backward(dy).astype(W.dtype, copy=False)  # (sequence parallel: gathered)
        dx, dW, db = F.linear_backward(dy, (x, W))
        accumulate_grad_(self.weight, dW)
        if self.bias is not None:
            accumulate_grad_(self.bias, db)
        return dx


class ReplicatedHeadsLinear(Module):
    """y_r = x @ W[:, cols_r]: the key or value projection of grouped-query attention when the
    tensor group has more ranks than the layer has key/value heads (n_kv_head < tp, as
    Megatron-LM and vLLM replicate them). x (..., in_features) replicated -> y (..., |cols_r|),
    the columns of the one head this rank's query heads read.

    weight: the whole (in_features, out_features) on every tensor rank (`tp_split` None),
    marked `sequence_parallel` (Megatron's name for a replicated parameter whose gradient is
    partial per tensor rank: each rank's is nonzero only on its head's columns, computed from
    its own query heads), so the engine sums it over the tensor ranks once a step
    (zmpi/engine/tensor.py) and every rank then holds the whole gradient. f (or the sequence
    gather) sits at the input as ColumnParallelLinear's: backward returns the input gradient
    summed over tp.
    """

    def __init__(self, weight, tp, columns, dtype, sequence_parallel=False):
        self.in_features, self.out_features = weight.shape
        self.weight = replicated_parameter(weight, dtype)
        self.weight.sequence_parallel = True  # its gradient is partial per tensor rank
        self.columns = numpy.asarray(columns)
        self.f = GatherFromSequenceRegion(tp) if sequence_parallel else \
            CopyToTensorRegion(tp, inplace=True)

    def forward(self, x):
        W = compute_data(self.weight)[:, self.columns]
        y, (x, _) = F.linear_forward(self.f.forward(x).astype(W.dtype, copy=False), W)
        self._save(x)
        return y

    def backward(self, dy):
        x = self._pop()
        W = compute_data(self.weight)
        dx, dW, _ = F.linear_backward(dy.astype(W.dtype, copy=False), (x, W[:, self.columns]))
        full = array_module(dW).zeros(W.shape, dtype=dW.dtype)
        full[:, self.columns] = dW
        accumulate_grad_(self.weight, full)
        return self.f.backward(dx)

"""The experts: E feed-forward networks (Linear, GELU, Linear: the GPT's MLP) with their weights
stacked along a leading expert axis, run one after another on their rows (Megatron-Core's
SequentialMLP; a grouped GEMM would be the same arithmetic in one kernel).

Parameters (the expert axis first, so expert parallelism keeps a slice of it and checkpoints
concatenate the slices): fc_weight (E, C, H), fc_bias (E, H), proj_weight (E, H, C),
proj_bias (E, C). With E = 1 and every row, it is one dense MLP of hidden size H: PR-MoE's
residual MLP and the shared experts are built from it.

Tensor parallelism (zmpi.parallel.expert.tensor_parallel_experts) splits every expert as
Megatron splits the dense MLP: this rank keeps H / tp of the hidden units (fc_weight and
fc_bias by their last axis, proj_weight by its middle one; proj_bias whole), and `f` / `g`,
Megatron's conjugate operators (zmpi.parallel.tensor.regions), sum the input gradient and the
output over the tensor group. Without it both are None and nothing is communicated.
"""

import numpy

from zmpi.backend import array_module
from zmpi.nn import functional as F
from zmpi.nn.base import Module
from zmpi.nn.layers import constant_parameter, normal_parameter
from zmpi.nn.parameter import accumulate_grad_, compute_data


class Experts(Module):
    """forward(x (M, C), counts) -> (M, C): rows [sum(counts[:e]), sum(counts[:e+1])) go
    through expert e; counts (a list of E ints) None: every row through expert 0 (E must be
    1). backward(dy (M, C)) -> dx, accumulating every expert's gradients (zero for an expert
    that got no row).

    f, g: None, or set together by tensor_parallel_experts: f (CopyToTensorRegion) at the
    input, whose backward sums this rank's partial dx over the tensor group; g
    (ReduceFromTensorRegion) on the second projection's partial output, which it sums before
    the bias (whole on every rank) is added once. x and dy are then the same on every tensor
    rank, and so are y and dx."""

    def __init__(self, num_experts, d_model, hidden, rng=None, dtype=numpy.float32, std=0.02,
                 proj_std=None):
        rng = numpy.random.default_rng(rng)
        E, C, H = num_experts, d_model, hidden
        self.fc_weight = normal_parameter(rng, (E, C, H), std, dtype)
        self.fc_bias = constant_parameter((E, H), 0.0, dtype)
        self.proj_weight = normal_parameter(rng, (E, H, C), std if proj_std is None else proj_std,
                                            dtype)
        self.proj_bias = constant_parameter((E, C), 0.0, dtype)
        self.f = self.g = None  # tensor parallelism's regions (tensor_parallel_experts)

    def _spans(self, counts, M):
        """(expert, row slice) of every expert with rows."""
        if counts is None:
            if self.fc_weight.shape[0] != 1:
                raise ValueError("Experts.forward without counts needs one expert, "
                                 f"not {self.fc_weight.shape[0]}")
            counts = [M]
        if len(counts) != self.fc_weight.shape[0] or sum(counts) != M:
            raise ValueError(f"counts {counts} do not split {M} rows over "
                             f"{self.fc_weight.shape[0]} experts")
        ends = numpy.cumsum(counts).tolist()
        return [(e, slice(end - n, end))
                for e, (n, end) in enumerate(zip(counts, ends, strict=True)) if n]

    def forward(self, x, counts=None):
        W1, b1 = compute_data(self.fc_weight), compute_data(self.fc_bias)
        W2, b2 = compute_data(self.proj_weight), compute_data(self.proj_bias)
        xp, x = array_module(x), x.astype(W1.dtype, copy=False)
        spans = self._spans(counts, x.shape[0])
        if self.f is not None:
            x = self.f.forward(x)  # identity; its backward sums dx over the tensor group
        h = xp.empty((x.shape[0], W1.shape[2]), dtype=W1.dtype)
        for e, rows in spans:
            h[rows] = F.linear_forward(x[rows], W1[e], b1[e])[0]
        a, act = F.gelu_forward(h)
        y = xp.empty(x.shape, dtype=W1.dtype)
        for e, rows in spans:
            y[rows] = F.linear_forward(a[rows], W2[e])[0]
        if self.g is not None:  # the partial outputs summed over the tensor group
            y = self.g.forward(y)
        for e, rows in spans:
            y[rows] += b2[e]  # once, after the sum
        self._save(x, act, a, spans)
        return y

    def backward(self, dy):
        x, act, a, spans = self._pop()
        W1, W2 = compute_data(self.fc_weight), compute_data(self.proj_weight)
        xp, dy = array_module(dy), dy.astype(W1.dtype, copy=False)
        grads = [xp.zeros(p.shape, dtype=W1.dtype) for p in
                 (self.fc_weight, self.fc_bias, self.proj_weight, self.proj_bias)]
        dW1, db1, dW2, db2 = grads
        da = xp.empty(a.shape, dtype=W1.dtype)
        for e, rows in spans:
            da[rows] = F.linear_backward(dy[rows], (a[rows], W2[e]), dW2[e], db2[e])[0]
        dh = F.gelu_backward(da, act)
        dx = xp.empty(x.shape, dtype=W1.dtype)  # the spans cover every row
        for e, rows in spans:
            dx[rows] = F.linear_backward(dh[rows], (x[rows], W1[e]), dW1[e], db1[e])[0]
        for p, g in zip((self.fc_weight, self.fc_bias, self.proj_weight, self.proj_bias), grads,
                        strict=True):
            accumulate_grad_(p, g)
        if self.g is not None:
            self.g.backward(dy)  # identity (the output was summed; dy is whole)
            dx = self.f.backward(dx)  # this rank's partial input gradient summed over tp
        return dx

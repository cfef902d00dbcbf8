"""An MoE layer split over the tensor-parallel group (Megatron-Core's expert tensor
parallelism with expert_tensor_parallel_size = tp; DeepSpeed's enable_expert_tensor_parallelism).

    tensor_parallel_moe(moe, tp)     # in place, right after the layer is built whole

Every expert is split as Megatron splits the dense MLP (zmpi.parallel.tensor.linear): its first
projection by columns, its second by rows, so rank r of the tensor group keeps hidden units
[r H/tp, (r+1) H/tp) of every expert:

    fc_weight (E, C, H/tp)  tp_split 2      fc_bias (E, H/tp)  tp_split 1
    proj_weight (E, H/tp, C)  tp_split 1    proj_bias (E, C)   whole (tp_split None)

and Megatron's f and g (zmpi.parallel.tensor.regions) sit at the experts' rows: g sums the
second projection's partial outputs over the tensor group before the bias is added (once), f's
backward sums the partial input gradients. PR-MoE's residual MLP and the shared experts (each
an Experts of one expert) are split the same way. The router and the residual coefficient stay
whole on every tensor rank: their inputs are the same there, so every tensor rank routes and
drops the same tokens, and their gradients (from whole outputs) are whole and equal on every
tensor rank, counted once. Expert parallelism (zmpi.parallel.expert.expert_parallel) then
slices the expert axis of these tensor slices, keeping their marks. See docs/moe.md, "Tensor
parallelism".

Initialisation: built whole from the layer's seed on every tensor rank, each keeps its slice;
the slices put together are the layer one process builds.
"""

import numpy

from zmpi.parallel.tensor.linear import contiguous, replicated_parameter, split_parameter
from zmpi.parallel.tensor.regions import (
    CopyToTensorRegion,
    GatherWholeSequence,
    ReduceFromTensorRegion,
    ShardWholeSequence,
)

# each stacked parameter's hidden axis (None: whole on every tensor rank)
HIDDEN_AXIS = {"fc_weight": 2, "fc_bias": 1, "proj_weight": 1, "proj_bias": None}


def tensor_parallel_experts(experts, tp):
    """Keep this rank's H / tp hidden units of every expert of the Experts module `experts`
    (zmpi.nn.moe.experts) and set its f and g over the Comm `tp`; in place, returns it.
    ValueError unless tp.size divides H."""
    cols = contiguous(experts.fc_weight.shape[2], tp, "the experts' hidden size")
    for name, axis in HIDDEN_AXIS.items():
        p = getattr(experts, name)
        full = numpy.asarray(p.data, dtype=numpy.float64)  # cast back to p's dtype: exact
        setattr(experts, name, replicated_parameter(full, p.dtype) if axis is None
                else split_parameter(full, cols, axis, p.dtype))
    experts.f = CopyToTensorRegion(tp, inplace=True)
    experts.g = ReduceFromTensorRegion(tp, inplace=True)
    return experts


def tensor_parallel_moe(moe, tp, sequence_parallel: bool = False):
    """Split the MoE layer `moe` (zmpi.nn.moe.MoE, built whole, before any forward and before
    it is made expert parallel) over the tensor-parallel Comm `tp`: its experts, residual MLP
    and shared experts (tensor_parallel_experts); the router and the residual coefficient stay
    whole. sequence_parallel: the layer's input and output are this rank's sequence shard
    (B, T/tp, C); it gathers the whole sequence at its input (GatherWholeSequence: one
    allgather forward) and keeps its shard of the whole output (ShardWholeSequence: one
    allgather of dy backward), so it routes the tokens it routes without. In place, returns
    `moe`; nothing at tp.size 1 (or tp None)."""
    if tp is None or tp.size == 1:
        return moe
    for part in (moe.experts, moe.residual_mlp, moe.shared_experts):
        if part is not None:
            tensor_parallel_experts(part, tp)
    if sequence_parallel:
        moe.sequence_in, moe.sequence_out = GatherWholeSequence(tp), ShardWholeSequence(tp)
    return moe

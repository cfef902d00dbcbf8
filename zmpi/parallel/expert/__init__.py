"""Expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE, Rajbhandari et al. 2022):
the experts of an MoE layer (zmpi.nn.moe) split over `ep` data-parallel ranks, tokens moved to
them and back by all-to-all. See docs/moe.md, "Expert parallelism".

    groups       expert_groups (the expert-parallel and expert-data-parallel Comms carved out
                 of the data-parallel ranks), check_expert_layout
    dispatcher   ExpertParallelDispatcher (TokenDispatcher's interface, with two all-to-alls
                 forward and two backward)
    layer        expert_parallel (an MoE layer keeps its E / ep experts and gets the dispatcher)
    tensor       tensor_parallel_moe (every expert split over the tensor group as the MLP is)

Like zmpi.parallel.tensor, nothing here imports MPI but through a zmpi Comm.
"""

from zmpi.parallel.expert.dispatcher import ExpertParallelDispatcher, ExpertPermutation
from zmpi.parallel.expert.groups import (
    ExpertGroups,
    check_expert_layout,
    check_experts,
    expert_groups,
)
from zmpi.parallel.expert.layer import expert_parallel, local_experts
from zmpi.parallel.expert.tensor import tensor_parallel_experts, tensor_parallel_moe

__all__ = ["ExpertGroups", "ExpertParallelDispatcher", "ExpertPermutation",
           "check_expert_layout", "check_experts", "expert_groups", "expert_parallel",
           "local_experts", "tensor_parallel_experts", "tensor_parallel_moe"]

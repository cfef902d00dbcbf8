"""zmpi.nn.moe: the mixture-of-experts layer (docs/moe.md), in Megatron-Core's three parts.

    router       Router (linear gate, softmax, top-k, capacity, noise, auxiliary and z losses),
                 Routing (its decisions), expert_capacity
    dispatcher   TokenDispatcher (tokens to expert rows and back; where expert parallelism
                 will exchange rows), Permutation
    experts      Experts (E MLPs with stacked weights; one of them is a dense MLP)
    layer        MoE (the three behind one Module, with PR-MoE's residual MLP and shared experts)
"""

from zmpi.nn.moe.dispatcher import Permutation, TokenDispatcher
from zmpi.nn.moe.experts import Experts
from zmpi.nn.moe.layer import MoE
from zmpi.nn.moe.router import NOISY_GATE_POLICIES, Router, Routing, expert_capacity

__all__ = ["MoE", "NOISY_GATE_POLICIES", "Experts", "Permutation", "Router", "Routing",
           "TokenDispatcher", "expert_capacity"]

"""An MoE layer made expert parallel: each rank keeps its share of the experts and the
expert-parallel dispatcher moves the tokens to them.

    moe = MoE(C, num_experts=8, k=2, rng=seed, ...)    # built whole, as on one process
    expert_parallel(moe, groups)                        # groups = expert_groups(dp, ep=4)

`expert_parallel` replaces the layer's `experts` (Experts over all E) by an Experts over the
E / ep experts this rank holds, and its `dispatcher` by an ExpertParallelDispatcher over
`groups.ep_comm`; the router, the residual MLP and the shared experts stay whole on every rank
(dense parameters). Built from the same seed on every rank, the ep slices put together are the
layer one process builds: one layer's experts are held whole for a moment, never the model's.

The local parameters keep the whole layer's names (`experts.fc_weight`, ...) and shapes but
for the leading expert axis, and carry where they sit in it, as tensor-parallel parameters
carry `tp_split` / `tp_index`: `ep_split = 0` (the axis), `ep_index` (the global experts held,
an index array) and `ep_full` (E): what a checkpoint or a gather needs to put each slice
back (neither knows experts yet: docs/moe.md).
"""

import copy

import numpy

from zmpi.nn.parameter import Parameter
from zmpi.parallel.expert.dispatcher import ExpertParallelDispatcher


def local_experts(experts, held):
    """A copy of the Experts module `experts` holding only the experts `held` (a range of
    global experts) of each stacked parameter, marked with `ep_split`, `ep_index`, `ep_full`
    (and keeping a tensor-parallel slice's `tp_split`, `tp_index`: zmpi.parallel.expert.tensor)."""
    local = copy.copy(experts)
    for name, p in experts.named_parameters():  # every one has the expert axis first
        q = Parameter(p.data[held.start:held.stop].copy())  # its own storage
        q.ep_split, q.ep_index, q.ep_full = 0, numpy.arange(held.start, held.stop), p.shape[0]
        for mark in ("tp_split", "tp_index"):  # a tensor-parallel slice stays one
            if hasattr(p, mark):
                setattr(q, mark, getattr(p, mark))
        setattr(local, name, q)
    return local


def expert_parallel(moe, groups):
    """Make the MoE layer `moe` expert parallel over `groups` (an ExpertGroups): in place,
    before any forward and before an engine takes its parameters. Returns `moe`. ValueError
    unless groups.ep divides its expert count."""
    E = moe.router.num_experts
    held = groups.experts_held(E)  # checks that ep divides E
    moe.experts = local_experts(moe.experts, held)
    moe.dispatcher = ExpertParallelDispatcher(groups.ep_comm, E, moe.router.drop_tokens)
    return moe

"""The two groups of expert parallelism, carved out of the data-parallel ranks (DeepSpeed-MoE's
layout): with `ep` dividing the data-parallel size dp, data rank d (its rank in `dp`) is in

    the expert-parallel group       d // ep: the ep consecutive data ranks d - d % ep, ...;
                                    together they hold every expert, E / ep each (rank j of
                                    the group the experts j E/ep .. (j+1) E/ep - 1), and
                                    exchange tokens with all-to-all
    the expert-data-parallel group  d % ep: the dp / ep ranks, one per expert-parallel group,
                                    that hold the same experts; their expert gradients are
                                    summed (and ZeRO shards the expert states) over it, while
                                    the dense parameters stay data parallel over all of dp

    dp = 4, ep = 2:   expert-parallel groups {0, 1}, {2, 3}; expert-data-parallel {0, 2}, {1, 3}

Each group is its own zmpi Comm, so its traffic is counted in its own counters (the all-to-all
bytes of expert parallelism are the expert-parallel Comm's 'alltoall'); a group of one rank is
this rank alone (MPI_COMM_SELF), which never communicates. A layout that cannot be built
(ep not an integer >= 1, ep not dividing dp, an expert count ep does not divide) is one
ValueError, raised alike on every rank before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zmpi.nn.checks import check_int
from zmpi.words import count


def check_experts(num_experts: int, ep: int) -> int:
    """E / ep, the experts each rank of an expert-parallel group holds; ValueError unless ep
    divides E."""
    check_int("num_experts", num_experts, 1)
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}: every rank "
                         "of an expert-parallel group holds an equal share of the experts")
    return num_experts // ep


def check_expert_layout(dp_size: int, ep: int, num_experts=()) -> None:
    """ValueError, one line, unless ep is an integer >= 1 that divides the data-parallel size
    `dp_size` and every expert count in `num_experts` (one per MoE layer)."""
    check_int("ep", ep, 1)
    if dp_size % ep:
        raise ValueError(f"ep={ep} does not divide the data-parallel size "
                         f"({count(dp_size, 'rank')}): expert parallelism splits the "
                         "data-parallel ranks into groups of ep")
    for experts in num_experts:
        check_experts(experts, ep)


@dataclass
class ExpertGroups:
    """This rank's expert-parallel and expert-data-parallel groups (see the module's doc).

    ep_comm: the ep ranks that exchange tokens (size `ep`, this rank at `ep_rank`);
    edp_comm: the dp / ep ranks that hold the same experts (size `edp`, at `edp_rank`).
    """

    ep_comm: object
    edp_comm: object
    _made: list = field(default_factory=list, repr=False)

    @property
    def ep(self) -> int:
        return self.ep_comm.size

    @property
    def ep_rank(self) -> int:
        return self.ep_comm.rank

    @property
    def edp(self) -> int:
        return self.edp_comm.size

    @property
    def edp_rank(self) -> int:
        return self.edp_comm.rank

    def experts_held(self, num_experts: int) -> range:
        """The global experts this rank holds of a layer of `num_experts`."""
        local = check_experts(num_experts, self.ep)
        return range(self.ep_rank * local, (self.ep_rank + 1) * local)

    def comms(self) -> dict:
        """{"ep": ..., "edp": ...}: the Comms, for the counters per dimension."""
        return {"ep": self.ep_comm, "edp": self.edp_comm}

    def free(self) -> None:
        """Free the sub-communicators made here (a collective over each)."""
        while self._made:
            self._made.pop().free()


def expert_groups(dp, ep: int, num_experts=()) -> ExpertGroups:
    """The groups of `ep`-way expert parallelism over the data-parallel Comm `dp` (collective
    over `dp`). `num_experts`: the expert count of each MoE layer, checked with the layout
    before any collective (`check_expert_layout`)."""
    check_expert_layout(dp.size, ep, tuple(num_experts))
    made = []

    def group(size, color):
        if size == 1:
            from zmpi.comm import MPI, Comm

            sub = Comm(MPI.COMM_SELF)
        else:
            sub = dp.split(color)
        made.append(sub)
        return sub

    # the same two splits, in the same order, on every rank
    ep_comm = group(ep, dp.rank // ep)
    edp_comm = group(dp.size // ep, dp.rank % ep)
    return ExpertGroups(ep_comm, edp_comm, made)

"""One partition strategy built over one group: what the engine does for its own strategy
over the data-parallel group, and at ep > 1 again for the expert parameters over the
expert-data-parallel group (zmpi.engine.moe.ExpertStates). The mechanism is shared; the
group and the parameters vary.

    strategy, layout = build_strategy(cls, comm, units, unit_params, context)
"""
from __future__ import annotations

from zmpi.engine.checks import check_same_on_replicas
from zmpi.zero import StrategyContext
from zmpi.zero.flat import ModelLayout


def build_strategy(cls, comm, units, unit_params, context: dict, agree=None):
    """(strategy, layout): an initialised instance of strategy class `cls` over `comm` (its
    shard and replica groups are `cls.process_groups(comm, context["config"])`), holding
    `unit_params` (name -> Parameter of each of `units`) in a ModelLayout for the shard
    group's size. context: the other StrategyContext fields (ledger, dtype, master_dtype, xp,
    config, mesh, aio). A collective over `comm`: a ValueError on every rank unless every
    rank of it built the same initial values (check_same_on_replicas). agree: None, or
    agree(build) -> build() with its error raised on every rank of a wider group (the
    engine's agreed_across_stages: the replicas' check included, which can fail on one
    pipeline stage only)."""
    shard, replica = cls.process_groups(comm, context["config"])
    layout = ModelLayout.of(unit_params, shard.size)
    initial = layout.values_of(unit_params, context["master_dtype"])

    def build():
        check_same_on_replicas(initial, comm)
        return cls(StrategyContext(units=units, unit_params=unit_params, layout=layout,
                                   shard_group=shard, replica_group=replica, **context))

    strategy = build() if agree is None else agree(build)
    strategy.initialize(initial)
    return strategy, layout

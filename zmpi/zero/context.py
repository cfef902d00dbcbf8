"""StrategyContext: everything a partition strategy is built from, in one object.

The engine makes one per run, after the strategy class chose its process groups
(`Strategy.process_groups`) and the layout was built for the shard group's size:

    ctx = StrategyContext(units, unit_params, layout, shard_group, replica_group, ledger,
                          dtype, master_dtype, xp, config.zero_optimization, mesh)
    strategy = cls(ctx)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StrategyContext:
    """What `Strategy.__init__` takes (it sets `self.comm`, `self.replica`, `self.layout`, ...
    from it; see there).

    units: the model's unit Modules, in forward order. unit_params[u]: name -> Parameter of
    unit u (names as in layout.units[u]). layout: the ModelLayout, built for
    shard_group.size. shard_group: the Comm the model states are partitioned over (the
    data-parallel group, or a subgroup of it); replica_group: the Comm of the ranks that hold
    the same shard, or None. ledger: the MemoryLedger every buffer is allocated through.
    dtype: storage dtype of parameters and gradients; master_dtype: of the master weights and
    Adam moments (fp32, or fp64 for exactness runs). xp: array module of device buffers.
    config: the ZeroConfig (`zero_optimization`). mesh: the engine's process mesh
    (zmpi.parallel.mesh.Mesh), for reading its sizes and coordinates: a strategy sees only the
    data-parallel group and must not communicate on mesh.tp_comm or mesh.pp_comm (nor on
    mesh.dp_comm directly: its collectives go through shard_group and replica_group). aio:
    the config's `aio` section (zmpi.config.AioConfig; None: its defaults), the file I/O of
    the NVMe tier."""

    units: list
    unit_params: list[dict[str, Any]]
    layout: Any
    shard_group: Any
    replica_group: Any
    ledger: Any
    dtype: Any
    master_dtype: Any
    xp: Any
    config: Any
    mesh: Any
    aio: Any = None

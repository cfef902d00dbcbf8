"""What an engine's collectives moved, read from the counters of the Comms they ran on:
`EngineTraffic`, the Engine's methods for it (reset_counters, traffic, expected_traffic,
sent_bytes, traffic_by_dimension), over these functions:

    by_group(strategy)          {group kind: {op: {calls, bytes, sent}}}: "world", or the
                                hybrid strategies' "shard" and "replica"
    sent_by_group(strategy)     {group kind: bytes sent in array collectives (ring model)}:
                                what the strategy's expected_traffic() declares
    by_dimension(mesh, strategy, pipeline)   {"dp"|"pp"|"tp" (and "ep", "edp" at moe.ep_size
                                > 1): {op: counts}}: each mesh dimension's collectives (the
                                strategy's groups live inside dp, the tied-weight groups
                                inside pp; the all-to-alls in ep, the expert strategy's in edp)

At ep > 1 the engine's traffic, sent bytes and expected traffic also have the kind "experts":
the expert strategy's "world" (the expert-data-parallel group: engine/moe.py), and
"experts_<kind>" for its other kinds (hybrid sharding's "experts_shard" and
"experts_replica", ZeRO++'s "experts_intra" and "experts_inter", cut inside that group).
"""
from __future__ import annotations

from zmpi.engine.optimizer import declared_traffic
from zmpi.memory import ARRAY_OPS


class EngineTraffic:
    """The Engine's traffic counters (a mixin: reads its comm, mesh, strategy and pipeline)."""

    def reset_counters(self) -> None:
        """Zero the counters of every Comm the engine sends on (world, mesh, strategy)."""
        for comm in groups(self.comm, self.mesh, self.strategy, self.pipeline,
                           self.experts.strategy if self.experts else None):
            comm.reset_counters()

    def traffic(self) -> dict[str, dict]:
        """{group kind: {op: {calls, bytes, sent}}} counted since the last reset, for every
        communicator the strategy sends on ("world"; "shard" and "replica" for hybrid)."""
        return {**by_group(self.strategy), **self._experts(by_group)}

    def expected_traffic(self) -> dict[str, int]:
        """{group kind: bytes this rank should send} in the next step without accumulation:
        the strategy's declaration, or 1-bit Adam's compressed allreduce (optimizer.py)."""
        return {**declared_traffic(self),
                **self._experts(lambda strategy: strategy.expected_traffic())}

    def sent_bytes(self) -> dict[str, int]:
        """{group kind: bytes this rank sent in array collectives} since the last reset (ring
        model): what the strategy's `expected_traffic` declares per step."""
        return {**sent_by_group(self.strategy), **self._experts(sent_by_group)}

    def _experts(self, of) -> dict:
        """{"experts": of(the expert strategy)["world"], "experts_<kind>": its other kinds}
        at ep > 1, else {}."""
        if self.experts is None:
            return {}
        return {"experts" if kind == "world" else f"experts_{kind}": value
                for kind, value in of(self.experts.strategy).items()}

    def traffic_by_dimension(self) -> dict[str, dict]:
        """{"dp"|"pp"|"tp": {op: {calls, bytes, sent}}} since the last reset: each mesh
        dimension's collectives (the strategy's groups count in "dp", where they live), so
        each dimension's formula is checked against its own counters. At moe.ep_size > 1 also
        "ep" (the MoE layers' all-to-alls) and "edp" (the expert strategy's collectives)."""
        return by_dimension(self.mesh, self.strategy, self.pipeline,
                            self.experts.strategy if self.experts else None)


def groups(comm, mesh, strategy, pipeline=None, experts=None) -> list:
    """Every distinct Comm the engine sends on: the world, the mesh's, the strategy's, the
    pipeline's tied-weight groups, the expert strategy's (`experts`, at ep > 1)."""
    every = (comm, *mesh.comms().values(), *strategy.comms().values(),
             *(pipeline.comms() if pipeline else ()),
             *(experts.comms().values() if experts else ()))
    return list({id(c): c for c in every}.values())


def by_group(strategy) -> dict[str, dict]:
    return {kind: comm.counters_snapshot() for kind, comm in strategy.comms().items()}


def sent_by_group(strategy) -> dict[str, int]:
    return {kind: sum(c.sent for op, c in comm.counters.items() if op in ARRAY_OPS)
            for kind, comm in strategy.comms().items()}


def by_dimension(mesh, strategy, pipeline=None, experts=None) -> dict[str, dict]:
    dims = mesh.comms()
    members = {dim: [comm] for dim, comm in dims.items()}
    members["dp"] += [c for c in strategy.comms().values() if c not in dims.values()]
    members["pp"] += list(pipeline.comms() if pipeline else ())
    if experts is not None:  # the expert strategy's own groups, cut inside edp
        members["edp"] += [c for c in experts.comms().values() if c not in dims.values()]
    out = {}
    for dim, comms in members.items():
        out[dim] = {}
        for comm in {id(c): c for c in comms}.values():
            for op, count in comm.counters_snapshot().items():
                total = out[dim].setdefault(op, dict.fromkeys(count, 0))
                for key, value in count.items():
                    total[key] += value
    return out

"""What an engine's collectives moved, read from the counters of the Comms they ran on.

    by_group(strategy)          {group kind: {op: {calls, bytes, sent}}}: "world", or the
                                hybrid strategies' "shard" and "replica"
    sent_by_group(strategy)     {group kind: bytes sent in array collectives (ring model)}:
                                what the strategy's expected_traffic() declares
    by_dimension(mesh, strategy, pipeline)   {"dp"|"pp"|"tp": {op: counts}}: each mesh
                                dimension's collectives (the strategy's groups live inside
                                dp, the tied-weight groups inside pp)
"""
from __future__ import annotations

from zmpi.memory import ARRAY_OPS


def groups(comm, mesh, strategy, pipeline=None) -> list:
    """Every distinct Comm the engine sends on: the world, the mesh's, the strategy's, the
    pipeline's tied-weight groups."""
    every = (comm, *mesh.comms().values(), *strategy.comms().values(),
             *(pipeline.comms() if pipeline else ()))
    return list({id(c): c for c in every}.values())


def by_group(strategy) -> dict[str, dict]:
    return {kind: comm.counters_snapshot() for kind, comm in strategy.comms().items()}


def sent_by_group(strategy) -> dict[str, int]:
    return {kind: sum(c.sent for op, c in comm.counters.items() if op in ARRAY_OPS)
            for kind, comm in strategy.comms().items()}


def by_dimension(mesh, strategy, pipeline=None) -> dict[str, dict]:
    dims = mesh.comms()
    members = {"dp": [dims["dp"], *(c for c in strategy.comms().values()
                                    if c not in dims.values())],
               "pp": [dims["pp"], *(pipeline.comms() if pipeline else ())], "tp": [dims["tp"]]}
    out = {}
    for dim, comms in members.items():
        out[dim] = {}
        for comm in {id(c): c for c in comms}.values():
            for op, count in comm.counters_snapshot().items():
                total = out[dim].setdefault(op, dict.fromkeys(count, 0))
                for key, value in count.items():
                    total[key] += value
    return out

"""Rank side of tests/test_mesh.py: every (dp, pp, tp) factorisation of the world, each
rank's coordinates, groups (as world ranks) and pipeline neighbours, and which dimension's
counters a collective on each group lands in; then an Engine's mesh at tp = pp = 1.

    mpiexec -n 4 python tests/ranks/mesh_checks.py
"""
import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.parallel.mesh import DIMENSIONS, Mesh


def factorisations(n):
    return [(tp, pp) for tp in range(1, n + 1) for pp in range(1, n + 1) if n % (tp * pp) == 0]


def calls(mesh):
    return {dim: sum(c["calls"] for c in comm.counters_snapshot().values())
            for dim, comm in mesh.comms().items()}


def main():
    comm = Comm()
    out = {"meshes": {}}
    for tp, pp in factorisations(comm.size):
        mesh = Mesh(comm, tp=tp, pp=pp)
        seen = {"sizes": [mesh.dp, mesh.pp, mesh.tp],
                "coords": [mesh.dp_rank, mesh.pp_rank, mesh.tp_rank],
                "groups": {d: c.allgather_object(comm.rank) for d, c in mesh.comms().items()},
                "prev": mesh.prev_rank, "next": mesh.next_rank, "counted": {}}
        for c in mesh.comms().values():
            c.reset_counters()
        for dim in DIMENSIONS:  # one allreduce on each group: counted in its dimension only
            before = calls(mesh)
            buf = np.ones(8, np.float32)
            getattr(mesh, f"{dim}_comm").allreduce(buf)
            after = calls(mesh)
            seen["counted"][dim] = [d for d in DIMENSIONS if after[d] != before[d]]
            seen.setdefault("sums", {})[dim] = float(buf[0])
        mesh.free()
        out["meshes"][f"tp{tp}_pp{pp}"] = seen

    from zero_checks import GLOBAL_BATCH, GPT_CONFIG, gpt_data

    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT

    engine = Engine(GPT(GPT_CONFIG), {"train_batch_size": GLOBAL_BATCH,
                                      "train_micro_batch_size_per_gpu": GLOBAL_BATCH // comm.size,
                                      "zero_optimization": {"stage": 2}}, comm)
    engine.reset_counters()
    engine.train_step(*gpt_data(comm, 1).sample(0))
    by_dim = engine.traffic_by_dimension()
    out["engine"] = {"dp_is_world": engine.mesh.dp_comm is comm,
                     "mesh": engine.mesh.describe(),
                     "dp_sent": sum(c["sent"] for c in by_dim["dp"].values()),
                     "world_sent": sum(c["sent"] for c in engine.traffic()["world"].values()),
                     "tp_pp_calls": sum(c["calls"] for d in ("tp", "pp")
                                        for c in by_dim[d].values())}
    engine.close()
    # close() frees the groups the strategy made (hybrid's shard and replica groups)
    from zmpi.comm import MPI

    hybrid = Engine(GPT(GPT_CONFIG), {"train_batch_size": GLOBAL_BATCH,
                                      "train_micro_batch_size_per_gpu": GLOBAL_BATCH // comm.size,
                                      "zero_optimization": {"strategy": "hybrid",
                                                            "shard_group_size": 2}}, comm)
    groups = list(hybrid.strategy.comms().values())
    out["hybrid_groups"] = [g.size for g in groups]
    hybrid.close()
    out["hybrid_freed"] = [g.mpi == MPI.COMM_NULL for g in groups]
    report(out)


if __name__ == "__main__":
    main()

"""Rank side of tests/test_pipeline.py: a GPT cut into pipeline stages (and split by tensor
parallelism, and replicated over data parallelism) trained by the engine against the same
model trained in one process without pipelining (an engine on MPI_COMM_SELF, the whole batch).

    mpiexec -n N python tests/ranks/pipeline_checks.py LAYOUT...   # LAYOUT: dp,pp,tp

For each layout (dp * pp * tp = N), schedule and strategy it reports the largest error of any
parameter relative to the move training made, the loss difference, whether every rank
returned the same loss, whether the tied embedding's copy on the last stage equals the first
stage's, the stage's units, its peak of saved activations (and one micro-batch's, from a
run of one), and the pipeline traffic.
"""
import sys

import numpy as np
from _report import report
from tp_checks import errors

from zmpi.comm import MPI, Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layer=4, n_head=4, d_model=16)  # 6 units
BATCH, MICRO_BATCHES, STEPS = 8, 4, 4


def config(zero, dp, pp, tp, schedule="1f1b", micro_batches=MICRO_BATCHES, clip=0.05,
           **extra):
    return {"train_micro_batch_size_per_gpu": BATCH // (dp * MICRO_BATCHES),
            "gradient_accumulation_steps": micro_batches, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "tensor_parallel": {"autotp_size": tp},
            "pipeline": {"stages": pp, "schedule": schedule},
            "zero_optimization": {**zero, "reduce_bucket_size": 2000}, **extra}


def reference(zero, dtype, clip):
    alone = Comm(MPI.COMM_SELF)
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, 0, 1, seed=1)
    engine = Engine(GPT(CFG, seed=0, dtype=dtype), config(zero, 1, 1, 1, clip=clip), alone)
    init = engine.gather_parameters()
    losses = [engine.train_step(*data.global_sample(s)) for s in range(STEPS)]
    final = engine.gather_parameters()
    engine.close()
    return init, final, losses


def tied_copies_equal(engine, mesh):
    """The last stage's held copy of the token embedding equals the first stage's wte
    (parameters published: stages 0-2)."""
    mine = np.asarray(engine.model.units[0].wte.data) if mesh.pp_rank in (0, mesh.pp - 1) \
        else None
    copies = [c for c in mesh.pp_comm.allgather_object(mine) if c is not None]
    return bool(np.array_equal(copies[0], copies[-1]))


def run(comm, dp, pp, tp, zero, schedule, dtype=np.float32, clip=0.05, micro_batches=None):
    mesh = Mesh(comm, tp=tp, pp=pp)
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, dp, seed=1)
    model = GPT(CFG, seed=0, dtype=dtype, tp=mesh.tp_comm)
    m = micro_batches or MICRO_BATCHES
    engine = Engine(model, config(zero, dp, pp, tp, schedule, m, clip), comm, mesh=mesh)
    engine.reset_counters()
    rows = engine.micro_batch * m  # all this replica's rows; fewer for a run of m < 4
    losses = [engine.train_step(*(a[:rows] for a in data.sample(s))) for s in range(STEPS)]
    return mesh, engine, losses


def main():
    comm = Comm()
    layouts = [tuple(int(n) for n in arg.split(",")) for arg in sys.argv[1:]]
    out = {"runs": {}, "peaks": {}}
    refs = {}
    for dp, pp, tp in layouts:
        assert dp * pp * tp == comm.size
        strategies = {f"stage{k}": {"stage": k} for k in range(4)} if (dp, tp) == (1, 1) \
            else {"stage1": {"stage": 1}, "stage3": {"stage": 3}}
        for schedule in ("1f1b", "gpipe"):
            for name, zero in strategies.items():
                clip = 0.05 if name in ("stage1", "stage2") else 0.0
                key = (name, clip)
                if key not in refs:
                    refs[key] = reference(zero, np.float32, clip)
                init, want, want_losses = refs[key]
                mesh, engine, losses = run(comm, dp, pp, tp, zero, schedule, clip=clip)
                pipe = engine.traffic_by_dimension()["pp"]
                tied = tied_copies_equal(engine, mesh) if name != "stage3" else None
                same_loss = len(set(comm.allgather_object(losses[-1]))) == 1
                got = engine.gather_parameters()
                units = [type(u).__name__ for u in engine.model.units]
                engine.close()
                worst, model_move = errors(got, want, init)
                out["runs"][f"{dp},{pp},{tp}_{schedule}_{name}"] = {
                    "model_move": model_move, "tensor_move": worst,
                    "loss_diff": float(np.max(np.abs(np.subtract(losses, want_losses)))),
                    "same_loss_everywhere": same_loss, "tied_equal": tied, "units": units,
                    "names_match": sorted(got) == sorted(want),
                    "pp_sends": pipe.get("send", {}).get("calls", 0),
                    "pp_allreduces": pipe.get("allreduce", {}).get("calls", 0)}
        # fp64: what is left is rounding (the tied gradients are summed in another order)
        init, want, want_losses = reference({"stage": 1}, np.float64, 0.05)
        mesh, engine, losses = run(comm, dp, pp, tp, {"stage": 1}, "1f1b", np.float64)
        got = engine.gather_parameters()
        engine.close()
        out["runs"][f"{dp},{pp},{tp}_1f1b_stage1_fp64"] = {
            "model_move": errors(got, want, init)[1],
            "loss_diff": float(np.max(np.abs(np.subtract(losses, want_losses))))}
        # saved activations: the peak over a step per schedule and number of micro-batches m
        # (the micro-batch's size fixed); peak(m) = peak(1) + (in flight - 1) x one's
        for schedule, m in (("gpipe", 1), ("gpipe", 2), ("gpipe", MICRO_BATCHES),
                            ("1f1b", MICRO_BATCHES)):
            mesh, engine, _ = run(comm, dp, pp, tp, {"stage": 1}, schedule,
                                  micro_batches=m)
            peak = engine.memory.peak("activation")
            engine.close()
            out["peaks"][f"{dp},{pp},{tp}_{schedule}_m{m}"] = {"stage": mesh.pp_rank,
                                                               "bytes": peak}
    report(out)


if __name__ == "__main__":
    main()

"""Rank side of tests/test_tensor_engine.py: a GPT split by tensor parallelism and trained by
the engine with every ZeRO stage over the data-parallel group, against the same model trained
without tensor parallelism: in one process (an engine on MPI_COMM_SELF, the whole batch) for
fp64 and fp32; for fp16 and bf16 storage over the same data-parallel group (its sums in 16 bits
round differently from one process's, so that reference isolates what tensor parallelism adds).

    mpiexec -n 2 python tests/ranks/tp_checks.py   # (dp, tp) = (1, 2)
    mpiexec -n 4 python tests/ranks/tp_checks.py   # (2, 2) and (1, 4)

Reports, per (tp, strategy, precision), the strategies being stages 0-3, hybrid sharding and
stage 2 with optimizer offload: the largest error of any parameter relative to the move
training made (per tensor and model-wide), the loss difference, the tensor-parallel traffic.
"""
import numpy as np
from _report import report

from zmpi.comm import MPI, Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layer=2, n_head=4, d_model=16)  # 13: padded
BATCH, STEPS = 8, 5
# precision: (model dtype, config section, the strategies it runs under)
PRECISIONS = {"fp64": (np.float64, {}, None), "fp32": (np.float32, {}, None),
              "fp16": (np.float32, {"fp16": {"enabled": True}}, ("stage1", "stage3")),
              "bf16": (np.float32, {"bf16": {"enabled": True}}, ("stage1", "stage3"))}


STRATEGIES = {  # name: zero_optimization
    **{f"stage{k}": {"stage": k} for k in range(4)},
    "hybrid": {"strategy": "hybrid", "shard_group_size": 1},  # (DDP across the groups)
    "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}


def config(zero, dp, tp, clip, **mixed):
    return {**mixed, "train_micro_batch_size_per_gpu": BATCH // dp, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "tensor_parallel": {"autotp_size": tp},
            "zero_optimization": {**zero, "reduce_bucket_size": 2000}}


def train(engine, data):
    return [engine.train_step(*data(step)) for step in range(STEPS)]


def errors(got, want, init):
    worst = err2 = move2 = 0.0
    for name, w in want.items():
        diff = got[name].astype(np.float64) - w
        move = w - init[name]
        worst = max(worst, np.abs(diff).max() / max(np.abs(move).max(), 1e-30))
        err2, move2 = err2 + (diff * diff).sum(), move2 + (move * move).sum()
    return float(worst), float(np.sqrt(err2 / move2))


def main():
    comm = Comm()
    alone = Comm(MPI.COMM_SELF)
    out = {"runs": {}}
    for tp in (t for t in (2, 4) if comm.size % t == 0):
        dp = comm.size // tp
        for precision, (dtype, mixed, only) in PRECISIONS.items():
            for k, (name, zero) in enumerate(STRATEGIES.items()):
                if only is not None and name not in only:
                    continue
                clip = 0.05 if k % 2 else 0.0  # the norm across split parameters
                mesh = Mesh(comm, tp=tp)
                rows = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, dp,
                                       seed=1)
                # the reference: one process on the whole batch; for 16-bit storage, whose
                # data-parallel sums round differently, the same run without tensor
                # parallelism (the unsplit model over this rank's data-parallel group)
                group, data = (alone, rows.global_sample) if not mixed else \
                    (mesh.dp_comm, rows.sample)
                serial = Engine(GPT(CFG, seed=0, dtype=dtype),
                                config(zero, group.size, 1, clip, **mixed), group)
                init = serial.gather_parameters()
                want_losses = train(serial, data)
                want = serial.gather_parameters()
                serial.close()

                model = GPT(CFG, seed=0, dtype=dtype, tp=mesh.tp_comm)
                engine = Engine(model, config(zero, dp, tp, clip, **mixed), comm, mesh=mesh)
                engine.reset_counters()
                losses = train(engine, rows.sample)
                tensor = engine.traffic_by_dimension()["tp"].get("allreduce", {})
                engine.check_replicas()  # replicated parameters identical on the tensor ranks
                got = engine.gather_parameters()
                engine.close()
                worst, model_move = errors(got, want, init)
                out["runs"][f"tp{tp}_{name}_{precision}"] = {
                    "dp": dp, "tp": tp, "local_params": engine.num_params,
                    "tensor_move": worst, "model_move": model_move,
                    "loss_diff": float(np.max(np.abs(np.subtract(losses, want_losses)))),
                    "tp_allreduce_calls": tensor.get("calls", 0),
                    "tp_allreduce_bytes": tensor.get("bytes", 0),
                    "shapes_match": all(got[n].shape == want[n].shape for n in want)}
    # what is refused: a model not split over the engine's tensor group
    from zmpi.config import ConfigError

    mesh = Mesh(comm, tp=comm.size)
    try:
        Engine(GPT(CFG), config({"stage": 0}, 1, comm.size, 0.0), comm, mesh=mesh)
        out["unsplit_model"] = None
    except ConfigError as e:
        out["unsplit_model"] = str(e)
    engine = Engine(GPT(CFG, tp=mesh.tp_comm), config({"stage": 0}, 1, comm.size, 0.0), comm,
                    mesh=mesh)
    if comm.rank == 1:  # a replicated parameter's master copy drifts on one tensor rank
        engine.strategy.master[engine.tp_replicated[0]][0] += 1.0
    try:
        engine.check_replicas()
        out["drift"] = None
    except RuntimeError as e:
        out["drift"] = str(e)
    engine.close()
    report(out)


if __name__ == "__main__":
    main()

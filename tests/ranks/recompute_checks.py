"""Rank side of tests/test_recompute.py: a GPT trained with each activation-recompute policy
("selective", "full") against the same run without recompute, on 2 ranks: data parallel at
ZeRO stages 0-3, tensor parallel (tp 2, with and without sequence parallelism) and pipelined
(pp 2, 1F1B) at stages 1 and 3, fp32.

    mpiexec -n 2 python tests/ranks/recompute_checks.py

Reports per (layout, strategy, policy) whether every parameter after 3 steps equals the run
without recompute bit for bit, the largest difference, the losses' and the activation peak.
"""
import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layer=3, n_head=4, d_model=16)
BATCH, STEPS = 8, 3
LAYOUTS = {  # name: (tp, pp, sequence parallel, strategies)
    "dp2": (1, 1, False, (0, 1, 2, 3)), "tp2": (2, 1, False, (1, 3)),
    "tp2_sp": (2, 1, True, (1,)), "pp2": (1, 2, False, (1, 3)),
}


def train(comm, tp, pp, sp, stage, policy):
    mesh = Mesh(comm, tp=tp, pp=pp)
    config = {"train_micro_batch_size_per_gpu": BATCH // (mesh.dp * 2),
              "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
              "pipeline": {"stages": pp}, "activation_checkpointing": {"recompute": policy},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}}
    model = GPT(CFG, seed=0, tp=mesh.tp_comm, sequence_parallel=sp)
    engine = Engine(model, config, comm, mesh=mesh)
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, mesh.dp, seed=1)
    losses = [engine.train_step(*data.sample(s)) for s in range(STEPS)]
    params = engine.gather_parameters()
    peak = engine.memory.peak("activation")
    engine.close()
    return params, losses, peak


def main():
    comm = Comm()
    out = {}
    for name, (tp, pp, sp, stages) in LAYOUTS.items():
        for stage in stages:
            want, want_losses, want_peak = train(comm, tp, pp, sp, stage, "none")
            for policy in ("selective", "full"):
                got, losses, peak = train(comm, tp, pp, sp, stage, policy)
                out[f"{name}_stage{stage}_{policy}"] = {
                    "equal": all(np.array_equal(got[n], w) for n, w in want.items()),
                    "largest": max(float(np.abs(got[n] - w).max()) for n, w in want.items()),
                    "losses_equal": losses == want_losses, "peak": peak, "peak_none": want_peak}
    report(out)


if __name__ == "__main__":
    main()

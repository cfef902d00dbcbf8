"""Rank side of tests/test_moe_accounting.py: what one training step of a GPT with MoE blocks
at expert parallelism moves and keeps, to set beside the analytic counts
(models/moe_counts.py, zmpi.memory) that `zmpi estimate --moe` prints.

    mpiexec -n 4 python tests/ranks/moe_accounting_checks.py

On 4 ranks at ep 2 (expert-data-parallel groups of 2), for each of CASES: one train_step of
the Engine (fp32) after its counters and peaks are reset. Reports {"cases": {name: {"ep",
"edp", "traffic": {"ep"|"edp": {op: {calls, bytes, sent}}}, "activation": the ledger's
activation peak, "kept": [[each MoE layer's kept assignments] per micro-batch], "experts":
the expert strategy's padded elements on this rank (full_numel)}}}.
"""
from _report import report

from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

SHAPE = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
MICRO_BATCH = 2
CASES = {  # name: (ZeRO stage, accumulation, recompute, the moe section at ep 2)
    "top2": (1, 2, "none", {"num_experts": 4, "k": 2, "ep_size": 2}),
    "recompute": (3, 1, "full", {"num_experts": 4, "capacity_factor": 0.5, "ep_size": 2,
                                 "noisy_gate_policy": "Jitter", "moe_layer_interval": 2}),
    "dropless": (2, 1, "none", {"num_experts": [2, 4], "k": 2, "drop_tokens": False,
                                "use_residual": True, "num_shared_experts": 1, "ep_size": 2}),
}


def step(comm, stage, accumulation, recompute, section) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
              "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage},
              "activation_checkpointing": {"recompute": recompute}, "moe": section}
    engine = Engine(GPT(SHAPE, seed=0, moe=section), config, comm)
    kept, losses = [], engine.moe.losses

    def recording():  # called once per micro-batch forward (a recomputed one included)
        kept.append([int(layer.routing.kept.sum()) for layer in engine.moe.layers])
        return losses()

    engine.moe.losses = recording
    data = SyntheticSource(SHAPE.vocab_size, SHAPE.seq_len,
                           MICRO_BATCH * accumulation * comm.size, comm.rank, comm.size, seed=1)
    engine.reset_counters()
    engine.memory.reset_peaks()
    engine.train_step(*data.sample(0))
    by_dim = engine.traffic_by_dimension()
    out = {"ep": engine.mesh.ep, "edp": engine.experts.strategy.world_size,
           "traffic": {dim: by_dim[dim] for dim in ("ep", "edp")},
           "activation": engine.memory.peak("activation"), "kept": kept,
           "experts": engine.experts.strategy.layout.full_numel}
    engine.close()
    return out


def main():
    comm = Comm()
    report({"cases": {name: step(comm, *case) for name, case in CASES.items()}})


if __name__ == "__main__":
    main()

"""Rank side of tests/test_sparse_gpt.py: a GPT with block-sparse attention trained by the
engine over a (dp, pp, tp) mesh against the same sparse GPT trained in one process (an engine
on MPI_COMM_SELF, the whole batch).

    mpiexec -n N python tests/ranks/sparse_checks.py LAYOUT...   # LAYOUT: dp,pp,tp

For each layout (dp * pp * tp = N) and ZeRO stage it reports the largest error of any
parameter relative to the move training made (tp_checks.errors), the largest loss
difference, and whether every rank returned the same loss. The layout gives every head its
own pattern (different_layout_per_head), so a tensor rank that ran another rank's heads'
layout would train another model. Extra runs: sequence parallelism, selective recompute, and
fp16 and bf16 storage (their references in fp16 and bf16 too).
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

CFG = GPTConfig(vocab_size=13, seq_len=32, n_layer=2, n_head=4, d_model=16)
SPARSE = {"mode": "fixed", "block": 4, "num_local_blocks": 4, "num_global_blocks": 1,
          "attention": "unidirectional", "different_layout_per_head": True,
          "num_different_global_patterns": 4}
BATCH, MICRO_BATCHES, STEPS = 8, 2, 3


def config(stage, dp, pp, tp, sp=False, recompute="none", fp16=False, bf16=False):
    return {"train_micro_batch_size_per_gpu": BATCH // (dp * MICRO_BATCHES),
            "gradient_accumulation_steps": MICRO_BATCHES,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
            "pipeline": {"stages": pp},
            "activation_checkpointing": {"recompute": recompute},
            "fp16": {"enabled": fp16, "loss_scale": 1.0 if fp16 else 0},
            "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
            "sparse_attention": SPARSE}


def train(comm, dp, pp, tp, stage, **kw):
    """(initial and final parameters gathered, the losses) of STEPS steps on this mesh."""
    mesh = Mesh(comm, tp=tp, pp=pp)
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, dp, seed=1)
    cfg = config(stage, dp, pp, tp, **kw)
    model = GPT(CFG, seed=0, tp=mesh.tp_comm, sparse_attention=cfg["sparse_attention"],
                sequence_parallel=cfg["tensor_parallel"]["sequence_parallel"])
    engine = Engine(model, cfg, comm, mesh=mesh)
    init = engine.gather_parameters()
    sample = data.global_sample if comm.size == 1 else data.sample
    losses = [engine.train_step(*sample(s)) for s in range(STEPS)]
    final = engine.gather_parameters()
    engine.close()
    return init, final, losses


def main():
    comm = Comm()
    alone = Comm(MPI.COMM_SELF)
    refs, out = {}, {}
    for arg in sys.argv[1:]:
        dp, pp, tp = (int(n) for n in arg.split(","))
        assert dp * pp * tp == comm.size
        stages = range(4) if pp == 1 else (1, 3)
        runs = [(f"stage{k}", k, {}) for k in stages]
        if tp > 1 and pp == 1:
            runs += [("stage1_sp", 1, {"sp": True}), ("stage3_selective", 3,
                                                      {"recompute": "selective"})]
        if dp > 1 and pp == 1 and tp == 1:
            runs += [("stage2_fp16", 2, {"fp16": True}), ("stage3_bf16", 3, {"bf16": True})]
        for name, stage, kw in runs:
            ref_kw = {k: v for k, v in kw.items() if k in ("fp16", "bf16")}
            key = (stage, tuple(sorted(ref_kw.items())))
            if key not in refs:
                refs[key] = train(alone, 1, 1, 1, stage, **ref_kw)
            init, want, want_losses = refs[key]
            _, got, losses = train(comm, dp, pp, tp, stage, **kw)
            worst, model_move = errors(got, want, init)
            out[f"{arg}_{name}"] = {
                "model_move": model_move, "tensor_move": worst,
                "loss_diff": float(np.max(np.abs(np.subtract(losses, want_losses)))),
                "same_loss_everywhere": len(set(comm.allgather_object(losses[-1]))) == 1,
                "names_match": sorted(got) == sorted(want)}
    report({"runs": out})


if __name__ == "__main__":
    main()

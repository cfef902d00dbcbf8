"""Rank side of tests/test_tensor_checkpoint.py: checkpoints of tensor- and pipeline-parallel
runs, saved at one (dp, pp, tp, stage) and loaded at another, on 4 ranks (and a 2-rank group
of them).

    mpiexec -n 4 python tests/ranks/tp_checkpoint_checks.py WORK_DIR

Each case trains a GPT (vocabulary 13: padded to 14 at tp 2 and 16 at tp 4) for 3 steps at
the saving layout, saves, and goes on to step 6 uninterrupted; then an engine at the loading
layout loads the checkpoint and trains steps 3-5 too. Reported per case: the largest
difference of any parameter right after the load from the saver's at the save (exact: 0),
and after step 6 from the uninterrupted run, relative to the move training made (per tensor,
the worst). Rank 0 writes each saver's parameters at the save to WORK_DIR/<case>.npz, for the
offline tools (verify, consolidate). A checkpoint loaded into a model whose whole shapes
differ (a vocabulary of 14, whose local slices at tp 2 are the same shape) is refused.
The PADDED cases pad the vocabulary to a multiple (GPTConfig.vocab_multiple, times tp) at the
saving and/or the loading layout: 13 -> 16 (8 rows a rank at tp 2), 128, 32 a rank at tp 4,
16 in a pipeline of 2 stages (the last holds a copy of the padded table).
"""
import sys
from pathlib import Path

import numpy as np
from _report import report
from tp_checks import errors

from zmpi.checkpoint import CheckpointError
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layer=2, n_head=4, d_model=16)
BATCH, SAVE_AT, UNTIL = 8, 3, 6
PRECISION = {"fp64": (np.float64, {}), "fp32": (np.float32, {}),
             "fp16": (np.float32, {"fp16": {"enabled": True, "initial_scale_power": 8}})}
# case: (saving ((tp, pp), zero), loading (ranks, (tp, pp), zero), precision)
CASES = {
    "tp2s3_to_tp4s1": (((2, 1), {"stage": 3}), (4, (4, 1), {"stage": 1}), "fp64"),
    "tp2s3_to_tp1s0": (((2, 1), {"stage": 3}), (4, (1, 1), {"stage": 0}), "fp64"),
    "tp2s3_to_2ranks_tp2s2": (((2, 1), {"stage": 3}), (2, (2, 1), {"stage": 2}), "fp64"),
    "tp1s2_to_tp2hybrid": (((1, 1), {"stage": 2}), (4, (2, 1), {"strategy": "hybrid",
                                                                  "shard_group_size": 1}),
                           "fp64"),
    "tp4s0_to_tp2s3off": (((4, 1), {"stage": 0}), (4, (2, 1), {"stage": 3, "offload_optimizer": {
        "device": "cpu"}}), "fp64"),
    "tp2s2_same_fp32": (((2, 1), {"stage": 2}), (4, (2, 1), {"stage": 2}), "fp32"),
    "tp2s1_to_tp4s3_fp16": (((2, 1), {"stage": 1}), (4, (4, 1), {"stage": 3}), "fp16"),
    # pipeline stages: each writes its units; the last stage's copy of wte is not saved
    "pp2s1_to_pp1s3": (((1, 2), {"stage": 1}), (4, (1, 1), {"stage": 3}), "fp64"),
    "pp4s0_to_pp2tp2s1": (((1, 4), {"stage": 0}), (4, (2, 2), {"stage": 1}), "fp64"),
    "pp2tp2s1_to_pp4s2": (((2, 2), {"stage": 1}), (4, (1, 4), {"stage": 2}), "fp64"),
    "tp2s0_to_2ranks_pp2s3": (((2, 1), {"stage": 0}), (2, (1, 2), {"stage": 3}), "fp64"),
    "pp2s2_same_fp32": (((1, 2), {"stage": 2}), (4, (1, 2), {"stage": 2}), "fp32"),
    # the vocabulary padded (PADDED) at the save, the load or both
    "tp2pad8s3_to_tp1s1": (((2, 1), {"stage": 3}), (4, (1, 1), {"stage": 1}), "fp64"),
    "tp1pad128s2_to_tp4pad32s3": (((1, 1), {"stage": 2}), (4, (4, 1), {"stage": 3}), "fp64"),
    "tp4s1_to_tp1pad128s0": (((4, 1), {"stage": 1}), (4, (1, 1), {"stage": 0}), "fp64"),
    "pp2pad16s1_to_tp2s2": (((1, 2), {"stage": 1}), (4, (2, 1), {"stage": 2}), "fp64"),
}
PADDED = {"tp2pad8s3_to_tp1s1": (8, 1), "tp1pad128s2_to_tp4pad32s3": (128, 32),
          "tp4s1_to_tp1pad128s0": (1, 128), "pp2pad16s1_to_tp2s2": (16, 1)}
# case: (vocab_multiple saving, loading)


def build(comm, tp, zero, precision, vocab=CFG.vocab_size, pp=1, multiple=1):
    dtype, mixed = PRECISION[precision]
    mesh = Mesh(comm, tp=tp, pp=pp)
    config = {**mixed, "train_micro_batch_size_per_gpu": BATCH // mesh.dp,
              "gradient_clipping": 0.05,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "tensor_parallel": {"autotp_size": tp}, "pipeline": {"stages": pp},
              "zero_optimization": {**zero, "reduce_bucket_size": 2000}}
    cfg = GPTConfig(vocab, CFG.seq_len, CFG.n_layer, CFG.n_head, CFG.d_model, multiple)
    engine = Engine(GPT(cfg, seed=0, dtype=dtype, tp=mesh.tp_comm), config, comm, mesh=mesh)
    rows = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, mesh.dp, seed=1)
    return engine, rows


def train(engine, rows, steps):
    for step in steps:
        engine.train_step(*rows.sample(step))


def largest_difference(got, want):
    return max(float(np.abs(got[name].astype(np.float64) - w).max()) for name, w in want.items())


def main():
    world = Comm()
    work = Path(sys.argv[1])
    out = {"cases": {}}
    pair = world.split(0 if world.rank < 2 else 1)  # a 2-rank job inside the 4-rank one
    for case, (((tp, pp), zero), (ranks, (tp2, pp2), zero2), precision) in CASES.items():
        ckpt = work / case
        saving, loading = PADDED.get(case, (1, 1))
        engine, rows = build(world, tp, zero, precision, pp=pp, multiple=saving)
        init = engine.gather_parameters()
        train(engine, rows, range(SAVE_AT))
        engine.save_checkpoint(ckpt)
        at_save = engine.gather_parameters()
        train(engine, rows, range(SAVE_AT, UNTIL))
        want = engine.gather_parameters()
        engine.close()
        if world.rank == 0:
            np.savez(work / f"{case}.npz", **at_save)
        result = {}
        if ranks == world.size or world.rank < ranks:
            comm = world if ranks == world.size else pair
            engine, rows = build(comm, tp2, zero2, precision, pp=pp2, multiple=loading)
            loaded = engine.load_checkpoint(ckpt)
            result["loaded_step"] = loaded.global_steps
            result["after_load"] = largest_difference(engine.gather_parameters(), at_save)
            train(engine, rows, range(SAVE_AT, UNTIL))
            result["after_training"] = errors(engine.gather_parameters(), want, init)[0]
            engine.close()
        out["cases"][case] = result
        world.barrier()
    # the same local shapes at tp 2 (vocabulary 13 and 14 both pad to 14), other whole shapes
    engine, _ = build(world, 2, {"stage": 1}, "fp64", vocab=14)
    try:
        engine.load_checkpoint(work / "tp2s3_to_tp4s1")
        out["other_model"] = None
    except CheckpointError as e:
        out["other_model"] = str(e)
    engine.close()
    pair.free()
    report(out)


if __name__ == "__main__":
    main()

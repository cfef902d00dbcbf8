"""Rank side of tests/test_moe_pipeline.py: a GPT with MoE blocks cut into 2 pipeline stages
(one MoE block each) and trained by the engine against the same model trained by one process
(an engine on MPI_COMM_SELF, the whole batch, no pipeline), at the data-parallel size the
world leaves (dp = N / 2) and the expert-parallel degrees given.

    mpiexec -n N python tests/ranks/moe_pipeline_checks.py OUT_DIR CASE...

CASE: name:ep:schedule:stage[:full][:bf16][:tp2[:sp]], the MoE section `name` of SECTIONS,
e.g. "top2:2:1f1b:3:full"; with tp2 the stages are split over 2 tensor ranks too (pp 2 x
tp 2, dp = N / 4: the experts split over the tensor group, docs/moe.md "Tensor and pipeline
together"), with sp under sequence parallelism. For each case rank 0 reports the largest
difference of any loss (the steps' and an eval_loss after them) and of any parameter from
one process's, whether every rank returned the same losses, and every step's routing of
every layer over the global batch (choices and kept assignments, gathered from every stage
and data-parallel rank in global order) against one process's: {"same_routing", "dropped":
[per step, per layer, the assignments dropped]}. With "ckpt:ep[:tp2]" the checkpoint case:
trained at pp 2 (ep, tp given) to RESUME_AT, saved to OUT_DIR, trained on; then an engine
at pp 1, tp 1, ep 1 on the world's first N / tp ranks loads it and trains the same steps:
their losses against the uninterrupted run's (and rank 0 verifies, consolidates and
tampers with the checkpoint's manifest). "refused": the message of a save at ep 2 with a
stage holding no MoE block. "stage_refused": the message of building that engine with hybrid
groups of 2, which the expert parameters' group of 1 refuses on the MoE block's stage only.
"""
import json
import sys
from pathlib import Path

import numpy as np
from _report import report
from tp_checks import errors
from zero_checks import moe_routing_record  # each stage keeps its own layers' routing

from zmpi.checkpoint import CheckpointError
from zmpi.checkpoint.tools import consolidate, verify
from zmpi.comm import MPI, Comm
from zmpi.config import ConfigError
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)  # 4 units
BATCH, MICRO_BATCHES, STEPS, RESUME_AT, CKPT_STEPS = 16, 4, 3, 2, 4
DROPS = {"min_capacity": 0, "z_loss_coef": 1e-3, "aux_loss_coef": 0.01, "layers": [0, 1]}
SECTIONS = {  # both drop tokens (capacity below the load), aux and z losses on
    "top2": {"num_experts": 4, "k": 2, "capacity_factor": 0.5, "noisy_gate_policy": "RSample",
             **DROPS},
    "top1": {"num_experts": 4, "k": 1, "capacity_factor": 0.75, "noisy_gate_policy": "Jitter",
             **DROPS},
}
SECTIONS["one_block"] = {**SECTIONS["top2"], "layers": [1]}  # the second stage's block only


def config(section, ep, stage, dp, pp, schedule="1f1b", recompute="none", bf16=False, tp=1,
           sp=False):
    cfg = {"tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
           "train_micro_batch_size_per_gpu": BATCH // (dp * MICRO_BATCHES),
           "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.05,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "pipeline": {"stages": pp, "schedule": schedule,
                        **({"partition": "type:Block"} if pp > 1 else {})},
           "activation_checkpointing": {"recompute": recompute},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
           "moe": {**SECTIONS[section], "ep_size": ep}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, comm_rows, dp, steps, seen):
    """Losses of `steps` and each step's routing [(experts, kept) per layer of the whole
    model, rows in global order] gathered on every rank from the data-parallel ranks (rows)
    and the stages (layers)."""
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, comm_rows, dp, seed=1)
    losses, routes = [], []
    for step in steps:
        losses.append(engine.train_step(*data.sample(step)))
        mine = [tuple(np.concatenate(a) for a in zip(*(micro[layer] for micro in seen),
                                                     strict=True))
                for layer in range(len(engine.moe.layers))]  # this rank's rows, in order
        seen.clear()
        mesh = engine.mesh
        rows = mesh.dp_comm.allgather_object(mine)  # [dp rank][layer] -> (experts, kept)
        layers = [tuple(np.concatenate(parts) for parts in zip(*per_rank, strict=True))
                  for per_rank in zip(*rows, strict=True)]
        stages = mesh.pp_comm.allgather_object(layers) if mesh.pp > 1 else [layers]
        routes.append([layer for stage in stages for layer in stage])
    return losses, routes


def reference(section, bf16, stage):
    """One process: the engine on MPI_COMM_SELF at pp 1, ep 1, the whole batch, ZeRO
    `stage` (its storage of the gradients: bf16 rounds them where a stage keeps them)."""
    alone = Comm(MPI.COMM_SELF)
    dtype = np.float32 if bf16 else np.float64
    engine = Engine(GPT(CFG, seed=0, dtype=dtype, moe=SECTIONS[section]),
                    config(section, 1, stage, 1, 1, bf16=bf16), alone)
    seen = moe_routing_record(engine)
    init = engine.gather_parameters()
    losses, routes = train(engine, 0, 1, range(STEPS), seen)
    losses.append(evaluate(engine, 0, 1))
    params = engine.gather_parameters()
    engine.close()
    return losses, routes, params, init


def evaluate(engine, dp_rank, dp):
    """eval_loss of the batch after the last step's (routed as in evaluation: capacity
    factor 1, no draws)."""
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, dp_rank, dp, seed=1)
    return engine.eval_loss(*data.sample(STEPS))


def pipelined(comm, section, ep, stage, schedule, recompute, bf16, tp=1, sp=False):
    pp, dp = 2, comm.size // (2 * tp)
    dtype = np.float32 if bf16 else np.float64
    mesh = Mesh(comm, tp=tp, pp=pp, ep=ep)
    model = GPT(CFG, seed=0, dtype=dtype, tp=mesh.tp_comm, sequence_parallel=sp,
                moe={**SECTIONS[section], "ep_size": ep})
    engine = Engine(model, config(section, ep, stage, dp, pp, schedule, recompute, bf16, tp,
                                  sp), comm, mesh=mesh)
    assert engine.mesh.pp == pp and len(engine.moe.layers) == 1  # one MoE block a stage
    seen = moe_routing_record(engine)
    return engine, seen


def compare(comm, case, refs):
    name, ep, schedule, stage, *flags = case.split(":")
    bf16, recompute = "bf16" in flags, "full" if "full" in flags else "none"
    key = (name, bf16, int(stage))
    if key not in refs:
        refs[key] = reference(*key) if comm.rank == 0 else None
    engine, seen = pipelined(comm, name, int(ep), int(stage), schedule, recompute, bf16,
                             2 if "tp2" in flags else 1, "sp" in flags)
    losses, routes = train(engine, engine.mesh.dp_rank, engine.mesh.dp, range(STEPS), seen)
    losses.append(evaluate(engine, engine.mesh.dp_rank, engine.mesh.dp))
    params = engine.gather_parameters()
    engine.close()
    same = len({tuple(x) for x in comm.allgather_object(losses)}) == 1
    if comm.rank != 0:
        return None
    want_losses, want_routes, want, init = refs[key]
    return {"loss_diff": float(np.max(np.abs(np.subtract(losses, want_losses)))),
            "param_diff": max(float(np.max(np.abs(params[k] - want[k]))) for k in want),
            "model_move": errors(params, want, init)[1],
            "names_match": sorted(params) == sorted(want), "same_loss_everywhere": same,
            "same_routing": all(np.array_equal(a, b) for got, ref in
                                zip(routes, want_routes, strict=True)
                                for layer, ref_layer in zip(got, ref, strict=True)
                                for a, b in zip(layer, ref_layer, strict=True)),
            "dropped": [[int((~kept).sum()) for _, kept in step] for step in routes],
            "ref_dropped": [[int((~kept).sum()) for _, kept in step] for step in want_routes]}


def checkpoint(comm, out_dir, ep, tp):
    """Losses of steps RESUME_AT.. uninterrupted at pp 2 (ep, tp), and resumed at pp 1,
    tp 1, ep 1 on the world's first N / tp ranks from the checkpoint saved after step
    RESUME_AT; on rank 0 what `zmpi ckpt verify` finds in it and the largest difference of
    its consolidated master weights from the parameters the engine held when it saved."""
    name, directory = "top2", f"{out_dir}/ckpt_ep{ep}_tp{tp}"
    engine, seen = pipelined(comm, name, ep, 3, "1f1b", "none", False, tp)
    dp = engine.mesh.dp
    train(engine, engine.mesh.dp_rank, dp, range(RESUME_AT), seen)
    engine.save_checkpoint(directory, tag="saved")
    held = engine.gather_parameters()
    uninterrupted, _ = train(engine, engine.mesh.dp_rank, dp, range(RESUME_AT, CKPT_STEPS),
                             seen)
    engine.close()
    dp = comm.size // tp  # the resuming ranks, one data-parallel group
    part = comm.split(0 if comm.rank < dp else 1)
    resumed = None
    if comm.rank < dp:
        group = part if part.size > 1 else Comm(MPI.COMM_SELF)
        whole = Engine(GPT(CFG, seed=0, dtype=np.float64, moe=SECTIONS[name]),
                       config(name, 1, 3, dp, 1), group)
        whole.load_checkpoint(directory, tag="saved")
        resumed, _ = train(whole, group.rank, dp, range(RESUME_AT, CKPT_STEPS),
                           moe_routing_record(whole))
        whole.close()
    part.free()
    out = {"uninterrupted": uninterrupted, "resumed": comm.bcast_object(resumed)}
    if comm.rank == 0:
        consolidate(directory, f"{out_dir}/whole_ep{ep}_tp{tp}.npz", tag="saved", npz=True)
        with np.load(f"{out_dir}/whole_ep{ep}_tp{tp}.npz") as f:
            out["consolidated_diff"] = max(float(np.max(np.abs(f[k] - v)))
                                           for k, v in held.items())
            out["consolidated_names"] = sorted(set(f) - {"__tied__"}) == sorted(held)
        out["verify"] = verify(directory, "saved")
        if ep > 1:  # the expert section (at ep 1 the experts are in the stages' shards)
            out["manifest"] = manifest_checks(Path(directory) / "saved" / "manifest.json")
    return out


def manifest_checks(path):
    """The manifest's expert section at pp 2 (its `pipeline` entry and file names), and what
    reading it says once that entry is dropped or its file list is cut (checksum redone)."""
    from zmpi.checkpoint.manifest import _body_crc, read_manifest

    body = json.loads(path.read_text())
    said = {}
    for what, edit in (("no_pipeline", lambda m: m["experts"].pop("pipeline")),
                       ("one_file_less", lambda m: m["expert_files"].pop())):
        tampered = json.loads(json.dumps(body))
        edit(tampered)
        del tampered["checksum"]
        tampered["checksum"] = _body_crc(tampered)
        changed = path.parent.parent / f"tampered_{what}"
        changed.mkdir()
        (changed / "manifest.json").write_text(json.dumps(tampered))
        try:
            read_manifest(changed)
            said[what] = None
        except CheckpointError as e:
            said[what] = str(e).split(": corrupt: ")[-1]
    return {"experts_pipeline": body.get("experts", {}).get("pipeline"),
            "expert_files": [f["file"] for f in body.get("expert_files", [])], **said}


def refused(comm, out_dir):
    """The one-line error of a save at ep 2 where a pipeline stage holds no MoE block (one
    MoE block, on the second stage), the same on every rank."""
    section = SECTIONS["one_block"]
    engine = Engine(GPT(CFG, seed=0, dtype=np.float64, moe={**section, "ep_size": 2}),
                    config("one_block", 2, 0, comm.size // 2, 2), comm)
    try:
        engine.save_checkpoint(f"{out_dir}/refused", tag="saved")
        said = None
    except ValueError as e:
        said = str(e)
    engine.close()
    return said


def stage_refused(comm):
    """The ConfigError of an engine at ep 2 whose expert states (on the second stage only, the
    one MoE block's) refuse hybrid groups of 2 (edp has 1 rank): every rank's (None if built)."""
    cfg = config("one_block", 2, 3, comm.size // 2, 2)
    cfg["zero_optimization"].update(strategy="hybrid", shard_group_size=2)
    try:
        Engine(GPT(CFG, seed=0, dtype=np.float64, moe={**SECTIONS["one_block"], "ep_size": 2}),
               cfg, comm).close()
    except ConfigError as e:
        return str(e)
    return None


def main():
    comm = Comm()
    out_dir, cases = sys.argv[1], sys.argv[2:]
    out, refs = {"runs": {}, "ckpt": {}}, {}
    for case in cases:
        if case.startswith("ckpt:"):
            ep = int(case.split(":")[1])
            out["ckpt"][case] = checkpoint(comm, out_dir, ep, 2 if case.endswith(":tp2") else 1)
        elif case == "refused":
            out["refused"] = refused(comm, out_dir)
        elif case == "stage_refused":
            out["stage_refused"] = stage_refused(comm)
        else:
            out["runs"][case] = compare(comm, case, refs)
    report(out)


if __name__ == "__main__":
    main()

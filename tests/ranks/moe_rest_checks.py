"""Rank side of tests/test_moe_engine_rest.py: the rest of the engine at expert-parallel
degree 2, for one world size (2 or 4: (dp, ep) = (2, 2), (4, 2)), in one launch.

    mpiexec -n N python tests/ranks/moe_rest_checks.py OUT_DIR

- offload: a GPT with MoE blocks (zero_checks.MOE: top-2, a pyramid of 4 and 2 experts,
  RSample, tokens dropped) trained STEPS steps in fp64 with accumulation and clipping under
  each of `cases`: no offload, the optimizer on the host (stages 1-3), the parameters too
  (stage 3), both on NVMe (stage 3; the optimizer alone at stage 2), the delayed update
  (DPU, stage 2), hybrid sharding in groups of 1, and at 4 ranks hybrid sharding, hpZ and
  ZeRO++ (qwZ, qgZ, hpZ) in groups of 2. Rank 0 writes the gathered parameters to
  OUT_DIR/<case>.npz; the report has each case's losses, a digest of the parameters and of
  this rank's expert master and Adam shards, the expert strategy's offload placement, and
  the ledger's model states against what the two strategies declare.
- resume: each case of RESUMED saves after step RESUME_AT and is resumed with its own
  config at ep 2 and at ep 1; the losses of the resumed steps.
- check_replicas (4 ranks): at stage 1 (the expert parameters replicated over the ranks
  holding the same experts), a parameter of the last rank's experts changed: the error on
  every rank.
- refused (2 ranks): hybrid groups of 2 where one rank holds each expert.
"""
import os
import sys

import numpy as np
from _report import report
from zero_checks import GPT_CONFIG, MOE, config, digest, gpt_data

from zmpi import backend
from zmpi.comm import Comm
from zmpi.config import ConfigError
from zmpi.engine import Engine
from zmpi.memory import DEVICES, MODEL_STATE
from zmpi.models.gpt import GPT

STEPS, RESUME_AT, ACCUMULATION, CLIP = 4, 2, 2, 0.05
DPU_WARMUP = 1
CPU = {"device": "cpu", "pin_memory": True}


def nvme(out_dir):
    return {"device": "nvme", "nvme_path": f"{out_dir}/nvme", "buffer_size": 1024,
            "buffer_count": 6}  # several blocks a state: the streamed step, not one block


HYBRID = {"strategy": "hybrid", "shard_group_size": 1}  # DDP over dp, and over edp
HPZ = {"zero_hpz_partition_size": 2}
ZEROPP = {**HPZ, "zero_quantized_weights": True, "zero_quantized_gradients": True}


def cases(out_dir, n) -> dict:
    """{name: (ZeRO stage, zero_optimization extras)} on n ranks: hybrid sharding and ZeRO++
    with groups of 2 cut inside edp where it has 2 ranks (n = 4)."""
    cut = {"stage3_hybrid2": (3, {**HYBRID, "shard_group_size": 2}), "stage3_hpz": (3, HPZ),
           "stage3_zeropp": (3, ZEROPP)} if n == 4 else {}
    return {
        "stage1": (1, {}),
        "stage1_optimizer": (1, {"offload_optimizer": CPU}),
        "stage2": (2, {}),
        "stage2_optimizer": (2, {"offload_optimizer": CPU}),
        "stage2_nvme": (2, {"offload_optimizer": nvme(out_dir)}),
        "stage2_dpu": (2, {"offload_optimizer": {**CPU, "delay_update": True,
                                                 "delay_update_warmup": DPU_WARMUP}}),
        "stage3": (3, {}),
        "stage3_optimizer+param": (3, {"offload_optimizer": CPU, "offload_param": CPU}),
        "stage3_nvme": (3, {"offload_optimizer": nvme(out_dir), "offload_param": nvme(out_dir)}),
        "stage3_hybrid1": (3, HYBRID),
        **cut,
    }


RESUMED = ("stage2_optimizer", "stage3_nvme", "stage3_hybrid1")


def build(comm, stage, zero, ep=2):
    cfg = config(stage, "fp64", ACCUMULATION, CLIP, n=comm.size)
    cfg["zero_optimization"].update(zero)
    if "strategy" in zero:  # named, not by stage
        del cfg["zero_optimization"]["stage"]
    cfg["moe"] = {**MOE, "ep_size": ep}
    return Engine(GPT(GPT_CONFIG, seed=0, dtype=np.float64, moe=cfg["moe"]), cfg, comm)


def offload(comm, out_dir) -> dict:
    results = {}
    for name, (stage, zero) in cases(out_dir, comm.size).items():
        engine, data = build(comm, stage, zero), gpt_data(comm, ACCUMULATION)
        losses = []
        for step in range(STEPS):
            losses.append(engine.train_step(*data.sample(step)))
            if step + 1 == RESUME_AT and name in RESUMED:
                engine.save_checkpoint(f"{out_dir}/ckpt_{name}", tag="saved")
        experts = engine.experts.strategy
        states = digest(np.asarray(backend.to_host(experts.state_buffer(s)[0]))
                        for s in ("master", "adam_m", "adam_v"))
        params = engine.gather_parameters()
        if comm.rank == 0:
            np.savez(f"{out_dir}/{name}.npz", **params)
        results[name] = {"losses": losses, "params": digest(params[k] for k in sorted(params)),
                         "expert_states": states,
                         "expert_offload": [experts.offload_optimizer, experts.offload_param,
                                            experts.nvme is not None],
                         "delayed_steps": engine.update_timing["delayed_steps"],
                         "traffic": [engine.expected_traffic(), engine.sent_bytes()],
                         "ledger": {d: [engine.memory.current(MODEL_STATE, d), sum(
                             sum(s.expected_model_state()[d].values())
                             for s in engine.strategies)] for d in DEVICES}}
        engine.close()
    return results


def resume(comm, out_dir) -> dict:
    """{"<case> ep <E>": losses of steps RESUME_AT.. resumed at ep E with the case's offload}."""
    out = {}
    for name in RESUMED:
        stage, zero = cases(out_dir, comm.size)[name]
        for ep in (2, 1):
            engine, data = build(comm, stage, zero, ep), gpt_data(comm, ACCUMULATION)
            engine.load_checkpoint(f"{out_dir}/ckpt_{name}", tag="saved")
            out[f"{name} ep {ep}"] = [engine.train_step(*data.sample(step))
                                      for step in range(engine.global_steps, STEPS)]
            engine.close()
    return out


def refused(comm) -> str | None:
    """The error of hybrid sharding in groups of 2 at (dp, ep) = (2, 2), where the ranks
    holding the same experts are one (None if it was built)."""
    try:
        build(comm, 3, {**HYBRID, "shard_group_size": 2}).close()
    except ConfigError as e:
        return str(e)
    return None


def diverged_expert(comm) -> str | None:
    """check_replicas' error after the last rank's copy of an expert parameter changed
    (stage 1: the parameters are replicated over the expert-data-parallel group); None if
    none was raised."""
    engine, data = build(comm, 1, {}), gpt_data(comm, ACCUMULATION)
    engine.train_step(*data.sample(0))
    engine.check_replicas()  # nothing differs yet
    if comm.rank == comm.size - 1:
        engine.experts.strategy.params_full[0] += 1.0
    try:
        engine.check_replicas()
    except RuntimeError as e:
        return str(e)
    finally:
        engine.close()
    return None


if __name__ == "__main__":
    comm = Comm()
    out_dir = sys.argv[1]
    if comm.rank == 0:
        os.makedirs(f"{out_dir}/nvme", exist_ok=True)
    comm.barrier()
    report({"offload": offload(comm, out_dir), "resume": resume(comm, out_dir),
            "diverged": diverged_expert(comm) if comm.size > 2 else None,
            "refused": refused(comm) if comm.size == 2 else None})

"""Rank side of tests/test_offload.py: ZeRO-Offload checks for one world size, in one launch.

    mpiexec -n N python tests/ranks/offload_checks.py OUT_DIR

- equality: every stage 1-3 x fp32/fp16 x offload variant trains 4 steps (gradient
  accumulation, clipping, and in fp16 an overflow planted on the last rank at step 2); the
  report has digests of the losses, the gathered parameters and this rank's master and Adam
  shards, which must equal the run without offload bit for bit.
- memory: the ledger's bytes per category and device after a step, for the formula.
- delayed update: fp64 runs with DPU; rank 0 writes the gathered parameters to
  OUT_DIR/dpu_stage<s>.npz for the test's delayed single-process reference.
"""
import sys

import numpy as np
from _report import report
from zero_checks import GLOBAL_BATCH, GPT_CONFIG, config, digest, gpt_data

from zmpi import backend
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.kernels import host as host_kernels
from zmpi.memory import DEVICES, MODEL_STATE
from zmpi.models.gpt import GPT

STEPS = 4
DPU_STEPS, DPU_WARMUP = 6, 2
CPU = {"device": "cpu", "pin_memory": True}
VARIANTS = {  # name: (stages, zero_optimization entries)
    "none": ((1, 2, 3), {}),
    "optimizer": ((1, 2, 3), {"offload_optimizer": CPU}),
    "optimizer+param": ((3,), {"offload_optimizer": CPU, "offload_param": CPU}),
    "param": ((3,), {"offload_param": CPU}),
}


def offload_config(stage, dtype, n, zero):
    fp16 = {"initial_scale_power": 8} if dtype == "fp16" else {}  # only the planted overflow
    cfg = config(stage, dtype, accumulation=2, clip=0.05, n=n, **fp16)
    cfg["zero_optimization"].update(zero)
    return cfg


def plant_overflow(engine, step, comm):
    """fp16: an inf in the last rank's reduced gradient at step 2 (every rank skips it)."""
    strategy, reduce = engine.strategy, engine.strategy.before_step

    def before_step():
        reduce()
        if step[0] == 2 and comm.rank == comm.size - 1:
            strategy.optimizer_grads()[0] = np.inf

    strategy.before_step = before_step


def equality_and_memory(comm):
    results = []
    for name, (stages, zero) in VARIANTS.items():
        for stage in stages:
            for dtype in ("fp32", "fp16"):
                engine = Engine(GPT(GPT_CONFIG, seed=0),
                                offload_config(stage, dtype, comm.size, zero), comm)
                step = [0]
                if dtype == "fp16":
                    plant_overflow(engine, step, comm)
                data, losses = gpt_data(comm, 2), []
                for step[0] in range(STEPS):
                    losses.append(engine.train_step(*data.sample(step[0])))
                s = engine.strategy
                memory = {d: {c: engine.memory.current(c, d) for c in MODEL_STATE}
                          for d in DEVICES}
                params = engine.gather_parameters()
                results.append({
                    "variant": name, "stage": stage, "dtype": dtype,
                    "losses": losses, "skipped": engine.scaler.skipped_steps,
                    "params": digest(params[k] for k in sorted(params)),
                    "optimizer_state": digest(backend.to_host(a)
                                              for a in (s.master, s.adam_m, s.adam_v)),
                    "full_numel": engine.layout.full_numel, "memory": memory})
    return results


def delayed_update(comm, out_dir):
    results = []
    for stage in (1, 2, 3):
        zero = {"offload_optimizer": {**CPU, "delay_update": True,
                                      "delay_update_warmup": DPU_WARMUP}}
        if stage == 3:
            zero["offload_param"] = CPU
        engine = Engine(GPT(GPT_CONFIG, seed=0, dtype=np.float64),
                        offload_config(stage, "fp64", comm.size, zero), comm)
        data = gpt_data(comm, 2)
        losses = [engine.train_step(*data.sample(step)) for step in range(DPU_STEPS)]
        in_flight = engine.delayed.thread is not None  # the last step's update has not landed yet
        memory = {d: {c: engine.memory.current(c, d) for c in MODEL_STATE} for d in DEVICES}
        params = engine.gather_parameters()  # lands it
        if comm.rank == 0:
            np.savez(f"{out_dir}/dpu_stage{stage}.npz", **params)
        results.append({"stage": stage, "losses": losses, "in_flight": in_flight,
                        "landed": engine.delayed.thread is None, "memory": memory,
                        "full_numel": engine.layout.full_numel,
                        "delayed_steps": engine.update_timing["delayed_steps"]})
        engine.close()
    return results


if __name__ == "__main__":
    comm = Comm()
    assert GLOBAL_BATCH % comm.size == 0
    report({"equality": equality_and_memory(comm), "dpu": delayed_update(comm, sys.argv[1]),
            "compiled_loops": host_kernels.adam is not None})

"""Rank side of tests/test_nvme.py: the NVMe tier at one world size, in one launch.

    mpiexec -n N python tests/ranks/nvme_checks.py OUT_DIR

- equality: stages 1-3 x fp32/fp16 (gradient accumulation, clipping, and in fp16 an
  overflow planted on the last rank at step 2) train 4 steps with the optimizer on the host
  (CPU offload) and on NVMe, in the variants below; the report has digests of the losses, the
  gathered parameters and this rank's master and Adam shards, which must be equal.
- memory: after the run, the ledger's host bytes of master, adam_m and adam_v (now and at
  their peak over the steps) and what the strategy declares; the state's own size.
- checkpoints: an NVMe run saves, a CPU-offload run loads it and goes on (and the other way
  round, at stage 3); each must equal the CPU-offload run that never stopped.
- files: each rank's swap directory exists while the engine lives and is gone after close().
- parameters on NVMe (stage 3, `offload_param.device: "nvme"`): the same equality against
  CPU offload with the optimizer on the host and on NVMe (a pool of 2 buffers, persistent
  units and a wide prefetch in one variant, `max_in_cpu` in another); the ledger's host bytes
  of "param"; checkpoints from and to CPU offload; the files.
Every rank swaps into OUT_DIR/nvme (a directory of its own under it).
"""
import os
import sys

import numpy as np
from _report import report
from offload_checks import STEPS, offload_config, plant_overflow
from zero_checks import GPT_CONFIG, digest, gpt_data

from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT

OPTIMIZER = ("master", "adam_m", "adam_v")


def nvme(path, **extra):
    # blocks of 1024 elements: the tiny GPT's shard spans several, so the streaming is real
    return {"device": "nvme", "nvme_path": path, "buffer_size": 1024, "buffer_count": 6,
            **extra}


def nvme_param(path, **extra):
    # a pool of 2 buffers, each holding the largest unit's shard; no unit kept in host memory
    return {"device": "nvme", "nvme_path": path, "buffer_size": 4096, "buffer_count": 2,
            "max_in_cpu": 0, **extra}


WIDE = {"stage3_param_persistence_threshold": 500, "stage3_prefetch_bucket_size": 10_000}


def variants(path):
    """name: (stages, offload_optimizer, aio, zero_optimization's other keys) of every run
    compared with CPU offload."""
    return {
        "cpu": ((1, 2, 3), {"device": "cpu"}, {}, {}),
        "nvme": ((1, 2, 3), nvme(path), {}, {}),
        "nvme_sync": ((2,), nvme(path, pipeline_read=False, pipeline_write=False,
                                 buffer_count=3), {"queue_depth": 1}, {}),
        "nvme_max_in_cpu": ((3,), nvme(path, max_in_cpu=1500), {"thread_count": 2,
                                                                 "block_size": 4096}, {}),
        "param_cpu": ((3,), {"device": "cpu"}, {}, {"offload_param": {"device": "cpu"}}),
        "param_nvme": ((3,), {"device": "cpu"}, {}, {"offload_param": nvme_param(path)}),
        "param_nvme_wide": ((3,), nvme(path), {"thread_count": 2},
                            {"offload_param": nvme_param(path), **WIDE}),
        "param_nvme_max_in_cpu": ((3,), nvme(path), {}, {"offload_param": nvme_param(
            path, max_in_cpu=400, buffer_count=5)}),
    }


def build(stage, dtype, comm, offload, aio=None, zero=None):
    cfg = offload_config(stage, dtype, comm.size, {"offload_optimizer": offload, **(zero or {})})
    if aio:
        cfg["aio"] = aio
    return Engine(GPT(GPT_CONFIG, seed=0), cfg, comm)


def param_host(engine):
    """The ledger's host bytes of "param" (now, at peak), what the strategy declares, and
    the pool's size (buffers x elements) with the elements kept in host memory."""
    s, memory = engine.strategy, engine.memory
    store = s.param_store
    return {"host": memory.current("param", "host"), "peak": memory.peak("param", "host"),
            "declared": s.expected_model_state()["host"].get("param", 0),
            "shard_bytes": s.layout.shard_numel * s.dtype.itemsize,
            "pool": None if store is None else [len(store._buffers), store.block,
                                                sum(b.size for b in store._resident.values())],
            "itemsize": s.dtype.itemsize, "direct": None if store is None else store.direct}


def host_optimizer_bytes(engine, peak=False):
    read = engine.memory.peak if peak else engine.memory.current
    return {c: read(c, "host") for c in OPTIMIZER}


def optimizer_digest(strategy):
    return digest(np.asarray(a) for a in (strategy.master, strategy.adam_m, strategy.adam_v))


def equality_and_memory(comm, path):
    results = []
    for name, (stages, offload, aio, zero) in variants(path).items():
        for stage in stages:
            for dtype in ("fp32", "fp16"):
                engine = build(stage, dtype, comm, offload, aio, zero)
                step = [0]
                if dtype == "fp16":
                    plant_overflow(engine, step, comm)
                engine.memory.reset_peaks()
                data, losses = gpt_data(comm, 2), []
                for step[0] in range(STEPS):
                    losses.append(engine.train_step(*data.sample(step[0])))
                s = engine.strategy
                params = engine.gather_parameters()
                results.append({
                    "variant": name, "stage": stage, "dtype": dtype, "losses": losses,
                    "skipped": engine.scaler.skipped_steps,
                    "params": digest(params[k] for k in sorted(params)),
                    "optimizer_state": optimizer_digest(s),
                    "host": host_optimizer_bytes(engine),
                    "host_peak": host_optimizer_bytes(engine, peak=True),
                    "declared_host": {c: s.expected_model_state()["host"][c] for c in OPTIMIZER},
                    "state_bytes": s.master.nbytes,
                    "direct": None if s.nvme is None else s.nvme.direct,
                    "param_host": param_host(engine)})
                engine.close()
    return results


def checkpoints(comm, path, out_dir):
    """NVMe -> CPU offload (stage 2) and CPU offload -> NVMe (stage 3), fp16, 4 steps with a
    save after 2: both must equal the CPU-offload run that never stopped."""
    results, cpu = [], {"device": "cpu"}
    params = {"offload_param": nvme_param(path)}  # and the same runs with the parameters
    for stage, first, second, zero in ((2, nvme(path), cpu, ({}, {})),  # on NVMe
                                       (3, cpu, nvme(path), ({}, {})),
                                       (3, cpu, cpu, (params, {})), (3, cpu, cpu, ({}, params))):
        ckpt = f"{out_dir}/ckpt_stage{stage}_{len(results)}"
        reference, saver = (build(stage, "fp16", comm, cpu),
                            build(stage, "fp16", comm, first, zero=zero[0]))
        data = gpt_data(comm, 2)
        for step in range(STEPS):
            reference.train_step(*data.sample(step))
        for step in range(2):
            saver.train_step(*data.sample(step))
        saver.save_checkpoint(ckpt, tag="half")
        saver.close()
        loader = build(stage, "fp16", comm, second, zero=zero[1])
        loader.load_checkpoint(ckpt, tag="half")
        for step in range(2, STEPS):
            loader.train_step(*data.sample(step))
        want, got = reference.gather_parameters(), loader.gather_parameters()
        where = [("nvme_param" if z else o["device"]) for o, z in
                 zip((first, second), zero, strict=True)]
        results.append({"stage": stage, "from": where[0], "to": where[1],
                        "params_equal": all(np.array_equal(want[k], got[k]) for k in want),
                        "optimizer_equal": optimizer_digest(reference.strategy)
                        == optimizer_digest(loader.strategy)})
        reference.close()
        loader.close()
    return results


def files(comm, path):
    engine = build(2, "fp16", comm, nvme(path))
    directory = engine.strategy.nvme.file.dir
    data = gpt_data(comm, 2)
    engine.train_step(*data.sample(0))
    alive = os.path.isfile(os.path.join(directory, "optimizer.bin"))
    engine.close()
    engine = build(3, "fp16", comm, {"device": "cpu"}, zero={"offload_param": nvme_param(path)})
    params = engine.strategy.param_store.file.dir
    engine.train_step(*data.sample(0))
    alive = alive and os.path.isfile(os.path.join(params, "params.bin"))
    engine.close()
    return {"alive": alive, "removed": not os.path.exists(directory) and
            not os.path.exists(params)}


if __name__ == "__main__":
    comm = Comm()
    out = sys.argv[1]
    path = f"{out}/nvme"
    if comm.rank == 0:
        os.makedirs(path, exist_ok=True)
    comm.barrier()
    found = {"equality": equality_and_memory(comm, path),
             "checkpoints": checkpoints(comm, path, out), "files": files(comm, path)}
    comm.barrier()
    found["left"] = sorted(os.listdir(path))  # every run's directory removed
    report(found)

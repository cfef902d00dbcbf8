"""Rank side of tests/test_checkpoint.py: checkpoint jobs for one world size, in one launch.

    mpiexec -n N python tests/ranks/checkpoint_checks.py WORK_DIR JOBS_JSON

Each job builds a GPT engine (`case`: stage, precision, offload), optionally loads a
checkpoint, trains up to step `until`, optionally saves at step `save_at` (into
WORK_DIR/ckpt/<save_as>; with `async` the save is asynchronous and a second, synchronous save
of the same state goes to <save_as>_sync), and rank 0 writes the gathered parameters (and the
engine's step and loss scale) to WORK_DIR/<name>.npz at the end and, when saving, to
WORK_DIR/<name>_at_save.npz. With `roundtrip` a fresh engine of the same case loads the
checkpoint just saved and every rank reports whether its four state shards, step and loss
scale equal the saver's bit for bit. `corrupt` jobs load each damaged copy listed and report
the error message and whether the engine's state was left untouched.
"""
import json
import sys
from pathlib import Path

import numpy as np
from _report import report
from zero_checks import GPT_CONFIG, config, digest, gpt_data

from zmpi.checkpoint.store import STATES, CheckpointError
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT

CPU = {"device": "cpu"}


def build(case, comm):
    """case: "<stage>/<precision>[/offload|/dpu]", e.g. "3/fp16/offload"; the stage may be
    "hybrid:G" (hybrid sharding in groups of G ranks)."""
    stage, precision, *extra = case.split("/")
    hybrid = stage.startswith("hybrid:")
    cfg = config(3 if hybrid else int(stage), precision, accumulation=1, clip=0.5, n=comm.size,
                 **({"initial_scale_power": 12, "loss_scale_window": 2} if precision == "fp16"
                    else {}))
    if hybrid:
        cfg["zero_optimization"].update(strategy="hybrid", shard_group_size=int(stage[7:]))
    if "offload" in extra or "dpu" in extra:
        cfg["zero_optimization"]["offload_optimizer"] = dict(CPU)
    if "dpu" in extra:
        cfg["zero_optimization"]["offload_optimizer"].update(delay_update=True,
                                                             delay_update_warmup=2)
    dtype = np.float64 if precision == "fp64" else np.float32
    return Engine(GPT(GPT_CONFIG, seed=0, dtype=dtype), cfg, comm)


def state_digest(engine):
    shards = [np.asarray(engine.strategy.state_shard(s)) for s in STATES]
    return digest(shards), engine.global_steps, engine.scaler.scale


def dump(engine, comm, path):
    params = engine.gather_parameters()
    if comm.rank == 0:
        np.savez(path, **params, __step__=engine.global_steps, __scale__=engine.scaler.scale)


def train(engine, data, start, stop):
    for step in range(start, stop):
        engine.train_step(*data.sample(step))


def run_job(job, work, comm):
    engine = build(job["case"], comm)
    data = gpt_data(comm, 1)
    step, out = 0, {"name": job["name"]}
    if job.get("load"):
        loaded = engine.load_checkpoint(work / "ckpt" / job["load"])
        step = loaded.client_state["step"]
        out["notes"] = loaded.notes
    if "save_at" in job:
        train(engine, data, step, job["save_at"])
        step = job["save_at"]
        target = work / "ckpt" / job["save_as"]
        dump(engine, comm, work / f"{job['name']}_at_save.npz")
        before = state_digest(engine)
        engine.save_checkpoint(target, async_=job.get("async", False),
                               client_state={"step": step})
        if job.get("async"):  # the writer runs while training goes on; compare with sync
            train(engine, data, step, step + 1)
            engine.save_checkpoint(work / "ckpt" / (job["save_as"] + "_other"),
                                   client_state={"step": step + 1})
            fresh = build(job["case"], comm)
            fresh.load_checkpoint(target)
            out["async_equals_saver"] = state_digest(fresh) == before
            fresh.close()
            engine.close()
            engine = build(job["case"], comm)
            engine.load_checkpoint(target)
        if job.get("roundtrip"):
            fresh = build(job["case"], comm)
            fresh.load_checkpoint(target)
            out["roundtrip_equal"] = state_digest(fresh) == before
            fresh.close()
    train(engine, data, step, job["until"])
    dump(engine, comm, work / f"{job['name']}.npz")
    engine.close()
    return out


def corrupt_job(job, work, comm):
    """Load each damaged checkpoint copy; report its error and whether state survived."""
    engine = build(job["case"], comm)
    train(engine, gpt_data(comm, 1), 0, 1)
    before = state_digest(engine)
    outcomes = {}
    for name in job["corrupt"]:
        try:
            engine.load_checkpoint(work / "damaged" / name)
            outcomes[name] = {"error": None}
        except CheckpointError as e:
            outcomes[name] = {"error": str(e)}
        outcomes[name]["untouched"] = state_digest(engine) == before
    train(engine, gpt_data(comm, 1), 1, 2)  # the engine still trains (no rank left waiting)
    engine.close()
    return {"name": job["name"], "corrupt": outcomes}


def main():
    work, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    comm = Comm()
    results = [corrupt_job(j, work, comm) if "corrupt" in j else run_job(j, work, comm)
               for j in jobs]
    report({"jobs": results})


if __name__ == "__main__":
    main()

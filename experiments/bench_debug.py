"""What the failure checks cost: the collective mismatch check (`debug.check_collectives`, one
pickled allgather before every collective), the replica check (`engine.check_replicas()`) and
the preemption poll (one scalar allreduce per step), on the demo GPT.

    mpiexec -n 2 python experiments/bench_debug.py --out results/debug_n2

Times are medians over --repeats; they are measurements of this machine, not pass/fail.
"""
import argparse
import statistics
import sys
import time

import numpy as np

from results import write_results
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--stage", type=int, default=3)
    args = parser.parse_args()
    comm = Comm()
    model_cfg = GPTConfig(65, 64, 4, 4, 128)
    data = SyntheticSource(65, 64, 8 * comm.size, comm.rank, comm.size)
    rows, small = [], np.ones(16, np.float32)
    for checked in (False, True):
        engine = Engine(GPT(model_cfg, seed=0), {
            "train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True},
            "zero_optimization": {"stage": args.stage},
            "debug": {"check_collectives": checked}}, comm)
        engine.train_step(*data.sample(0))  # warm-up
        comm.reset_counters()
        engine.train_step(*data.sample(1))
        per_step_calls = sum(c["calls"] for c in engine.comm.counters_snapshot().values())
        step = median_time(lambda e=engine: e.train_step(*data.sample(2)), args.repeats)
        collective = median_time(lambda: comm.allreduce(small), args.repeats * 10)
        rows.append({"check_collectives": checked, "step_ms": 1e3 * step,
                     "collectives_per_step": per_step_calls,
                     "small_allreduce_us": 1e6 * collective})
        comm.check_collectives = False  # the next engine starts unchecked
    replicated = Engine(GPT(model_cfg, seed=0), {  # stage 0: every state is replicated
        "train_micro_batch_size_per_gpu": 8, "fp16": {"enabled": True}}, comm)
    replica = median_time(replicated.check_replicas, args.repeats)
    poll = median_time(lambda: comm.allreduce_scalar(0.0, op="max"), args.repeats * 10)
    if comm.rank != 0:
        return
    off, on = rows
    md = [f"Demo GPT ({engine.num_params:,} params), stage {args.stage}, fp16, N = {comm.size}, "
          f"median of {args.repeats}",
          "", "| check | train step ms | collectives per step | 16-element allreduce us |",
          "|---|---|---|---|",
          f"| off | {off['step_ms']:.1f} | {off['collectives_per_step']} | "
          f"{off['small_allreduce_us']:.1f} |",
          f"| check_collectives | {on['step_ms']:.1f} ({on['step_ms'] / off['step_ms']:.2f}x)"
          f" | {on['collectives_per_step']} | {on['small_allreduce_us']:.1f} "
          f"({on['small_allreduce_us'] / off['small_allreduce_us']:.1f}x) |",
          "", f"check_replicas() at stage 0 (all four states replicated): {1e3 * replica:.2f} "
          f"ms; preemption poll (one scalar "
          f"allreduce per step): {1e6 * poll:.1f} us"]
    print("\n".join(md))
    if args.out:
        rows.append({"check_replicas_ms": 1e3 * replica, "preemption_poll_us": 1e6 * poll})
        write_results(args.out, rows, md, comm, argv=sys.argv, model=vars(model_cfg))


if __name__ == "__main__":
    main()

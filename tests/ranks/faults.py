"""Rank side of tests/test_faults.py: one injected fault per launch; every mode must end the job
quickly with a clear message (the test asserts the exit code, the time and the message).

    mpiexec -n N python tests/ranks/faults.py MODE

Modes: mismatch_count, mismatch_dtype (with ZMPI_DEBUG=1: ranks call collectives of different
sizes/dtypes), skip (rank 1 skips an allreduce: the watchdog fires), gather_on_rank0 (only rank
0 calls a stage-3 collective), diverge (rank 1's stage-0 master weights drift; the replica
check fires),
nan (a NaN in unit 1's gradient on rank 0, fp32), nan_pp (the same on pipeline stage 0 of 2,
in its last unit), bad_ids_on_rank1 (only rank 1's batch has an
out-of-range token id), min_scale (fp16 overflows every step at the minimum loss scale),
stopped (each rank reports its pid, then rank 1 stops itself with SIGSTOP before a collective:
rank 0's watchdog aborts the job; the test checks that rank 1 does not outlive it).
"""
import os
import signal
import sys
import time

import numpy as np

from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=8)


def engine(comm, **extra):
    zero = extra.pop("zero", {"stage": 2})
    return Engine(GPT(CFG, seed=0), {"train_micro_batch_size_per_gpu": 2,
                                     "zero_optimization": zero, **extra}, comm)


def batch(step, comm):
    rng = np.random.default_rng(100 * step + comm.rank)
    return rng.integers(0, 16, (2, 8)), rng.integers(0, 16, (2, 8))


def main(mode):
    comm = Comm()
    if mode == "mismatch_count":
        comm.allreduce(np.ones(8 if comm.rank == 0 else 6, np.float32))
    elif mode == "mismatch_dtype":
        comm.allreduce(np.ones(8, np.float32 if comm.rank == 0 else np.float64))
    elif mode == "skip":
        comm.allreduce(np.ones(4, np.float32))
        if comm.rank != 1:
            comm.allreduce(np.ones(4, np.float32))  # rank 1 never comes
        else:  # enters its barrier later, so rank 0's watchdog is the first to fire
            time.sleep(1.5)
        comm.barrier()
    elif mode == "gather_on_rank0":
        e = engine(comm, zero={"stage": 3})
        if comm.rank == 0:
            e.gather_parameters()
    elif mode == "diverge":
        e = engine(comm, zero={"stage": 0}, debug={"check_replicas_every": 1})
        e.train_step(*batch(0, comm))
        if comm.rank == 1:  # a silent corruption of rank 1's replica of unit 1's master
            e.strategy.master[e.layout.full_slice(1)][5] += 1e-3
        e.train_step(*batch(1, comm))
    elif mode == "nan":
        e = engine(comm)
        unit = e.model.units[1]
        backward = unit.backward
        unit.backward = lambda dy: (backward(dy), comm.rank == 0 and e.strategy.  # noqa: E731
                                    _unit_grads[1].__setitem__(3, np.nan))[0]
        e.train_step(*batch(0, comm))
    elif mode == "nan_pp":  # the NaN in the last unit of pipeline stage 0, which has more
        # units than stage 1: its index meant nothing on stage 1
        e = engine(comm, pipeline={"stages": 2})
        last = len(e.model.units) - 1
        unit = e.model.units[last]
        backward = unit.backward
        unit.backward = lambda dy: (backward(dy), comm.rank == 0 and e.strategy.  # noqa: E731
                                    _unit_grads[last].__setitem__(3, np.nan))[0]
        e.train_step(*batch(0, comm))
    elif mode == "bad_ids_on_rank1":
        e = engine(comm)
        x, y = batch(0, comm)
        if comm.rank == 1:
            x[1, 3] = -1  # NumPy would read the last embedding row
        e.train_step(x, y)
    elif mode == "stopped":
        from _report import report

        comm.allreduce(np.ones(4, np.float32))
        report({"pid": os.getpid()})
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        comm.allreduce(np.ones(4, np.float32))
    elif mode == "min_scale":
        e = engine(comm, fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 1,
                               "hysteresis": 1, "min_loss_scale": 1})
        reduce = e.strategy.before_step
        e.strategy.before_step = lambda: (reduce(), e.strategy.optimizer_grads().fill(np.inf))
        for step in range(10):
            e.train_step(*batch(step, comm))
    else:
        raise SystemExit(f"unknown mode {mode}")
    if comm.rank == 0:
        print("UNREACHABLE: the fault went unnoticed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

"""Rank side of tests/test_comm.py: run every Comm check once and report the raw results.

    mpiexec -n 3 python tests/ranks/comm_checks.py

Inputs are simple functions of (rank, size); tests/test_comm.py computes the expected values
analytically and compares. Nothing is asserted here, so one failing check cannot hide others.
"""

import time

import ml_dtypes
import numpy as np
from _report import report

from zmpi import backend
from zmpi import comm as zcomm
from zmpi.comm import Comm, wait_all

BF16 = ml_dtypes.bfloat16
DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
          "bfloat16": BF16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


def f64(a):
    return np.asarray(a).astype(np.float64).tolist()


def main():
    comm = Comm()
    r, n = comm.rank, comm.size
    out = {"size": n, "local_rank": comm.local_rank, "local_size": comm.local_size,
           "is_cuda_aware": comm.is_cuda_aware, "backend": backend.name}

    # allreduce (sum of rank; max/min of +-rank), any contiguous shape
    out["allreduce_sum"] = {k: f64(comm.allreduce(np.full((2, 3), r, dt)))
                            for k, dt in DTYPES.items()}
    out["allreduce_max"] = {k: f64(comm.allreduce(np.array([r, 7 - r], dt), op="max"))
                            for k, dt in DTYPES.items()}
    out["allreduce_min"] = {k: f64(comm.allreduce(np.array([r, 7 - r], dt), op="min"))
                            for k, dt in DTYPES.items()}
    for op in ("max", "min"):
        vals = np.array([-1.5 * r, 0.25 * r, 3.0 - r], BF16)
        out[f"bf16_signed_{op}"] = f64(comm.allreduce(vals, op=op))
    # bf16 with values that round: compare to the float32 sum in the test; ranks must agree
    x = np.random.default_rng(1234 + r).standard_normal(1000).astype(BF16)  # test regenerates
    out["bf16_random_sum"] = f64(comm.allreduce(x.copy()))
    out["allreduce_scalar"] = {op: comm.allreduce_scalar(r + 0.5, op)
                               for op in ("sum", "max", "min")}

    # reduce_scatter: send[i] = r + i, block length 2 -> recv[j] = sum_q q + n*(2*rank + j)
    out["reduce_scatter"] = {}
    for k in ("float64", "float32", "float16", "bfloat16", "int64"):
        send = (r + np.arange(2 * n)).astype(DTYPES[k])
        out["reduce_scatter"][k] = f64(comm.reduce_scatter(send, np.empty(2, DTYPES[k])))
    send = (r + np.arange(2 * n)).astype(np.float32).reshape(n, 2)  # 2-D send, max
    out["reduce_scatter_max"] = f64(comm.reduce_scatter(send, np.empty(2, np.float32), op="max"))

    # allgather: rank q sends q + 0.5*i (i < 3); inplace: own block holds q + 1
    out["allgather"], out["allgather_inplace"] = {}, {}
    for k in ("float64", "float32", "float16", "bfloat16", "uint8"):
        dt = DTYPES[k]
        send = (r + 0.5 * np.arange(3)).astype(dt)
        out["allgather"][k] = f64(comm.allgather(send, np.empty(3 * n, dt)))
        buf = np.zeros(3 * n, dt)
        buf[3 * r:3 * r + 3] = r + 1
        out["allgather_inplace"][k] = f64(comm.allgather_inplace(buf))

    # broadcast from the last rank
    out["broadcast"] = {}
    for k in ("float32", "bfloat16", "int32"):
        buf = np.arange(5).astype(DTYPES[k]) if r == n - 1 else np.zeros(5, DTYPES[k])
        out["broadcast"][k] = f64(comm.broadcast(buf, root=n - 1))
    out["bcast_object"] = comm.bcast_object({"from": r, "list": [1, 2]}, root=0)
    out["allgather_object"] = comm.allgather_object(("r", r))

    # non-blocking: two requests in flight at once
    a = np.full(4, r, np.float32)
    b = np.full(6, r, BF16)
    req_a, req_b = comm.iallreduce(a), comm.iallreduce(b, op="sum")
    req_b.wait()
    req_a.wait()
    out["nb_allreduce"] = [f64(a), f64(b), req_a.wait() is a, req_b.test()]  # wait idempotent
    send = (r + np.arange(2 * n)).astype(BF16)
    rs_recv = np.empty(2, BF16)
    g_send, g_recv = np.full(2, r, np.float32), np.empty(2 * n, np.float32)
    ip = np.zeros(2 * n, np.float64)
    ip[2 * r:2 * r + 2] = r + 1
    reqs = [comm.ireduce_scatter(send, rs_recv), comm.iallgather(g_send, g_recv),
            comm.iallgather_inplace(ip)]
    while not reqs[0].test():
        pass
    results = wait_all(reqs)
    out["nb_reduce_scatter"] = f64(rs_recv)
    out["nb_allgather"] = f64(g_recv)
    out["nb_allgather_inplace"] = f64(ip)
    out["nb_results_are_outputs"] = [results[0] is rs_recv, results[1] is g_recv, results[2] is ip]

    # sub-communicators: even and odd ranks
    sub = comm.split(r % 2)
    comm.reset_counters()
    gathered = sub.allgather(np.array([r], np.int32), np.empty(sub.size, np.int32))
    out["split"] = {"rank": sub.rank, "size": sub.size, "sum": sub.allreduce_scalar(float(r)),
                    "gather": f64(gathered),
                    "sub_calls": sum(c["calls"] for c in sub.counters_snapshot().values()),
                    "parent_calls": sum(c["calls"] for c in comm.counters_snapshot().values())}
    sub.free()

    # local errors: every rank raises before MPI is called, and MPI still works afterwards
    errors = {}
    f32 = np.float32
    z = np.zeros
    bad = {
        "reduce_scatter_size": lambda: comm.reduce_scatter(z(2 * n + 1, f32), z(2, f32)),
        "allgather_size": lambda: comm.allgather(np.zeros(2, f32), np.zeros(2 * n - 1, f32)),
        "allgather_inplace_size": lambda: comm.allgather_inplace(np.zeros(2 * n + 1, f32)),
        "iallgather_size": lambda: comm.iallgather(np.zeros(2, f32), np.zeros(2 * n + 2, f32)),
        "ireduce_scatter_size": lambda: comm.ireduce_scatter(z(2 * n, f32), z(3, f32)),
        "dtype_mismatch": lambda: comm.allgather(np.zeros(2, f32), np.zeros(2 * n, np.float64)),
        "non_contiguous": lambda: comm.allreduce(np.zeros((4, 4), f32)[:, 0]),
        "bad_op": lambda: comm.allreduce(np.zeros(2, f32), op="prod"),
        "bad_dtype": lambda: comm.allreduce(np.zeros(2, np.complex64)),
        "bad_root": lambda: comm.broadcast(np.zeros(2, f32), root=n),
    }
    for name, fn in bad.items():
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["after_errors"] = comm.allreduce_scalar(1.0)

    # counters: a fixed sequence, compared with the ring model in the test
    comm.reset_counters()
    comm.allreduce(np.zeros(10, np.float32))
    comm.allreduce(np.zeros(10, np.float32))
    comm.iallreduce(np.zeros(7, np.float16)).wait()
    comm.reduce_scatter(np.zeros(3 * n, np.float32), np.zeros(3, np.float32))
    comm.ireduce_scatter(np.zeros(2 * n, BF16), np.zeros(2, BF16)).wait()
    comm.allgather(np.zeros(2, np.float64), np.zeros(2 * n, np.float64))
    comm.allgather_inplace(np.zeros(5 * n, np.float32))
    comm.iallgather(np.zeros(1, np.float16), np.zeros(n, np.float16)).wait()
    comm.broadcast(np.zeros(6, np.float32), root=1 % n)
    comm.allreduce_scalar(1.0)
    obj = comm.bcast_object([1, 2, 3])
    objs = comm.allgather_object(r)
    out["counters"] = comm.counters_snapshot()
    out["objects"] = [obj, objs]
    comm.reset_counters()
    out["counters_after_reset"] = comm.counters_snapshot()

    # While a non-blocking collective is in flight and this thread makes no MPI call (it
    # sleeps), the progress thread polls MPI; once the collective completed it rests. First
    # as chosen by default (a thread only with a spare core per rank), then forced on.
    for mode in ("auto", "1"):
        zcomm._PROGRESS.mode = mode
        polls = zcomm._PROGRESS.polls
        req = comm.iallreduce(np.full(1 << 20, r + 1.0, np.float32))  # 4 MiB: not eager
        in_flight = zcomm._PROGRESS._in_flight
        time.sleep(0.2)
        out[f"progress_{mode}"] = {
            "in_flight": in_flight, "polls": zcomm._PROGRESS.polls - polls,
            "sum_ok": bool((req.wait() == n * (n + 1) / 2).all()),
            "in_flight_after": zcomm._PROGRESS._in_flight, "cores": backend.host_cores()}
    comm.barrier()
    report(out)


if __name__ == "__main__":
    main()

"""Rank side of tests/test_comm.py: run every Comm check once and report the raw results.

    mpiexec -n 3 python tests/ranks/comm_checks.py
    ZMPI_COLLECTIVE_TIMEOUT=1 mpiexec -n 2 python tests/ranks/comm_checks.py recv_nothing

Inputs are simple functions of (rank, size); tests/test_comm.py computes the expected values
analytically and compares. Nothing is asserted here, so one failing check cannot hide others.
`recv_nothing`: rank 0 waits in a recv that rank 1 (asleep, outside MPI) never sends; the
watchdog must end the job.
"""

import sys
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

    # point-to-point: a ring (rank 0 sends first, the others receive first), then non-blocking
    # messages both ways on two tags, waited for in reverse order
    right, left = (r + 1) % n, (r - 1) % n
    comm.reset_counters()
    sent, got = (10 * r + np.arange(6)).astype(np.float32).reshape(2, 3), np.zeros((2, 3), f32)
    if r == 0:
        returned = [comm.send(sent, right) is sent, comm.recv(got, left) is got]
    else:
        returned = [comm.recv(got, left) is got, comm.send(sent, right) is sent]
    a_in, b_in = np.zeros(4, BF16), np.zeros(2, np.int64)
    reqs = [comm.irecv(a_in, left, tag=4), comm.irecv(b_in, right, tag=9),
            comm.isend(np.full(4, r + 0.5, BF16), right, tag=4),
            comm.isend(np.array([r, -r], np.int64), left, tag=9)]
    results = wait_all(reqs[::-1])
    out["p2p"] = {"ring": f64(got), "bf16": f64(a_in), "int64": f64(b_in),
                  "results_are_buffers": returned + [results[3] is a_in, results[2] is b_in]}
    snap = comm.counters_snapshot()
    out["p2p_counters"] = {op: snap.pop(op) for op in ("send", "recv")}
    out["p2p_other_calls"] = sum(c["calls"] for c in snap.values())

    # a message whose dtype or size differs from the receive buffer: ValueError on the
    # receiver (blocking and not), never a hang or a silent truncation; then all is well
    p2p_errors = {}
    for name, buf in (("larger", np.zeros(2, f32)), ("smaller", np.zeros(8, f32)),
                      ("dtype", np.zeros(4, np.int32))):
        for how in ("recv", "irecv"):
            sreq = comm.isend(np.ones(4, f32), right, tag=11)
            try:
                if how == "recv":
                    comm.recv(buf, left, tag=11)
                else:
                    req = comm.irecv(buf, left, tag=11)
                    while not req.test():  # test() raises too, once the message is in
                        pass
                p2p_errors[f"{how}_{name}"] = None
            except ValueError as e:
                p2p_errors[f"{how}_{name}"] = str(e)
            sreq.wait()
    bad = {"bad_dest": lambda: comm.send(np.zeros(2, f32), n),
           "bad_source": lambda: comm.irecv(np.zeros(2, f32), -1),
           "bad_tag": lambda: comm.isend(np.zeros(2, f32), right, tag=-1),
           "non_contiguous": lambda: comm.send(np.zeros((4, 4), f32)[:, 0], right)}
    for name, fn in bad.items():
        try:
            fn()
            p2p_errors[name] = None
        except ValueError as e:
            p2p_errors[name] = str(e)
    out["p2p_errors"] = p2p_errors
    after = comm.isend(np.full(3, r, np.int32), right, tag=11)
    out["p2p_after_errors"] = f64(comm.recv(np.zeros(3, np.int32), left, tag=11))
    after.wait()

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

    # make_progress (the engine's call between units) probes MPI from this thread while a
    # request is in flight and no progress thread runs, and does nothing otherwise.
    pokes = zcomm._PROGRESS.pokes
    zcomm.make_progress()  # nothing in flight
    req = comm.iallreduce(np.full(1 << 20, r + 1.0, np.float32))
    zcomm.make_progress()
    out["pokes"] = {"thread": zcomm._PROGRESS._thread is not None,
                    "pokes": zcomm._PROGRESS.pokes - pokes,
                    "sum_ok": bool((req.wait() == n * (n + 1) / 2).all())}

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


def recv_nothing():
    comm = Comm()
    if comm.rank == 0:
        comm.recv(np.zeros(4, np.float32), 1, tag=3)  # rank 1 never sends
        print("UNREACHABLE: the recv returned", flush=True)
    else:
        time.sleep(60)


if __name__ == "__main__":
    recv_nothing() if sys.argv[1:] == ["recv_nothing"] else main()

"""MPI's rates on this machine, for `measure_this`: collective over a zmpi.comm.Comm, each
rank's figure the slowest rank's.

- `measure_allreduce`: float32 allreduces of ALLREDUCE_BYTES (latency, bandwidth) and a
  float16 one of HALF_BYTES, the least of a few after a barrier each;
- `measure_crowded_allreduce`, for ranks that outnumber the cores: what the same float32
  allreduces add to a loop of GEMMs of BETWEEN_SHAPE that every rank runs at once;
- `fit_allreduce_link`, `fit_half_reduction_rate`: the ring model's Link through both
  allreduces (for the crowded ones its latency a call's), and the rate at which the MPI sums
  float16 beyond it;
- `measure_send_progress`, `describe_send_progress`: whether a message moves while its
  sender computes (recorded and said, not modelled);
- `measure_sync_skew`: what an allreduce between GEMMs waits beyond the GEMMs and the
  allreduce alone (the ranks' arrival skew);
- `measure_link`: the allreduces, the send progress and the skew together;
- `in_turns`: a rank's own work timed alone, each rank in turn.

`zmpi.plan.measure` runs them under mpiexec (`python -m zmpi.plan.measure --comm`).
"""
from __future__ import annotations

import statistics
import time
from functools import partial

import numpy as np

from zmpi.plan.hardware import Link
from zmpi.plan.time import ring_sent

ALLREDUCE_BYTES = {"small": 8, "large": 32 << 20}  # payloads: for the latency, the bandwidth
HALF_BYTES = 1 << 20  # a float16 allreduce's payload: MPI's float16 reduction rate
BETWEEN_SHAPE = (512, 256, 256)  # the GEMM between calls (sync skew; oversubscribed ranks)
SEND_PROGRESS_BYTES = 1 << 20  # the message of `measure_send_progress`
SENDER_BUSY_SECONDS = 0.02  # how long its sender computes after starting it
CROWDED_CALLS = {"small": 50, "large": 3}  # per loop of `measure_crowded_allreduce`


def measure_allreduce(comm, repeats: int = 10) -> dict:
    """Collective: the slowest rank's least seconds of a float32 allreduce of each of
    ALLREDUCE_BYTES and of a float16 one of HALF_BYTES on `comm` (a zmpi.comm.Comm, so
    float16 goes as zmpi sends it: MPI's own float16, or float32 where the MPI has none), the
    ranks starting each call together (a barrier before it)."""
    out = {"ranks": comm.size, "messages": 2 * (comm.size - 1), "repeats": repeats}
    payloads = [(name, nbytes, np.float32) for name, nbytes in ALLREDUCE_BYTES.items()]
    for name, nbytes, dtype in payloads + [("half", HALF_BYTES, np.float16)]:
        buf = np.zeros(nbytes // np.dtype(dtype).itemsize, dtype)  # zeros: no overflow
        comm.allreduce(buf)
        times = []
        for _ in range(5 * repeats if name == "small" else repeats):
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(buf)
            times.append(time.perf_counter() - start)
        out[f"{name}_bytes"] = buf.nbytes
        out[f"{name}_seconds"] = comm.allreduce_scalar(min(times), op="max")
    return out


def measure_crowded_allreduce(comm, repeats: int = 5) -> dict:
    """Collective, for ranks that outnumber the cores: what a float32 allreduce of each of
    ALLREDUCE_BYTES adds, per call, to a loop of GEMMs of BETWEEN_SHAPE that every rank runs
    at once ("small_seconds", "large_seconds"). Training computes between collectives, so a
    call also waits for peers the OS has descheduled; the time model charges the GEMMs
    themselves as compute at the ranks' core share, so the link is what a call adds beyond
    them. Loops of CROWDED_CALLS[size] GEMMs, with and without a call after each, alternate
    `repeats` times; a figure is the mean over a loop (a step sums its calls, the long waits
    with the short) of the slowest rank, the median over the repeats."""
    gemm = between_gemm()
    out = {"ranks": comm.size, "messages": 2 * (comm.size - 1), "repeats": repeats}
    for name, nbytes in ALLREDUCE_BYTES.items():
        buf = np.zeros(nbytes // 4, np.float32)
        comm.allreduce(buf)
        calls, added = CROWDED_CALLS[name], []
        for _ in range(repeats):
            alone = comm.allreduce_scalar(_loop_seconds(comm, calls, gemm), op="max")
            both = _loop_seconds(comm, calls, gemm, partial(comm.allreduce, buf))
            added.append(comm.allreduce_scalar(both, op="max") - alone)
        out[f"{name}_bytes"] = buf.nbytes
        out[f"{name}_seconds"] = statistics.median(added)
    return out


def between_gemm():
    """A GEMM of BETWEEN_SHAPE (float32, into a buffer of its own), to run between calls."""
    m, k, n = BETWEEN_SHAPE
    return partial(np.matmul, np.ones((m, k), np.float32), np.ones((k, n), np.float32),
                   out=np.empty((m, n), np.float32))


def in_turns(comm, fn):
    """Collective: `fn()` on each rank of `comm` in turn, the others asleep in an idle barrier
    (ranks that outnumber the cores time their own work alone, not the crowd's); this rank's
    result."""
    for turn in range(comm.size):
        if turn == comm.rank:
            mine = fn()
        comm.barrier(idle=True)
    return mine


def _loop_seconds(comm, calls: int, *steps) -> float:
    """This rank's seconds per iteration of `calls` iterations of `steps` (callables, in
    turn), the ranks starting together (a barrier before)."""
    comm.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        for step in steps:
            step()
    return (time.perf_counter() - start) / calls


def measure_send_progress(comm, nbytes: int = SEND_PROGRESS_BYTES,
                          busy: float = SENDER_BUSY_SECONDS, repeats: int = 3) -> dict:
    """Collective: whether a message moves while its sender computes. Rank 0 starts a
    non-blocking send of `nbytes` to rank 1 and then runs GEMMs for `busy` seconds without
    calling MPI; rank 1 times its blocking receive (the least of `repeats`). Where MPI has a
    single-copy path between processes (CMA, XPMEM) the receiver takes the message at once;
    without one, a message above the eager limit moves only inside MPI calls on both ranks,
    so it arrives when the sender next calls MPI (here: after `busy`; the engine's calls
    between units, `zmpi.comm.make_progress`, are left out). A pipeline's activations and a
    bucket's reduction then wait for their sender's compute."""
    buf, gemm = np.zeros(nbytes, np.uint8), between_gemm()
    times = []
    for _ in range(repeats):
        comm.barrier()
        if comm.rank == 0:
            request = comm.isend(buf, 1)
            start = time.perf_counter()
            while time.perf_counter() - start < busy:
                gemm()
            request.wait()
        elif comm.rank == 1:
            start = time.perf_counter()
            comm.recv(buf, 0)
            times.append(time.perf_counter() - start)
    received = comm.allreduce_scalar(min(times) if times else 0.0, op="max")
    return {"bytes": nbytes, "sender_busy_seconds": busy, "receive_seconds": received,
            "moves_while_sender_computes": received < busy / 2}


def measure_sync_skew(comm, calls: int = 100, repeats: int = 5) -> float:
    """Collective: the seconds an 8-byte allreduce after a GEMM of BETWEEN_SHAPE waits beyond
    the GEMM alone and the allreduce alone, per call: `calls` of each loop (GEMMs, allreduces,
    both in turn), `repeats` times in alternation, the least of each; the slowest rank's
    figure, 0 if none. Ranks that compute the same work still arrive apart (their compute's
    jitter), and each synchronous call waits for the last of them."""
    gemm, buf = between_gemm(), np.zeros(2, np.float32)
    loops = {"compute": (gemm,), "sync": (partial(comm.allreduce, buf),),
             "both": (gemm, partial(comm.allreduce, buf))}
    least = dict.fromkeys(loops, float("inf"))
    for _ in range(repeats):
        for name, steps in loops.items():
            least[name] = min(least[name], _loop_seconds(comm, calls, *steps))
    skew = max(least["both"] - least["compute"] - least["sync"], 0.0)
    return comm.allreduce_scalar(skew, op="max")


def measure_link(comm) -> dict:
    """Collective: `measure_allreduce` with what ranks that have cores of their own also
    measure beside it: `measure_send_progress` ("send_progress") and `measure_sync_skew`
    ("sync_skew_seconds")."""
    return {**measure_allreduce(comm), "send_progress": measure_send_progress(comm),
            "sync_skew_seconds": measure_sync_skew(comm)}


def describe_send_progress(sends: dict) -> str:
    """A line on `measure_send_progress`'s result, with the remedy where messages wait."""
    size, got, busy = sends["bytes"] >> 10, sends["receive_seconds"], sends["sender_busy_seconds"]
    if sends["moves_while_sender_computes"]:
        return (f"a {size} KiB message moves while its sender computes (received in "
                f"{got * 1e3:.2f} ms)")
    return (f"a {size} KiB message waited {got * 1e3:.1f} ms, until its sender's next MPI "
            f"call ({busy * 1e3:.0f} ms of compute): there is no single-copy path between "
            "processes (CMA, XPMEM; a container may forbid CMA). The engine probes MPI between "
            "units, which moves such messages with Open MPI but only a few KiB a call with "
            "MPICH; the time model does not charge what is left. Allow CMA, or give MPI a "
            "progress thread of its own (MPICH: MPIR_CVAR_ASYNC_PROGRESS=1)")


def fit_allreduce_link(allreduce: dict, per_call: bool = False) -> Link:
    """The Link with which link.seconds(ring_sent(n, N), 2(N-1)) equals both measured
    allreduce times of `measure_allreduce` (two points, two unknowns); `per_call`: with
    link.seconds(ring_sent(n, N), 1), its latency a call's, for `measure_crowded_allreduce`
    (ranks that outnumber the cores wait once a call for the peers the OS has descheduled,
    whatever the group: an 8-byte call took 1.0-1.1 ms on 4 ranks and on 2 of the 4 alike,
    where a latency per ring message would charge the 2 a third of the 4's)."""
    ranks = allreduce["ranks"]
    messages = 1 if per_call else allreduce["messages"]
    small = ring_sent(allreduce["small_bytes"], ranks), allreduce["small_seconds"]
    large = ring_sent(allreduce["large_bytes"], ranks), allreduce["large_seconds"]
    if large[1] <= small[1]:
        raise RuntimeError(f"allreduce of {allreduce['large_bytes']} bytes took no longer "
                           f"than one of {allreduce['small_bytes']}: {allreduce}")
    bandwidth = (large[0] - small[0]) / (large[1] - small[1])
    latency = max(small[1] - small[0] / bandwidth, 1e-12) / messages
    return Link(bandwidth=bandwidth, latency=latency, per_call=per_call)


def fit_half_reduction_rate(allreduce: dict, link: Link) -> float | None:
    """Bytes/s at which the MPI reduces float16 beyond `link`'s time: a ring allreduce of n
    bytes over N ranks reduces (N-1)/N n of them on each rank, and the float16 allreduce
    measured took that long more than link.seconds gives for its bytes. None where it took
    no longer (an MPI whose float16 sums cost nothing extra)."""
    ranks, nbytes = allreduce["ranks"], allreduce["half_bytes"]
    extra = allreduce["half_seconds"] - link.seconds(ring_sent(nbytes, ranks),
                                                     allreduce["messages"])
    return (ranks - 1) / ranks * nbytes / extra if extra > 0 else None

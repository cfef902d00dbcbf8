"""Wall time and bus bandwidth of each collective zmpi uses, at several sizes, on this MPI: the
cost model behind the traffic tables (bytes sent per rank, ring model) checked against the
machine.

    mpiexec -n 2 python experiments/bandwidth.py --out results/bandwidth_n2

For each op (allreduce, reduce_scatter, allgather) and payload size (float32), the median
time of --repeats calls through `Comm` and of the same MPI call made directly through mpi4py
(the peer: what `Comm`'s checks, counting, queue and watchdog cost beyond MPI), the
algorithm bandwidth (payload / time) and the bus
bandwidth as nccl-tests defines it: algbw x 2(N-1)/N for allreduce, x (N-1)/N for
reduce-scatter and allgather, i.e. the bytes each rank sends per second under the ring model
that `Comm` counts.

Then the bucketing trade-off behind `Strategy.solo_numel`: a bucket of --bucket-units units
of U float32 elements each, allgathered either one unit at a time in place (a collective per
unit) or packed (this rank's shards copied into one buffer, one collective, every rank's
pieces copied out), as `Strategy.allgather_shard_into` does, at several U (packing.md/.csv).
Packing saves latency on small units and costs copies on large ones. Measurements of this
machine, never a test.
"""
import argparse
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from results import write_results
from zmpi.comm import Comm


def median_seconds(comm, call, repeats, *others):
    """The slowest rank's median seconds of `call()` over `repeats` calls (after one untimed),
    the ranks starting each call together; with `others`, a list of such medians, one per
    call, the calls taking turns, each first as often (a shared machine's speed moves from
    second to second)."""
    calls = (call, *others)
    for c in calls:
        c()
    times = [[] for _ in calls]
    for k in range(repeats):
        turns = list(zip(calls, times, strict=True))
        for c, kept in turns[::-1] if k % 2 else turns:  # each first as often (warm caches)
            comm.barrier()
            start = time.perf_counter()
            c()
            kept.append(time.perf_counter() - start)
    medians = [comm.allreduce_scalar(statistics.median(t), op="max") for t in times]
    return medians if others else medians[0]


def measure(comm, op, nbytes, repeats):
    n = max(nbytes // 4 // comm.size, 1) * comm.size  # float32 elements, a multiple of N
    full = np.ones(n, np.float32)
    part = np.ones(n // comm.size, np.float32)
    call = {"allreduce": lambda: comm.allreduce(full),
            "reduce_scatter": lambda: comm.reduce_scatter(full, part),
            "allgather": lambda: comm.allgather(part, full)}[op]
    raw = {"allreduce": lambda: comm.mpi.Allreduce(MPI.IN_PLACE, full),
           "reduce_scatter": lambda: comm.mpi.Reduce_scatter_block(full, part),
           "allgather": lambda: comm.mpi.Allgather(part, full)}[op]
    seconds, mpi4py_seconds = median_seconds(comm, call, repeats, raw)
    algbw = full.nbytes / seconds
    factor = (2 if op == "allreduce" else 1) * (comm.size - 1) / comm.size
    return {"op": op, "bytes": full.nbytes, "seconds": seconds, "algbw_GBps": algbw / 1e9,
            "busbw_GBps": algbw * factor / 1e9, "mpi4py_seconds": mpi4py_seconds,
            "beyond_mpi_seconds": seconds - mpi4py_seconds}


def measure_packing(comm, unit_numel, units, repeats):
    """Median seconds (the slowest rank's) of allgathering `units` units of about
    `unit_numel` float32 elements each, one in-place collective per unit against one packed
    collective with the copies in and out."""
    shard = max(unit_numel // comm.size, 1)
    n, me = shard * comm.size, comm.rank
    full = np.ones(units * n, np.float32)  # the units back to back, each one rank-major
    packed = np.empty_like(full)  # rank 0's shards of every unit, then rank 1's, ...

    def solo():
        for u in range(units):
            comm.allgather_inplace(full[u * n:(u + 1) * n])

    def pack():
        for u in range(units):
            at = (me * units + u) * shard
            packed[at:at + shard] = full[u * n + me * shard:u * n + (me + 1) * shard]
        comm.allgather_inplace(packed)
        for r in range(comm.size):
            for u in range(units):
                at = (r * units + u) * shard
                full[u * n + r * shard:u * n + (r + 1) * shard] = packed[at:at + shard]

    row = {"unit_numel": n, "units": units, "solo_s": median_seconds(comm, solo, repeats),
           "packed_s": median_seconds(comm, pack, repeats)}
    row["packed_over_solo"] = row["packed_s"] / row["solo_s"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[2**10, 2**14, 2**18, 2**22, 2**24])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--unit-numels", type=int, nargs="+",
                        default=[2**10, 2**12, 2**13, 2**14, 2**15, 2**16, 2**18, 2**20])
    parser.add_argument("--bucket-units", type=int, default=4)
    args = parser.parse_args()
    comm = Comm()
    rows = [measure(comm, op, size, args.repeats)
            for op in ("allreduce", "reduce_scatter", "allgather") for size in args.sizes]
    packing = [measure_packing(comm, numel, args.bucket_units, args.repeats)
               for numel in args.unit_numels]
    if comm.rank != 0:
        return
    md = [f"Collectives through zmpi.comm.Comm on this MPI, N = {comm.size}, float32, median "
          f"of {args.repeats} (the slowest rank's)", "",
          "| op | bytes | time | algbw GB/s | busbw GB/s | mpi4py alone | Comm beyond it |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['op']} | {r['bytes']:,} | {1e6 * r['seconds']:,.0f} us | "
                  f"{r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} | "
                  f"{1e6 * r['mpi4py_seconds']:,.0f} us | "
                  f"{1e6 * r['beyond_mpi_seconds']:,.0f} us |")
    pack_md = [f"Allgather of a bucket of {args.bucket_units} units, N = {comm.size}, float32: "
               "one in-place collective per unit, or packed into one (copies in and out)", "",
               "| elements per unit | per unit | packed | packed / per unit |",
               "|---|---|---|---|"]
    for r in packing:
        pack_md.append(f"| {r['unit_numel']:,} | {1e6 * r['solo_s']:,.0f} us | "
                       f"{1e6 * r['packed_s']:,.0f} us | {r['packed_over_solo']:.2f} |")
    print("\n".join(md + [""] + pack_md))
    if args.out:
        write_results(args.out, packing, pack_md, comm, name="packing", argv=sys.argv)
        write_results(args.out, rows, md, comm, argv=sys.argv, packing=packing)  # run.json


if __name__ == "__main__":
    main()

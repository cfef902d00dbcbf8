"""Wall time and bus bandwidth of each collective zmpi uses, at several sizes, on this MPI: the
cost model behind the traffic tables (bytes sent per rank, ring model) checked against the
machine.

    mpiexec -n 2 python experiments/bandwidth.py --out results/bandwidth_n2

For each op (allreduce, reduce_scatter, allgather) and payload size (float32), the median
time of --repeats calls through `Comm`, the algorithm bandwidth (payload / time) and the bus
bandwidth as nccl-tests defines it: algbw x 2(N-1)/N for allreduce, x (N-1)/N for
reduce-scatter and allgather, i.e. the bytes each rank sends per second under the ring model
that `Comm` counts. Measurements of this machine, never a test.
"""
import argparse
import statistics
import sys
import time

import numpy as np

from results import write_results
from zmpi.comm import Comm


def measure(comm, op, nbytes, repeats):
    n = max(nbytes // 4 // comm.size, 1) * comm.size  # float32 elements, a multiple of N
    full = np.ones(n, np.float32)
    part = np.ones(n // comm.size, np.float32)
    call = {"allreduce": lambda: comm.allreduce(full),
            "reduce_scatter": lambda: comm.reduce_scatter(full, part),
            "allgather": lambda: comm.allgather(part, full)}[op]
    call()
    times = []
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    seconds = comm.allreduce_scalar(statistics.median(times), op="max")
    algbw = full.nbytes / seconds
    factor = (2 if op == "allreduce" else 1) * (comm.size - 1) / comm.size
    return {"op": op, "bytes": full.nbytes, "seconds": seconds, "algbw_GBps": algbw / 1e9,
            "busbw_GBps": algbw * factor / 1e9}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[2**10, 2**14, 2**18, 2**22, 2**24])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    comm = Comm()
    rows = [measure(comm, op, size, args.repeats)
            for op in ("allreduce", "reduce_scatter", "allgather") for size in args.sizes]
    if comm.rank != 0:
        return
    md = [f"Collectives through zmpi.comm.Comm on this MPI, N = {comm.size}, float32, median "
          f"of {args.repeats} (the slowest rank's)", "",
          "| op | bytes | time | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['op']} | {r['bytes']:,} | {1e6 * r['seconds']:,.0f} us | "
                  f"{r['algbw_GBps']:.2f} | {r['busbw_GBps']:.2f} |")
    print("\n".join(md))
    if args.out:
        write_results(args.out, rows, md, comm, argv=sys.argv)


if __name__ == "__main__":
    main()

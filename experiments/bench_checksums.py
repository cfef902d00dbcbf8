"""What the NVMe tier's CRC32 checksums cost a transfer: zmpi.offload.aio's write and read
passes with the checksums and without (zlib.crc32 replaced by a constant), paired.

    python experiments/bench_checksums.py --out results/nvme_checksums [--nvme-path DIR]

A file of --mib MiB opened O_DIRECT (where the file system takes it) is written and read back
in requests of --block-mib MiB by AsyncIO(queue depth 16, --threads I/O threads), --rounds
times with and without the checksums, in alternating order. Reports each pass's bandwidth
(medians) and the paired median of the time ratios, and zlib.crc32's speed on one core. The
checksums run on the I/O threads: where they have cores of their own the checksum of one
request overlaps the transfer of the others; on busy cores it does not (docs/offload.md).
"""
import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np

from results import write_results
from zmpi.comm import MPI, Comm
from zmpi.offload import aio

MIB = 1 << 20
CRC32 = zlib.crc32  # aio's zlib is this zlib: the constant replaces it module-wide


def passes(fd, buf, block: int, threads: int, checksums: bool) -> tuple[float, float]:
    """(seconds of the write pass, of the read pass) over buf, in requests of `block` bytes."""
    aio.zlib.crc32 = CRC32 if checksums else (lambda data: 0)
    engine = aio.AsyncIO(block, 16, threads)
    view, times = memoryview(buf), []
    try:
        for start in (engine.write, engine.read):
            t0 = time.perf_counter()
            for t in [start(fd, view[o:o + block], o) for o in range(0, len(buf), block)]:
                t.wait()
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
        aio.zlib.crc32 = CRC32
    return times[0], times[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/nvme_checksums")
    ap.add_argument("--nvme-path", default=None, help="a directory on the drive (default: "
                    "the system's temporary directory)")
    ap.add_argument("--mib", type=int, default=48)
    ap.add_argument("--block-mib", type=int, default=1)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    size, block = args.mib * MIB, args.block_mib * MIB
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, size, np.uint8)
    fd, path = tempfile.mkstemp(dir=args.nvme_path, prefix="zmpi-crc-")
    os.close(fd)
    try:
        fd, direct = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0)), True
    except OSError:  # a file system without direct I/O (tmpfs): through the page cache
        fd, direct = os.open(path, os.O_RDWR), False
    try:
        runs = {True: [], False: []}
        for i in range(args.rounds):
            for checksums in ((True, False) if i % 2 else (False, True)):
                runs[checksums].append(passes(fd, buf, block, args.threads, checksums))
    finally:
        os.close(fd)
        os.unlink(path)
    t0 = time.perf_counter()
    CRC32(buf)
    crc_gbs = size / (time.perf_counter() - t0) / 1e9
    rows = []
    for k, name in enumerate(("write", "read")):
        on, off = [r[k] for r in runs[True]], [r[k] for r in runs[False]]
        rows.append({"pass": name, "gib_s_without": size / statistics.median(off) / 2**30,
                     "gib_s_with": size / statistics.median(on) / 2**30,
                     "overhead": statistics.median([a / b for a, b in
                                                    zip(on, off, strict=True)]) - 1})
    load = os.getloadavg()[0]
    md = [f"AsyncIO passes over {args.mib} MiB in {args.block_mib} MiB requests, queue depth "
          f"16, {args.threads} I/O threads, {'O_DIRECT' if direct else 'page cache'}, "
          f"median of {args.rounds} paired rounds; "
          f"zlib.crc32 {crc_gbs:.2f} GB/s on one core; load average {load:.1f} on "
          f"{os.cpu_count()} cores.", "",
          "| pass | GiB/s without checksums | GiB/s with | overhead (paired) |",
          "|---|---|---|---|"]
    md += [f"| {r['pass']} | {r['gib_s_without']:.2f} | {r['gib_s_with']:.2f} | "
           f"{100 * r['overhead']:+.1f} % |" for r in rows]
    write_results(args.out, rows, md, Comm(MPI.COMM_SELF), argv=sys.argv, args=vars(args),
                  crc32_gb_s=crc_gbs, load_average=load)
    print("\n".join(md))


if __name__ == "__main__":
    main()

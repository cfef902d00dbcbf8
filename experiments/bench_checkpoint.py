"""Checkpoint save and load throughput against the raw disk, and the training stall per save.

    mpiexec -n 2 python experiments/bench_checkpoint.py --out results/checkpoint_n2
    make bench-checkpoint NP=4

Builds a GPT of about 100 M parameters (default: 8 layers, d_model 1024, fp16 storage, ZeRO
stage 3) and, after two warm-up steps, measures for the whole job (barrier to barrier):
- save: `save_checkpoint` (every rank writes its shard, fsync, CRC-32, manifest, `latest`);
- raw write: each rank writes the same number of bytes to a plain file with os.write and
  fsync (what `dd conv=fsync` does), in the same directory, in the same run;
- load: `load_checkpoint` with every CRC-32 checked, from a cold page cache (the files are
  evicted with posix_fadvise DONTNEED first), and the raw cold read of the same bytes;
- the training stall of a save: the save call's time for a synchronous save; for an
  asynchronous one, the time of the call (the host snapshot) plus the extra time of the steps
  during which the writer runs, over the median step time.
Target: save and load within 2x of the raw write speed (the table also gives load against
the raw cold read). On a machine whose ranks have no spare core, the asynchronous writer
competes with training for the CPU, so its stall is close to a synchronous save's.
"""
import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from results import write_results
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

MB = 1e6


def timed(comm, fn):
    """(fn's result, whole-job seconds: from a barrier before to a barrier after)."""
    comm.barrier()
    start = time.perf_counter()
    result = fn()
    comm.barrier()
    return result, time.perf_counter() - start


def evict(paths) -> None:
    """Drop the files' pages from the page cache (they are clean: written and fsync'ed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def raw_write(path, nbytes, block=4 << 20) -> None:
    buf = os.urandom(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, nbytes, block):
            os.write(fd, buf[: min(block, nbytes - start)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path, block=4 << 20) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(block):
            pass


def bench(comm, args, directory: Path) -> dict:
    cfg = GPTConfig(args.vocab, args.seq_len, args.n_layer, args.n_head, args.d_model)
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "fp16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": args.stage}}
    engine = Engine(GPT(cfg, seed=0), config, comm)
    data = SyntheticSource(args.vocab, args.seq_len, args.micro_batch * comm.size, comm.rank,
                           comm.size)
    step = 0

    def train(n):
        nonlocal step
        times = []
        for _ in range(n):
            start = time.perf_counter()
            engine.train_step(*data.sample(step))
            times.append(time.perf_counter() - start)
            step += 1
        return times

    train(2)
    step_s = statistics.median(train(3))
    if comm.rank == 0:
        print(f"  {engine.num_params / 1e6:.1f} M params, {comm.size} ranks, median step "
              f"{step_s:.2f} s; saving", flush=True)

    path, save_s = timed(comm, lambda: engine.save_checkpoint(directory, tag="sync"))
    shard = path / f"rank{comm.rank:05d}-of-{comm.size:05d}.h5"
    nbytes = shard.stat().st_size
    raw = directory / f"raw{comm.rank}.bin"
    _, raw_write_s = timed(comm, lambda: raw_write(raw, nbytes))

    evict([raw])
    _, raw_read_s = timed(comm, lambda: raw_read(raw))
    evict([shard])
    _, load_s = timed(comm, lambda: engine.load_checkpoint(directory, tag="sync"))

    _, call_s = timed(comm, lambda: engine.save_checkpoint(directory, tag="async",
                                                           async_=True))
    during = []
    while engine.checkpoints.pending is not None and len(during) < 50:
        during += train(1)
    stall_s = call_s + sum(during) - step_s * len(during)
    engine.close()
    os.remove(raw)
    total = comm.allreduce_scalar(nbytes)
    mb = nbytes / MB
    return {
        "ranks": comm.size, "params": engine.num_params, "stage": args.stage,
        "MB_per_rank": mb, "MB_total": total / MB, "step_s": step_s,
        "save_s": save_s, "save_MBps_per_rank": mb / save_s,
        "raw_write_s": raw_write_s, "raw_write_MBps_per_rank": mb / raw_write_s,
        "save_vs_raw": save_s / raw_write_s,
        "load_s": load_s, "load_MBps_per_rank": mb / load_s,
        "raw_read_s": raw_read_s, "raw_read_MBps_per_rank": mb / raw_read_s,
        "load_vs_raw_read": load_s / raw_read_s, "load_vs_raw_write": load_s / raw_write_s,
        "sync_stall_s": save_s, "async_call_s": call_s, "async_steps": len(during),
        "async_stall_s": stall_s,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--stage", type=int, default=3, choices=range(4))
    parser.add_argument("--dir", default="runs/bench_checkpoint",
                        help="where the checkpoints go (removed at the end)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    comm = Comm()
    directory = Path(args.dir) / f"n{comm.size}"
    row = bench(comm, args, directory)
    comm.barrier()
    if comm.rank != 0:
        return
    shutil.rmtree(directory)
    r = row
    md = [f"GPT {r['params'] / 1e6:.1f} M params, ZeRO stage {r['stage']}, fp16 params + fp32 "
          f"master and Adam: {r['MB_total']:.0f} MB per checkpoint, {r['ranks']} ranks x "
          f"{r['MB_per_rank']:.0f} MB; whole-job seconds, MB/s per rank", "",
          "| | seconds | MB/s per rank | raw disk seconds | raw MB/s per rank | x raw write |"
          " x raw read |", "|---|---|---|---|---|---|---|",
          f"| save (fsync, CRC-32, manifest) | {r['save_s']:.2f} | {r['save_MBps_per_rank']:.0f}"
          f" | {r['raw_write_s']:.2f} (write) | {r['raw_write_MBps_per_rank']:.0f} | "
          f"{r['save_vs_raw']:.2f} | |",
          f"| load (cold cache, CRC-32 checked) | {r['load_s']:.2f} | "
          f"{r['load_MBps_per_rank']:.0f} | {r['raw_read_s']:.2f} (read) | "
          f"{r['raw_read_MBps_per_rank']:.0f} | {r['load_vs_raw_write']:.2f} | "
          f"{r['load_vs_raw_read']:.2f} |", "",
          f"Training stall per save (median step {r['step_s']:.2f} s): synchronous "
          f"{r['sync_stall_s']:.2f} s; asynchronous {r['async_stall_s']:.2f} s (call "
          f"{r['async_call_s']:.2f} s, writer done within {r['async_steps']} steps)."]
    print("\n".join(md))
    if args.out:
        out = write_results(args.out, [row], md, comm, argv=sys.argv, args=vars(args))
        print(f"wrote {out}/table.md, table.csv, run.json")


if __name__ == "__main__":
    main()

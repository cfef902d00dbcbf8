"""ZeRO-Infinity's NVMe tier: a model whose optimizer state is several times the host buffers
trains with CPU offload's bits; host memory; swap bandwidth against raw `dd` on the same disk.

    python experiments/bench_nvme.py --out results/nvme [--nvme-path DIR]

1. Training (each mode in a process of its own, so that each peak RSS is its own). A GPT of
   3.2 M parameters (fp16, ZeRO stage 2, one rank, 6 steps) trains with the optimizer state
   on the host (CPU offload) and on NVMe. The NVMe pool is 6 buffers of 2^18 fp32 elements
   (6 MiB), the host cap this run states; the master weights and Adam moments are 37.1 MiB. The
   table gives the ledger's peak host bytes of the optimizer state, the process's peak RSS,
   the step time, and whether the parameters, master weights, moments and losses equal CPU
   offload's bit for bit.
2. Streaming (this process). An NvmeOptimizerState of --stream-elements fp32 elements per
   state, with a pool of 6 x 2^20 elements (24 MiB). It times a write pass and a read pass of
   the three states and an Adam step (3 reads and 3 writes per element), each the best of 3,
   with DeepSpeed's default `aio` (one I/O thread: one request in flight, as dd) and with 4
   threads. The RSS growth from before the state exists to the end (VmHWM after
   /proc/self/clear_refs) is compared with the pool.
3. Raw disk. `dd` (bs=1M) writes and reads a file of the state's size in the same directory
   with oflag=direct / iflag=direct, best of 3 (conv=fdatasync and a dropped page cache where
   direct I/O is refused; the table says which).

The training runs use `"aio": {"block_size": 1 MiB, "queue_depth": 16, "thread_count": 4}`.

The swap file is opened O_DIRECT here (ext4), so no figure includes the page cache. A
virtual disk may still cache on its host.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from results import write_results

MIB = 2**20
POOL = {"buffer_count": 6, "buffer_size": 2**18}  # 6 x 1 MiB of fp32: the training run's cap
PARAM_POOL = {"buffer_count": 2, "buffer_size": 2**20, "max_in_cpu": 0}  # experiments/
# bench_nvme_param.py: 2 buffers, each the largest unit's shard
DEFAULT_AIO = {"block_size": 2**20, "queue_depth": 8, "thread_count": 1}  # DeepSpeed's
AIO = {"block_size": 2**20, "queue_depth": 16, "thread_count": 4}  # requests in parallel
REPEATS = 3  # each pass, and dd, timed this many times: the best counts (a shared machine)


def rss_kib() -> dict:
    """{"VmRSS", "VmHWM"} of this process in KiB (/proc/self/status)."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1))
            for k in ("VmRSS", "VmHWM")}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


# ---- 1. training, one mode per process ------------------------------------------------------
def train(mode: str, nvme_path: str, steps: int, n_layer: int, d_model: int) -> dict:
    from zmpi.comm import Comm
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    offload = {"device": "cpu"} if mode in ("cpu", "param_cpu", "param_nvme") else {
        "device": "nvme", "nvme_path": nvme_path, **POOL}
    stage, zero = 2, {"offload_optimizer": offload}
    if mode.startswith("param"):  # stage 3, its parameter shards on the host or on NVMe
        stage, zero["offload_param"] = 3, {"device": "cpu"} if mode == "param_cpu" else {
            "device": "nvme", "nvme_path": nvme_path, **PARAM_POOL}
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=n_layer, n_head=4, d_model=d_model)
    engine = Engine(GPT(cfg, seed=0), {
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "zero_optimization": {"stage": stage, **zero}, "aio": AIO}, Comm())
    data = SyntheticSource(256, 64, 4, seed=1)
    engine.memory.reset_peaks()
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        losses.append(engine.train_step(*data.sample(step)))
        times.append(time.perf_counter() - start)
    s = engine.strategy
    optimizer = ("master", "adam_m", "adam_v")
    out = {"mode": mode, "params": engine.num_params, "losses": losses,
           "step_ms": 1e3 * float(np.median(times[1:])),
           "state_bytes": 3 * s.master.nbytes,
           "host_optimizer_peak": engine.memory.peak(optimizer, "host"),
           "host_peak_total": engine.memory.peak(device="host"),
           "host_param_peak": engine.memory.peak("param", "host"),
           "peak_rss_kib": rss_kib()["VmHWM"],
           "optimizer_digest": digest(np.asarray(a) for a in (s.master, s.adam_m, s.adam_v))}
    if s.nvme is not None:
        out.update(direct=s.nvme.direct, io_wait_s=s.nvme.io_wait_s,
                   pool_bytes=sum(s.nvme.host_bytes().values()))
    if s.param_store is not None:
        out.update(direct=s.param_store.direct, io_wait_s=s.param_store.io_wait_s,
                   pool_bytes=s.param_store.host_bytes()["param"])
    params = engine.gather_parameters()
    out["params_digest"] = digest(params[k] for k in sorted(params))
    engine.close()
    return out


def train_in_child(mode, nvme_path, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, "--child", mode, "--child-out", f.name,
                        "--nvme-path", nvme_path, "--steps", str(args.steps), "--n-layer",
                        str(args.n_layer), "--d-model", str(args.d_model)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(Path(f.name).read_text())


# ---- 2. streaming -------------------------------------------------------------------------
def streaming(nvme_path: str, n: int, aio: dict) -> dict:
    from zmpi.config import AioConfig, OffloadConfig
    from zmpi.memory import MemoryLedger
    from zmpi.offload import NvmeOptimizerState
    from zmpi.optim.adam import HostAdam

    offload = OffloadConfig(device="nvme", nvme_path=nvme_path, buffer_count=6,
                            buffer_size=2**20)
    grads = np.random.default_rng(0).standard_normal(n).astype(np.float16)
    optimizer = HostAdam(lr=1e-3, threads=1)
    scratch = np.zeros(4096, np.float32)
    HostAdam(threads=1).step_(scratch, scratch.copy(), scratch.copy(), scratch.copy())  # Numba
    out = np.empty(offload.buffer_size, np.float32)  # where the read pass copies each block
    before, reset = rss_kib()["VmRSS"], reset_peak_rss()  # from here: the pool and the rest
    state = NvmeOptimizerState(n, np.float32, offload, AioConfig(**aio), MemoryLedger())

    def best(fn):
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def write_pass():
        for s in state.states:
            s[...] = 0.5

    def read_pass():  # each block copied out once
        for i in range(3):
            state.scan(i, lambda lo, block: np.copyto(out[:len(block)], block))

    write_s, read_s = best(write_pass), best(read_pass)
    state.io_wait_s = 0.0
    step_s = best(lambda: state.step(optimizer, grads, 1.0, 1.0))
    growth = rss_kib()["VmHWM"] - before
    found = {"aio": aio, "elements": n, "state_bytes": 3 * n * 4,
             "pool_bytes": sum(state.host_bytes().values()), "direct": state.direct,
             "write_s": write_s, "read_s": read_s, "step_s": step_s,
             "step_io_wait_s": state.io_wait_s / REPEATS,
             "rss_growth_kib": growth if reset else None}
    state.close()
    return found


# ---- 3. raw disk --------------------------------------------------------------------------
def dd(directory: str, nbytes: int) -> dict:
    """dd's write and read MiB/s for a file of `nbytes` in `directory` (direct I/O if the
    filesystem takes it, else fdatasync and a dropped page cache)."""
    path, count = os.path.join(directory, "dd.bin"), max(1, nbytes // MIB)

    def run(args, repeats=REPEATS):  # the fastest
        outs = [subprocess.run(["dd", *args, "bs=1M", f"count={count}"], capture_output=True,
                               text=True) for _ in range(repeats)]
        if any(o.returncode for o in outs):
            return 1, outs[0].stderr
        return 0, min(outs, key=lambda o: 1 / _dd_rate(o.stderr)).stderr

    rc, err = run(["if=/dev/zero", f"of={path}", "oflag=direct"])
    direct = rc == 0
    if not direct:
        rc, err = run(["if=/dev/zero", f"of={path}", "conv=fdatasync"])
    write = _dd_rate(err)
    if direct:
        rc, err = run([f"if={path}", "of=/dev/null", "iflag=direct"])
    else:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        rc, err = run([f"if={path}", "of=/dev/null"], repeats=1)  # then it is cached
    os.unlink(path)
    return {"direct": direct, "write_mib_s": write, "read_mib_s": _dd_rate(err),
            "flags": "oflag=direct / iflag=direct" if direct else "conv=fdatasync / fadvise"}


def _dd_rate(stderr: str) -> float:
    """MiB/s from dd's summary line ('N bytes ... copied, S s, ...')."""
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", stderr)
    if not m:
        raise RuntimeError(f"dd: unexpected output: {stderr}")
    return int(m.group(1)) / float(m.group(2)) / MIB


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/nvme")
    ap.add_argument("--nvme-path", default=None, help="a directory on the drive (default: a "
                    "new one under $TMPDIR, removed after)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--stream-elements", type=int, default=2**25)
    ap.add_argument("--child", choices=("cpu", "nvme", "param_cpu", "param_nvme"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(train(args.child, args.nvme_path,
                                                         args.steps, args.n_layer,
                                                         args.d_model)))
        return
    from zmpi.comm import Comm

    path = args.nvme_path or tempfile.mkdtemp(prefix="zmpi-bench-nvme-")
    runs = {mode: train_in_child(mode, path, args) for mode in ("cpu", "nvme")}
    cpu, nv = runs["cpu"], runs["nvme"]
    same = all(cpu[k] == nv[k] for k in ("losses", "params_digest", "optimizer_digest"))
    streams = [streaming(path, args.stream_elements, aio) for aio in (DEFAULT_AIO, AIO)]
    raw = dd(path, streams[0]["state_bytes"])
    if args.nvme_path is None:
        os.rmdir(path)
    rows = [{**runs[m], "bits_equal_cpu_offload": same} for m in ("cpu", "nvme")]
    rows += [{"mode": f"streaming, {st['aio']['thread_count']} I/O threads", **st,
              **{f"dd_{k}": v for k, v in raw.items()}} for st in streams]
    md = [f"GPT {cpu['params']:,} parameters ({args.n_layer} layers, d_model {args.d_model}), "
          f"fp16, ZeRO stage 2, 1 rank, {args.steps} steps; "
          f"optimizer state {cpu['state_bytes'] / MIB:.1f} MiB; NVMe pool "
          f"{nv['pool_bytes'] / MIB:.1f} MiB ({POOL['buffer_count']} x {POOL['buffer_size']:,} "
          f"fp32), the host cap; O_DIRECT: {nv['direct']}", "",
          "| optimizer on | host bytes of master+m+v, ledger peak (MiB) | process peak RSS (MiB) "
          "| median step ms | bits equal to CPU offload |", "|---|---|---|---|---|"]
    for r in rows[:2]:
        md.append(f"| {r['mode']} | {r['host_optimizer_peak'] / MIB:.2f} | "
                  f"{r['peak_rss_kib'] / 1024:.1f} | {r['step_ms']:.1f} | "
                  f"{'yes' if same else 'NO'} |")
    both = 2 / (1 / raw["read_mib_s"] + 1 / raw["write_mib_s"])  # read then write, as dd
    md += ["", f"Streaming: {args.stream_elements:,} fp32 elements per state "
           f"({streams[0]['state_bytes'] / MIB:.0f} MiB in the file), pool "
           f"{streams[0]['pool_bytes'] / MIB:.0f} MiB (6 x 2^20 fp32); dd bs=1M "
           f"({raw['flags']}): write {raw['write_mib_s']:.0f} MiB/s, read "
           f"{raw['read_mib_s']:.0f} MiB/s; best of {REPEATS} each", "",
           "| aio | RSS growth (MiB) | write MiB/s (of dd) | read MiB/s (of dd) | Adam step: "
           "read + write MiB/s (of dd's read then write) | step waiting for I/O |",
           "|---|---|---|---|---|---|"]
    for st in streams:
        a, growth = st["aio"], st["rss_growth_kib"]
        w, r = st["state_bytes"] / st["write_s"] / MIB, st["state_bytes"] / st["read_s"] / MIB
        step = 2 * st["state_bytes"] / st["step_s"] / MIB
        md.append(f"| {a['thread_count']} threads, queue_depth {a['queue_depth']}, block_size "
                  f"{a['block_size'] // MIB} MiB | "
                  + (f"{growth / 1024:.1f}" if growth is not None else "not measured")
                  + f" | {w:.0f} ({w / raw['write_mib_s']:.0%}) | {r:.0f} "
                  f"({r / raw['read_mib_s']:.0%}) | {step:.0f} ({step / both:.0%}) | "
                  f"{st['step_io_wait_s'] / st['step_s']:.0%} |")
    write_results(args.out, rows, md, Comm(), argv=sys.argv)
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Which kernels a zmpi training step runs on a GPU, by GPU time: torch.profiler's CUPTI trace
sees CuPy's kernels too (one process, one CUDA context).

    ZMPI_BACKEND=cupy mpiexec -n 1 python experiments/gpu_trace.py --out results/gpu_trace

GPT-2 small (T --seq-len, micro-batch --batch, fp16, ZeRO --stage; experiments/bench_gpu.py's
model and config; --n-layer, --d-model, --n-head for another size), --warmup steps, --steps
timed, then --steps profiled. Per step: the wall time, timed without the profiler and under it
(which inflates it), the GPU busy time (the sum of the kernels' and copies' durations) and the
GPU's idle time, wall - busy: what the host's launches and Python cost beyond the GPU's work,
so the most a CUDA graph of the step could save; the GPU operations, those that are dtype
casts (CuPy's cupy_copy__float16_float32 and the like) and both per transformer layer (the
step's over n_layer: the embedding, LM head, loss and update included); then the kernels by
total GPU time.
Writes trace.txt (that table) and trace.json (every kernel) under --out. Needs PyTorch with
CUDA beside CuPy.
"""
import argparse
import json
import sys
import time
from pathlib import Path


def is_cast(name: str) -> bool:
    """Whether a kernel is one of CuPy's dtype conversions: cupy_copy__<from>_<to>, two
    different dtypes (cupy_copy__float16_float16 is a plain copy)."""
    if not name.startswith("cupy_copy__"):
        return False
    kinds = name.removeprefix("cupy_copy__").split("_")
    return len(kinds) == 2 and kinds[0] != kinds[1]


def summarize(events, steps: int, n_layer: int, wall_s: float,
              unprofiled_s: float | None = None) -> dict:
    """events: (name, microseconds) of every GPU operation of `steps` steps -> per step: wall
    (profiled, and unprofiled_s's when given), busy and idle (unprofiled wall - busy) ms,
    operations and casts (and per layer), and each kernel's launches and ms, largest total
    first."""
    kernels = {}
    for name, us in events:
        n, total = kernels.get(name, (0, 0.0))
        kernels[name] = (n + 1, total + us)
    ops = sum(n for n, _ in kernels.values()) / steps
    casts = sum(n for name, (n, _) in kernels.items() if is_cast(name)) / steps
    busy = sum(t for _, t in kernels.values()) / steps / 1e3
    rows = [{"kernel": name, "launches_per_step": n / steps, "ms_per_step": t / steps / 1e3,
             "cast": is_cast(name)}
            for name, (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
    unprofiled = None if unprofiled_s is None else unprofiled_s * 1e3
    return {"wall_ms": wall_s * 1e3, "unprofiled_wall_ms": unprofiled, "busy_ms": busy,
            "idle_ms": None if unprofiled is None else max(0.0, unprofiled - busy),
            "ops_per_step": ops,
            "ops_per_layer": ops / n_layer, "casts_per_step": casts,
            "casts_per_layer": casts / n_layer, "kernels": rows}


def table(summary: dict, limit: int) -> str:
    s = summary
    idle = "" if s.get("idle_ms") is None else (
        f"unprofiled wall {s['unprofiled_wall_ms']:.1f} ms/step, GPU idle "
        f"{s['idle_ms']:.1f} ms/step ({s['idle_ms'] / s['unprofiled_wall_ms']:.0%}: the most a "
        "CUDA graph of the step could save); ")
    lines = [f"{idle}wall {s['wall_ms']:.1f} ms/step (profiled), GPU busy {s['busy_ms']:.1f} "
             "ms/step; "
             f"{s['ops_per_step']:.0f} GPU operations/step ({s['ops_per_layer']:.1f} a layer), "
             f"{s['casts_per_step']:.0f} casts ({s['casts_per_layer']:.1f} a layer)", "",
             "| kernel | launches/step | ms/step | share |", "|---|---|---|---|"]
    for row in s["kernels"][:limit]:
        lines.append(f"| {row['kernel'][:90]} | {row['launches_per_step']:g} | "
                     f"{row['ms_per_step']:.3f} | {row['ms_per_step'] / s['busy_ms']:.1%} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--stage", type=int, default=0)
    for flag in ("n_layer", "d_model", "n_head"):
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                            help=f"default: GPT-2 small's {flag}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25, help="kernels in the table")
    parser.add_argument("--out", default=None, help="directory for trace.txt and trace.json")
    args = parser.parse_args()

    import torch
    from bench_gpu import GPT2_SMALL, engine_config
    from torch.profiler import ProfilerActivity, profile

    from zmpi import backend
    from zmpi.comm import Comm
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    if not backend.is_gpu or not torch.cuda.is_available():
        sys.exit("gpu_trace: needs CuPy on a GPU (ZMPI_BACKEND=cupy) and PyTorch with CUDA")
    comm = Comm()
    sizes = {k: getattr(args, k) or v for k, v in GPT2_SMALL.items() if k != "vocab_size"}
    cfg = GPTConfig(seq_len=args.seq_len, vocab_size=GPT2_SMALL["vocab_size"], **sizes)
    engine = Engine(GPT(cfg, seed=0), engine_config(args.stage, "fp16", args.batch), comm)
    data = SyntheticSource(cfg.vocab_size, cfg.seq_len, args.batch, 0, 1, seed=1)
    for i in range(args.warmup):
        engine.train_step(*data.sample(i))
    backend.synchronize()
    start = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        engine.train_step(*data.sample(i))
    backend.synchronize()
    unprofiled = (time.perf_counter() - start) / args.steps
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(args.warmup + args.steps, args.warmup + 2 * args.steps):
            engine.train_step(*data.sample(i))
        backend.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    engine.close()
    events = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    if not events:  # the profiler saw no kernel: CUPTI is missing or not permitted here
        sys.exit("gpu_trace: the profiler recorded no GPU operation (is CUPTI available?)")
    summary = summarize(events, args.steps, cfg.n_layer, wall, unprofiled)
    text = table(summary, args.rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trace.txt").write_text(text + "\n")
        (out / "trace.json").write_text(json.dumps({"args": vars(args), **summary}, indent=1))


if __name__ == "__main__":
    main()

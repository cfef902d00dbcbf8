"""zmpi's GPU path, counted and timed: kernel launches, dtype casts and device syncs per step,
and on a GPU tokens/s and MFU beside PyTorch eager.

    python experiments/bench_gpu.py --count --out results/gpu_counts    # anywhere (stand-in)
    make bench-gpu                       # on a GPU: GPT-2 small, T 1024, stages 0-3, + counts

Counts (--count; any machine): the training steps run on the project's CuPy stand-in
(tests/standin, a strict CuPy double whose arithmetic runs on the host), which counts every
device operation a GPU runs as a kernel launch or copy of its own, those of them that are
dtype casts (CuPy's cupy_copy__float16_float32 and the like) apart, and every blocking
device -> host transfer (a sync). Per stage and precision (fp32, fp16, bf16): the launches of
one step of a GPT
with n layers and with n + 2 (the same seed and batch; the second step, after warm-up), so
that (difference) / 2 is what one transformer layer costs, forward, backward and its share of
the update, and the rest is what the embedding, the LM head, the loss and the optimizer cost
outside the layers. Both kernel modes: "fused" (the default) and "composed" (zmpi.kernels).
The counts depend on the program, not on the sizes, except through the attention's query
blocks (each block is launches of its own): the count cuts its queries into as many blocks
as GPT-2 small's at --batch sequences of --seq-len (at 8 x 1024: two, as the timed run), so
that the stand-in's count is the one a trace of the timed run would see, and the default
shape is small.

Timing (without --count; needs CuPy and a GPU): GPT-2 small (124 M parameters, 12 layers,
d 768, 12 heads, vocab 50257) at T 1024, micro-batch --batch per rank, on the ranks of the
launch: fp16 at ZeRO stages --stages (0-3), and bf16 at --bf16-stages (0: a short run beside
fp16's; left out, with a line saying why, on a CuPy without bfloat16); --warmup steps, then
the median of --steps, each ended by a device synchronize. tokens/s per rank; MFU = tokens/s
x (6 N + 12 L T d) / the GPU's peak (--peak-tflops, dense fp16 tensor-core FLOP/s of the
device, bf16's too: 989 for an H100 SXM).
With PyTorch (the bench extra) and CUDA, the same model in PyTorch eager
(experiments/bench_vs_torch.torch_gpt, fp16 autocast, AdamW) beside it on one rank.
"""
import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "standin"
SMALL = {"vocab_size": 256, "d_model": 64, "n_head": 4}  # the counting shape
GPT2_SMALL = {"vocab_size": 50257, "d_model": 768, "n_head": 12, "n_layer": 12}


def on_standin() -> bool:
    cupy = sys.modules.get("cupy")
    return bool(getattr(cupy, "STANDIN", False))


def engine_config(stage: int, precision: str, batch: int, kernels: str = "fused") -> dict:
    return {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "fp16": {"enabled": precision == "fp16"},
            "bf16": {"enabled": precision == "bf16"}, "kernels": kernels}


def step_counts(comm, stage, precision, n_layer, seq_len, kernels) -> tuple[int, int, int]:
    """(launches, casts, syncs) of the second training step of a GPT on the stand-in."""
    import cupy

    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(seq_len=seq_len, n_layer=n_layer, **SMALL)
    engine = Engine(GPT(cfg, seed=0), engine_config(stage, precision, 1, kernels), comm)
    data = SyntheticSource(cfg.vocab_size, seq_len, comm.size, comm.rank, comm.size, seed=1)
    engine.train_step(*data.sample(0))
    before = cupy.LAUNCHES[0], cupy.CASTS[0], cupy.SYNCS[0]
    engine.train_step(*data.sample(1))
    counts = tuple(c[0] - b for c, b in zip((cupy.LAUNCHES, cupy.CASTS, cupy.SYNCS), before,
                                            strict=True))
    engine.close()
    return counts


def match_attention_blocks(seq_len: int, batch: int) -> int:
    """Make the counting GPT (batch 1, SMALL's heads) cut its attention queries into the
    blocks GPT-2 small's would be cut into at `batch` sequences of seq_len on a GPU (the
    rows per block follow the scores' bytes: zmpi.nn.attention.attention_block). Returns the
    rows per block."""
    from zmpi.nn import attention as A

    rows = A.attention_block(seq_len, batch * GPT2_SMALL["n_head"], True)
    A.ATTENTION_BLOCK_BYTES = rows * 4 * SMALL["n_head"] * seq_len
    assert A.attention_block(seq_len, SMALL["n_head"], True) == rows
    return rows


def count(args, comm) -> list[dict]:
    """Launches and casts per layer and outside, and syncs per step, for every stage,
    precision and kernel mode (see the module docstring)."""
    block = match_attention_blocks(args.seq_len, args.batch)
    blocks = -(-args.seq_len // block)
    rows = []
    for kernels in ("fused", "composed"):
        for stage in (0, 1, 2, 3):
            for precision in ("fp32", "fp16", "bf16"):
                a = step_counts(comm, stage, precision, args.n_layer, args.seq_len, kernels)
                b = step_counts(comm, stage, precision, args.n_layer + 2, args.seq_len, kernels)
                launches, casts = (b[0] - a[0]) / 2, (b[1] - a[1]) / 2
                rows.append({"kernels": kernels, "stage": stage, "precision": precision,
                             "attention_blocks": blocks, "launches_per_layer": launches,
                             "launches_outside": a[0] - args.n_layer * launches,
                             "casts_per_layer": casts,
                             "casts_outside": a[1] - args.n_layer * casts,
                             "syncs_per_step": a[2], "syncs_per_step_more_layers": b[2]})
                if comm.rank == 0:
                    print(f"{kernels:8s} stage {stage} {precision}: {launches:g} launches "
                          f"({casts:g} casts) per layer, {rows[-1]['launches_outside']:g} "
                          f"({rows[-1]['casts_outside']:g}) outside, {a[2]} syncs per step",
                          file=sys.stderr, flush=True)
    return rows


def count_on_standin(args) -> list[dict]:
    """Run --count under the stand-in in a process of its own (this one may hold CuPy)."""
    env = {**os.environ, "PYTHONPATH": f"{STANDIN}{os.pathsep}{REPO}", "ZMPI_BACKEND": "cupy",
           "ZMPI_CUDA_AWARE": os.environ.get("ZMPI_CUDA_AWARE", "1")}
    out = subprocess.run([sys.executable, __file__, "--count", "--json", "--seq-len",
                          str(args.seq_len), "--n-layer", str(args.n_layer), "--batch",
                          str(args.batch)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def time_gpu(args, comm) -> list[dict]:
    """Step time, tokens/s and MFU of GPT-2 small on this GPU (zmpi) per precision and stage,
    fp16 at --stages and bf16 at --bf16-stages, and of PyTorch eager on rank 0 when it is
    installed with CUDA."""
    from zmpi import backend
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig, gpt_num_params

    cfg = GPTConfig(seq_len=args.seq_len, **GPT2_SMALL)  # the vocabulary padded to 128 (a GPU's)
    tokens = args.batch * args.seq_len
    # the model's FLOPs: its parameters, not the padding's
    flops = 6 * gpt_num_params(cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len) \
        + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model
    rows = []
    runs = [("fp16", stage) for stage in args.stages]
    if backend.cupy_bfloat16_refusal() is None:
        runs += [("bf16", stage) for stage in args.bf16_stages]
    elif args.bf16_stages:
        print(f"bench_gpu: no bf16 run: {backend.cupy_bfloat16_refusal()}", file=sys.stderr)
    for precision, stage in runs:
        model = GPT(cfg, seed=0)
        engine = Engine(model, engine_config(stage, precision, args.batch), comm)
        data = SyntheticSource(cfg.vocab_size, cfg.seq_len, args.batch * comm.size, comm.rank,
                               comm.size, seed=1)
        times = []
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                staged = sum(comm.staged_bytes.values())
            start = time.perf_counter()
            engine.train_step(*data.sample(i))
            backend.synchronize()
            times.append(time.perf_counter() - start)
        step = statistics.median(times[args.warmup:])
        rows.append({"stage": stage, "peer": "zmpi", "precision": precision, "step_s": step,
                     "tokens_per_s": tokens / step,
                     "mfu": tokens / step * flops / (args.peak_tflops * 1e12),
                     "staged_mb_per_step": (sum(comm.staged_bytes.values()) - staged)
                     / args.steps / 1e6})
        engine.close()
    torch_row = time_torch(args, cfg) if comm.rank == 0 else None
    if torch_row is not None:
        rows.append(torch_row)
    return rows


def time_torch(args, cfg) -> dict | None:
    """PyTorch eager on this GPU: the same GPT (its vocabulary unpadded), fp16 autocast with a
    gradient scaler, AdamW."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from bench_vs_torch import torch_gpt

    from zmpi import backend
    from zmpi.models.gpt import GPT

    unpadded = GPT(dataclasses.replace(cfg, vocab_multiple=1), seed=0)
    weights = {name: backend.to_host(p.data) for name, p in unpadded.named_parameters()}
    model = torch_gpt(cfg, weights).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda")
    rng = np.random.default_rng(1)
    times = []
    for _ in range(args.warmup + args.steps):
        x, y = (torch.as_tensor(rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len)),
                                device="cuda") for _ in range(2))
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[args.warmup:])
    n = sum(p.numel() for p in model.parameters())
    flops = 6 * n + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model
    tokens = args.batch * cfg.seq_len
    return {"stage": "-", "peer": "PyTorch eager", "precision": "fp16 (autocast)",
            "step_s": step, "tokens_per_s": tokens / step,
            "mfu": tokens / step * flops / (args.peak_tflops * 1e12)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", action="store_true",
                        help="count launches and syncs on the CuPy stand-in (any machine)")
    parser.add_argument("--no-count", action="store_true",
                        help="timing: leave out the counts (they are the same on every machine)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="T (default: 256 counting, 1024 timing)")
    parser.add_argument("--n-layer", type=int, default=2, help="counting: layers (and +2)")
    parser.add_argument("--batch", type=int, default=8,
                        help="timing: micro-batch per rank; counting: the attention blocks of "
                             "GPT-2 small at this micro-batch")
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3],
                        help="timing: the ZeRO stages timed in fp16")
    parser.add_argument("--bf16-stages", type=int, nargs="*", default=[0],
                        help="timing: the ZeRO stages timed in bf16 too (none: no bf16 run)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the GPU's dense fp16 peak, TFLOP/s (H100 SXM: 989)")
    parser.add_argument("--out", default=None, help="directory for the results")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (256 if args.count else 1024)
    if args.count and args.no_count:
        parser.error("--count and --no-count contradict each other")

    from zmpi import backend
    from zmpi.comm import Comm

    comm = Comm()
    if args.count and not on_standin():
        rows = count_on_standin(args)
    else:
        if args.count:
            rows = count(args, comm)
            if args.json:
                print(json.dumps(rows))
                return
        elif not backend.is_gpu or on_standin():
            sys.exit("bench_gpu: timing needs CuPy and a GPU (this process computes with "
                     f"{backend.name}); --count runs anywhere")
        else:
            rows = time_gpu(args, comm) + ([] if args.no_count else count_on_standin(args))
    if comm.rank == 0:
        print("\n".join(markdown(rows)))
    if args.out and comm.rank == 0:
        from results import write_results

        write_results(args.out, rows, markdown(rows), comm, name="gpu")


def _staged(row) -> str:
    return f"{row['staged_mb_per_step']:.0f}" if "staged_mb_per_step" in row else "-"


def markdown(rows) -> list[str]:
    """The timings (if any) and the counts as Markdown tables."""
    lines = []
    timed = [r for r in rows if "step_s" in r]
    if timed:
        lines += ["| peer | precision | stage | s/step | tokens/s per rank | MFU "
                  "| MB staged per step |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['peer']} | {r['precision']} | {r['stage']} | {r['step_s']:.3f} "
                  f"| {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {_staged(r)} |" for r in timed]
    counted = [r for r in rows if "launches_per_layer" in r]
    if not counted:
        return lines
    if timed:
        lines.append("")
    lines += [f"On the CuPy stand-in, attention in {counted[0]['attention_blocks']} query "
              "block(s) a layer:", "",
              "| kernels | stage | precision | launches per layer (casts) | launches outside "
              "(casts) | syncs per step |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['kernels']} | {r['stage']} | {r['precision']} | {r['launches_per_layer']:g} "
              f"({r['casts_per_layer']:g}) | {r['launches_outside']:g} ({r['casts_outside']:g}) "
              f"| {r['syncs_per_step']} |" for r in counted]
    return lines


if __name__ == "__main__":
    main()

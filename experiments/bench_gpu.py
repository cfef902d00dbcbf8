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
d 768, 12 heads, vocab 50257) at T 1024, at each micro-batch of --batch per rank, on the
ranks of the launch: fp16 at ZeRO stages --stages (0-3), and bf16 at --bf16-stages (0: a
short run beside fp16's; left out, with a line saying why, on a CuPy without bfloat16);
--warmup steps, then the median of --steps, each ended by a device synchronize. tokens/s per
rank; MFU = tokens/s x (6 N + 12 L T d) / the GPU's peak (--peak-tflops, dense fp16
tensor-core FLOP/s of the device, bf16's too: 989 for an H100 SXM or H200). Beside each zmpi
row, the step `zmpi plan` predicts for it on --hardware (auto: the preset of this GPU's model)
and the prediction's error. With PyTorch (the bench extra) and CUDA, the same model in PyTorch
(experiments/bench_vs_torch.torch_gpt, scaled_dot_product_attention, AdamW) on rank 0 at each
micro-batch, --peers: eager in fp16 autocast (the default; every row's "vs PyTorch eager" is
its tokens/s over this one's), compile (torch.compile in bf16 autocast). Rows print as they
are measured.
"""
import argparse
import dataclasses
import json
import os
import re
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
    block = match_attention_blocks(args.seq_len, args.batch[0])
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
                          str(args.batch[0])],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def time_gpu(args, comm, shape=GPT2_SMALL, measured=lambda rows: None) -> list[dict]:
    """Step time, tokens/s and MFU of a GPT of `shape` (GPT-2 small) on this GPU (zmpi) per
    micro-batch, precision and stage (fp16 at --stages, bf16 at --bf16-stages), with what
    `zmpi plan` predicts for it on --hardware; then PyTorch on rank 0 (--peers) when it is
    installed with CUDA (a peer that fails is a line on stderr, not the end of the run). Each
    row is printed as it is measured, and `measured` is given the rows so far (the results
    written as they come: a run stopped by a time limit keeps what it measured)."""
    from zmpi import backend
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(seq_len=args.seq_len, **shape)  # the vocabulary padded to 128 (a GPU's)
    hardware = plan_hardware(args.hardware)
    runs = [("fp16", stage) for stage in args.stages]
    if backend.cupy_bfloat16_refusal() is None:
        runs += [("bf16", stage) for stage in args.bf16_stages]
    elif args.bf16_stages:
        print(f"bench_gpu: no bf16 run: {backend.cupy_bfloat16_refusal()}", file=sys.stderr)
    rows = []
    for batch in args.batch:
        for precision, stage in runs:
            engine = Engine(GPT(cfg, seed=0), engine_config(stage, precision, batch), comm)
            data = SyntheticSource(cfg.vocab_size, cfg.seq_len, batch * comm.size, comm.rank,
                                   comm.size, seed=1)
            times = []
            for i in range(args.warmup + args.steps):
                if i == args.warmup:
                    staged = sum(comm.staged_bytes.values())
                start = time.perf_counter()
                engine.train_step(*data.sample(i))
                backend.synchronize()
                times.append(time.perf_counter() - start)
            row = timed_row("zmpi", precision, stage, batch,
                            statistics.median(times[args.warmup:]), cfg, args.peak_tflops)
            staged = sum(comm.staged_bytes.values()) - staged
            row["staged_mb_per_step"] = staged / args.steps / 1e6
            if hardware is not None:
                row["plan_hardware"] = hardware.name
                row["plan_step_s"] = plan_step(hardware, cfg, batch, stage, precision, comm.size)
            engine.close()
            rows.append(row)
            if comm.rank == 0:
                print(markdown([row])[-1], flush=True)
                measured(rows)
        for peer in args.peers if comm.rank == 0 else ():
            try:
                row = time_torch(args, cfg, batch, peer)
            except Exception as e:  # noqa: BLE001 (the peer's failure is reported, zmpi's kept)
                print(f"bench_gpu: PyTorch {peer} at micro-batch {batch} failed: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
                continue
            if row is not None:
                rows.append(row)
                print(markdown([row])[-1], flush=True)
                measured(rows)
    return rows


def timed_row(peer, precision, stage, batch, step, cfg, peak_tflops) -> dict:
    """A timing's row: s/step, tokens/s (per rank) and MFU, the FLOPs of the model's own
    parameters (not the vocabulary's padding): 6 N + 12 L T d per token."""
    from zmpi.models.gpt_counts import gpt_num_params

    flops = 6 * gpt_num_params(cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len) \
        + 12 * cfg.n_layer * cfg.seq_len * cfg.d_model
    tokens = batch * cfg.seq_len
    return {"peer": peer, "precision": precision, "stage": stage, "batch": batch,
            "step_s": step, "tokens_per_s": tokens / step,
            "mfu": tokens / step * flops / (peak_tflops * 1e12)}


def plan_hardware(name: str):
    """The zmpi.plan Hardware to predict the step on: the preset `name`, or with "auto" the
    preset of this GPU's model (H100, H200, A100, V100; None for another)."""
    from zmpi.plan.measure import load_hardware

    if name == "none":
        return None
    if name == "auto":
        import cupy

        device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        device = device.decode() if isinstance(device, bytes) else device
        # the presets are SXM boards: not a GH200, nor an H100 PCIe or NVL
        match = re.search(r"\b(h200|h100|a100|v100)\b", device.lower())
        if match is None or re.search(r"pcie|nvl", device.lower()):
            print(f"bench_gpu: no plan preset for {device!r}: no prediction (--hardware)",
                  file=sys.stderr)
            return None
        name = match.group(1)
    return load_hardware(name)


def plan_step(hardware, cfg, batch: int, stage: int, precision: str, ranks: int) -> float:
    """The step time `zmpi plan` predicts for this run: one node of `ranks` GPUs, data
    parallel at ZeRO `stage`, no offload or recompute, `batch` sequences per rank, the
    vocabulary padded as the model pads it."""
    from zmpi import backend
    from zmpi.models.gpt import default_vocab_multiple
    from zmpi.plan.layout import Job, Layout
    from zmpi.plan.time import step_time

    vocab_multiple = cfg.vocab_multiple or default_vocab_multiple(backend.is_gpu)
    job = Job(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size, cfg.seq_len, batch * ranks,
              1, ranks, precision, vocab_multiple=vocab_multiple)
    layout = Layout(ranks, 1, 1, stage, "none", "none", False, batch, 1, "gpipe")
    return step_time(job, layout, hardware).total


TORCH_PEERS = {"eager": ("PyTorch eager", "fp16 (autocast)"),
               "compile": ("PyTorch torch.compile", "bf16 (autocast)")}


def time_torch(args, cfg, batch: int, peer: str) -> dict | None:
    """PyTorch on this GPU, the same GPT (its vocabulary unpadded; scaled_dot_product_attention)
    with AdamW: "eager" in fp16 autocast with a gradient scaler, "compile" under torch.compile
    in bf16 autocast (the issue's stretch peer). None without PyTorch or CUDA."""
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
    dtype = torch.float16 if peer == "eager" else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    if peer == "compile":  # a fresh compile at this batch's static shapes (no dynamic graph
        torch._dynamo.reset()  # left from another micro-batch's compile in this process)
    forward = torch.compile(model, dynamic=False) if peer == "compile" else model
    rng = np.random.default_rng(1)
    times = []
    for _ in range(args.warmup + args.steps):
        x, y = (torch.as_tensor(rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len)),
                                device="cuda") for _ in range(2))
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype):
            loss = forward(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    name, precision = TORCH_PEERS[peer]
    return timed_row(name, precision, "-", batch, statistics.median(times[args.warmup:]), cfg,
                     args.peak_tflops)


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
    parser.add_argument("--batch", type=int, nargs="+", default=[8],
                        help="timing: the micro-batches per rank, each timed; counting (one): "
                             "the attention blocks of GPT-2 small at this micro-batch")
    parser.add_argument("--stages", type=int, nargs="*", default=[0, 1, 2, 3],
                        help="timing: the ZeRO stages timed in fp16")
    parser.add_argument("--bf16-stages", type=int, nargs="*", default=[0],
                        help="timing: the ZeRO stages timed in bf16 too (none: no bf16 run)")
    parser.add_argument("--peers", nargs="*", choices=sorted(TORCH_PEERS), default=["eager"],
                        help="timing: the PyTorch peers (eager: fp16 autocast; compile: "
                             "torch.compile in bf16), each at every micro-batch")
    parser.add_argument("--hardware", default="auto",
                        help="timing: the zmpi plan preset whose prediction is printed beside "
                             "each zmpi row (auto: this GPU's, h100 or h200...; none)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the GPU's dense fp16 peak, TFLOP/s (H100 SXM: 989)")
    parser.add_argument("--out", default=None, help="directory for the results")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (256 if args.count else 1024)
    if args.count and args.no_count:
        parser.error("--count and --no-count contradict each other")
    if args.count and len(args.batch) > 1:
        parser.error("--count takes one --batch (the attention blocks it matches)")
    if not args.count and not (args.stages or args.bf16_stages or args.peers):
        parser.error("nothing to time: give --stages, --bf16-stages or --peers")

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
            rows = time_gpu(args, comm, measured=lambda rows: save(args, rows, comm))
            rows += [] if args.no_count else count_on_standin(args)
    if comm.rank == 0 and not rows:  # (only rank 0 times the PyTorch peers)
        sys.exit("bench_gpu: nothing was measured (no PyTorch with CUDA for --peers?)")
    if comm.rank == 0:
        print("\n".join(markdown(rows)))
        save(args, rows, comm)


def save(args, rows, comm) -> None:
    """The rows so far into --out (rank 0)."""
    if args.out and comm.rank == 0:
        from results import write_results

        write_results(args.out, rows, markdown(rows), comm, name="gpu")


def _staged(row) -> str:
    return f"{row['staged_mb_per_step']:.0f}" if "staged_mb_per_step" in row else "-"


def _vs_eager(row, timed) -> str:
    """tokens/s over PyTorch eager's at the same micro-batch, when it ran."""
    eager = [r for r in timed if r["peer"] == TORCH_PEERS["eager"][0]
             and r["batch"] == row["batch"]]
    return f"{row['tokens_per_s'] / eager[0]['tokens_per_s']:.2f}x" if eager else "-"


def plan_error(row) -> float:
    """How far zmpi plan's step is from the measured one: (plan - measured) / measured."""
    return row["plan_step_s"] / row["step_s"] - 1


def _planned(row) -> str:
    """The plan's predicted s/step and its error."""
    if "plan_step_s" not in row:
        return "-"
    return f"{row['plan_step_s']:.3f} ({row['plan_hardware']}, {plan_error(row):+.0%})"


def markdown(rows) -> list[str]:
    """The timings (if any) and the counts as Markdown tables."""
    lines = []
    timed = [r for r in rows if "step_s" in r]
    if timed:
        lines += ["| peer | precision | stage | micro-batch | s/step | tokens/s per rank "
                  "| vs PyTorch eager | MFU | MB staged per step | zmpi plan s/step |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['peer']} | {r['precision']} | {r['stage']} | {r['batch']} "
                  f"| {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {_vs_eager(r, timed)} "
                  f"| {r['mfu']:.1%} | {_staged(r)} | {_planned(r)} |" for r in timed]
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

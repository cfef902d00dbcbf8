"""Fused flash attention (zmpi.kernels.flash_attention) against the blocked path and PyTorch's
SDPA, on a GPU: what docs/gpu.md's "Fused flash attention (unmeasured)" asks a GPU session to
measure.

    python experiments/bench_flash_attention.py --out results/flash       # on a GPU
    python experiments/bench_flash_attention.py --tiny                    # anywhere: a dry run

Rows (the median of --steps after --warmup, each ended by a device synchronize):
- the attention core, forward + backward, fp16, B 8, 12 heads, hd 64, T 1024 (GPT-2 small's
  layer): zmpi's blocked path (zmpi.nn.attention), flash, and, with PyTorch and CUDA,
  torch.nn.functional.scaled_dot_product_attention(is_causal=True) on the same shapes;
- block-sparse: DeepSpeed's fixed layout (block 16, 4 local blocks, 1 global,
  unidirectional) at T 1024 and 4096: zmpi.nn.sparse_attention against flash;
- a GPT-2 small training step (stage 0, fp16, micro-batch 8, T 1024) with "attention_kernel"
  "blocked" and "flash".
On a GPU it says which flash kernels the fp16 rows ran: on tensor cores (compute capability
8.0 and later) or SIMT.
--tiny runs every row at toy sizes on whatever array module zmpi has (the CuPy stand-in, or
NumPy for the core rows without flash): the script's own check, no figure.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from zmpi import backend
from zmpi.kernels import flash_attention as FA
from zmpi.nn import attention as A
from zmpi.nn import sparse_attention as S
from zmpi.nn.sparsity import causal_layout, sparsity_from_dict

FIXED = {"mode": "fixed", "block": 16, "num_local_blocks": 4, "num_global_blocks": 1,
         "attention": "unidirectional"}


def timed(run, warmup: int, steps: int) -> float:
    """Median seconds of run() over `steps` calls after `warmup`, each synchronised."""
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        run()
        backend.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def core_rows(args) -> list[dict]:
    xp, rng = backend.xp, np.random.default_rng(0)
    B, nh, hd = args.batch, args.heads, args.head_size
    rows = []
    cases = [("dense", args.seq_len, None)] + [
        ("fixed", T, causal_layout(sparsity_from_dict(FIXED, nh).make_layout(T)))
        for T in args.sparse_seq_lens]
    for name, T, layout in cases:
        qkv = xp.asarray((rng.standard_normal((B, T, 3 * nh * hd)) * 0.5).astype(np.float16))
        dy = xp.asarray(rng.standard_normal((B, T, nh * hd)).astype(np.float16))
        paths = core_paths(qkv, dy, nh, layout)
        if not backend.is_device_array(qkv):
            del paths["flash"]  # NumPy (--tiny): flash runs on CuPy arrays only
        for path, run in paths.items():
            rows.append({"case": f"attention core {name}", "T": T, "path": path,
                         "seconds": timed(run, args.warmup, args.steps)})
        if layout is None and (sdpa := torch_sdpa(B, nh, T, hd)) is not None:
            rows.append({"case": f"attention core {name}", "T": T, "path": "torch SDPA",
                         "seconds": timed(sdpa, args.warmup, args.steps)})
    return rows


def core_paths(qkv, dy, nh, layout) -> dict:
    """{path: forward + backward of the attention core}: blocked (dense, or sparse over
    layout at FIXED's block) and flash."""
    sparse = () if layout is None else (layout, FIXED["block"])

    def blocked():
        if layout is None:
            return A.attention_backward(dy, A.attention_forward(qkv, nh)[1])
        return S.sparse_attention_backward(dy, S.sparse_attention_forward(qkv, nh, *sparse)[1])

    def flash():
        return FA.flash_attention_backward(dy, FA.flash_attention_forward(qkv, nh, *sparse)[1])
    return {"blocked": blocked, "flash": flash}


def torch_sdpa(B, nh, T, hd):
    """forward + backward of PyTorch's causal SDPA on fp16 CUDA tensors, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    q, k, v = (torch.randn(B, nh, T, hd, device="cuda", dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    dy = torch.randn(B, nh, T, hd, device="cuda", dtype=torch.float16)

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy)
        torch.cuda.synchronize()
    return run


def train_steps(engine, data):
    """A function that runs the engine's next training step on the next batch."""
    steps = iter(range(10 ** 9))
    return lambda: engine.train_step(*data.sample(next(steps)))


def gpt_rows(args) -> list[dict]:
    from zmpi.comm import Comm
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    comm, rows = Comm(), []
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.layers,
                    n_head=args.heads, d_model=args.heads * args.head_size)
    for kernel in ("blocked", "flash"):
        engine = Engine(GPT(cfg, seed=0), {
            "train_micro_batch_size_per_gpu": args.batch, "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "attention_kernel": kernel}, comm)
        data = SyntheticSource(cfg.vocab_size, cfg.seq_len, args.batch, 0, 1, seed=1)
        rows.append({"case": "GPT step", "T": args.seq_len, "path": kernel,
                     "seconds": timed(train_steps(engine, data), args.warmup, args.steps)})
        engine.close()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a dry run, no figures")
    parser.add_argument("--warmup", type=int, default=None, help="default 3 (1 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="default 10 (1 with --tiny)")
    parser.add_argument("--out", default=None, help="directory for results.json")
    args = parser.parse_args()
    big = dict(batch=8, heads=12, head_size=64, seq_len=1024, sparse_seq_lens=(1024, 4096),
               layers=12, vocab=50257)
    tiny = dict(batch=2, heads=2, head_size=8, seq_len=40, sparse_seq_lens=(64,), layers=1,
                vocab=32)
    vars(args).update(tiny if args.tiny else big)
    for name, given in (("warmup", 3), ("steps", 10)):
        if getattr(args, name) is None:
            setattr(args, name, 1 if args.tiny else given)
    if not args.tiny and (not backend.is_gpu or getattr(backend.xp, "STANDIN", False)):
        sys.exit("bench_flash_attention: needs CuPy and a GPU (--tiny runs anywhere)")
    rows = core_rows(args) + (gpt_rows(args) if backend.is_gpu else [])
    for r in rows:
        print(f"{r['case']:24s} T {r['T']:5d}  {r['path']:10s} {r['seconds'] * 1e3:9.3f} ms")
    kinds = {}  # which flash kernels the fp16 rows ran, on a GPU
    if backend.is_gpu and not getattr(backend.xp, "STANDIN", False):
        kinds = {f"block {b}": "tensor cores" if FA.tensor_cores(np.float16, args.head_size, b)
                 else "SIMT" for b in (FA.FLASH_BLOCK, FIXED["block"])}
        print(f"flash kernels (fp16, hd {args.head_size}): {kinds}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        device = backend.device_name() if backend.is_gpu else backend.name
        (Path(args.out) / "results.json").write_text(json.dumps(
            {"device": device, "date": time.strftime("%Y-%m-%d"), "flash_kernels": kinds,
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

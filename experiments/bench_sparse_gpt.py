"""Block-sparse attention in a training GPT: the longest sequence one step fits into a device
budget, the step time against T, and the loss after the same steps, dense against each
DeepSpeed layout (docs/sparse-attention.md).

    python experiments/bench_sparse_gpt.py --out results/sparse_gpt   # make bench-sparse

Longest sequence: for each layout, without and with full recompute, the largest T (a multiple
of the block: doubling, then bisection, bench_recompute.largest) for which a narrow GPT trains
one step of one sequence within --budget-mib of device memory (`memory_budget.device`: every
buffer the ledger counts, model states and activations), one rank, ZeRO stage 0.

Step time: the same GPT at each --seq-lens T, one sequence per step, every layout's steps
interleaved round by round (so that machine noise falls on all alike); the median of --steps
after a warm-up; per layout the crossover, the least T from which it is faster than dense at
every longer T measured.

Loss: each layout trains the same GPT on Tiny Shakespeare (the same seed, batches and
learning rate) for --loss-steps steps at --loss-seq-len; the last --loss-window steps' mean
training loss and the validation loss on the same held-out batches.

The layouts (LAYOUTS) are DeepSpeed's modes at DeepSpeed's defaults (block 16,
"unidirectional"), and `fixed` with a 64-block (1,024-token) window too. One rank, one
thread: the timings compare the layouts on this machine, not hardware; the memory is exact.
"""
import argparse
import functools
import statistics
import sys
import time

import numpy as np
from bench_recompute import largest, one_step_fits
from interleaved import shakespeare

from results import write_results
from zmpi.comm import Comm
from zmpi.data import BatchSampler, SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

MIB = 2**20
MIN_BLOCKS = 4
UNI = {"attention": "unidirectional"}
LAYOUTS = {  # name: the sparse_attention section (None: dense attention)
    "dense": None,
    "fixed": {"mode": "fixed", **UNI},
    "fixed, 64 local blocks": {"mode": "fixed", "num_local_blocks": 64, **UNI},
    "variable": {"mode": "variable", **UNI},
    "bigbird": {"mode": "bigbird", "num_random_blocks": 1, **UNI},  # the class's default
    "bslongformer": {"mode": "bslongformer", **UNI},
    "local": {"mode": "local"},
}


def engine_for(args, sparse, seq_len, micro_batch, d_model, extra=None, vocab=None):
    config = {"train_micro_batch_size_per_gpu": micro_batch,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
              "zero_optimization": {"stage": 0}, **(extra or {})}
    if sparse is not None:
        config["sparse_attention"] = sparse
    cfg = GPTConfig(vocab or args.vocab, seq_len, args.n_layer, args.n_head, d_model)
    return Engine(GPT(cfg, seed=0, sparse_attention=sparse), config, Comm())


# ---- the longest sequence under a budget ------------------------------------------------------
def fits(args, sparse, recompute, seq_len) -> bool:
    """Whether one step at seq_len fits the budget; True below MIN_BLOCKS blocks, where some
    layouts cannot be made (bigbird's window of 3 blocks): the search's start, far below
    what any layout reaches."""
    if seq_len < MIN_BLOCKS * args.block:
        return True
    extra = {"memory_budget": {"device": int(args.budget_mib * MIB)},
             "activation_checkpointing": {"recompute": recompute}}
    return one_step_fits(lambda: engine_for(args, sparse, seq_len, 1, args.search_d_model, extra),
                         SyntheticSource(args.vocab, seq_len, 1, 0, 1).sample(0))


def longest(args) -> list[dict]:
    rows = []
    for recompute in ("none", "full"):
        dense = None
        for name, sparse in LAYOUTS.items():
            start = time.perf_counter()
            seq, probes = largest(functools.partial(fits, args, sparse, recompute),
                                  args.block, args.max_seq_len)
            dense = seq if dense is None else dense
            rows.append({"layout": name, "recompute": recompute, "longest_seq_len": seq,
                         "at_ceiling": seq >= args.max_seq_len // args.block * args.block,
                         "vs_dense": seq / dense if dense else None, "probes": probes,
                         "seconds": time.perf_counter() - start})
            print(f"longest T, {name}, recompute {recompute}: {seq} "
                  f"({rows[-1]['vs_dense']:.2f}x dense, {probes} probes, "
                  f"{rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


# ---- step time against T -----------------------------------------------------------------------
def step_times(args) -> list[dict]:
    rows = []
    for seq_len in args.seq_lens:
        engines = {name: engine_for(args, sparse, seq_len, 1, args.d_model)
                   for name, sparse in LAYOUTS.items()}
        data = SyntheticSource(args.vocab, seq_len, 1, 0, 1)
        times = {name: [] for name in engines}
        for step in range(args.warmup + args.steps):
            for name, engine in engines.items():
                t0 = time.perf_counter()
                engine.train_step(*data.sample(step))
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        for engine in engines.values():
            engine.close()
        dense_ms = 1e3 * statistics.median(times["dense"])
        for name, t in times.items():
            ms = 1e3 * statistics.median(t)
            rows.append({"seq_len": seq_len, "layout": name, "step_ms": ms,
                         "speedup": dense_ms / ms})
        print(f"T {seq_len}: " + ", ".join(f"{r['layout']} {r['step_ms']:.0f} ms"
                                           for r in rows[-len(engines):]), flush=True)
    return rows


def crossover(rows, name) -> int | None:
    """The least T from which `name` is faster than dense at every longer T measured."""
    faster = [(r["seq_len"], r["speedup"] > 1) for r in rows if r["layout"] == name]
    for i, (seq_len, _) in enumerate(faster):
        if all(ok for _, ok in faster[i:]):
            return seq_len
    return None


# ---- the loss after the same steps -------------------------------------------------------------
def losses(args) -> list[dict]:
    tok, train, val = shakespeare()
    rows = []
    for name, sparse in LAYOUTS.items():
        engine = engine_for(args, sparse, args.loss_seq_len, args.loss_batch, args.d_model,
                            vocab=tok.vocab_size)
        batches = BatchSampler(train, args.loss_seq_len, args.loss_batch, 0, 1, seed=0)
        held_out = BatchSampler(val, args.loss_seq_len, args.loss_batch, 0, 1, seed=1)
        t0 = time.perf_counter()
        curve = [engine.train_step(*batches.sample(s)) for s in range(args.loss_steps)]
        val_loss = float(np.mean([engine.eval_loss(*held_out.sample(s)) for s in range(4)]))
        engine.close()
        rows.append({"layout": name, "train_loss": float(np.mean(curve[-args.loss_window:])),
                     "val_loss": val_loss, "first_loss": curve[0],
                     "seconds": time.perf_counter() - t0})
        print(f"loss, {name}: train {rows[-1]['train_loss']:.4f}, val {val_loss:.4f} "
              f"({rows[-1]['seconds']:.0f} s)", flush=True)
    return rows


def tables(args, longest_rows, time_rows, loss_rows) -> list[str]:
    md = [f"Longest sequence T (a multiple of block {args.block}) for which a GPT of "
          f"{args.n_layer} layers, d_model {args.search_d_model}, {args.n_head} heads, "
          f"vocabulary {args.vocab} trains one step of one sequence (fp32, AdamW, one rank) "
          f"within {args.budget_mib:g} MiB of device memory (the ledger's count). '+': the "
          f"search's ceiling, {args.max_seq_len:,}.", "",
          "| layout | longest T | vs dense | longest T, full recompute | vs dense |",
          "|---|---|---|---|---|"]
    by = {(r["layout"], r["recompute"]): r for r in longest_rows}
    for name in LAYOUTS:
        cells = []
        for recompute in ("none", "full"):
            r = by[(name, recompute)]
            cells += [f"{r['longest_seq_len']:,}{'+' if r['at_ceiling'] else ''}",
                      f"{r['vs_dense']:.1f}x" if r["vs_dense"] else "-"]
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    seq_lens = sorted({r["seq_len"] for r in time_rows})
    md += ["", f"Step time (ms, median of {args.steps}) against T: d_model {args.d_model}, "
           "one sequence per step; in brackets the speed-up over dense; crossover: the least T "
           "from which the layout is faster at every longer T measured.", "",
           "| layout | " + " | ".join(f"T {t:,}" for t in seq_lens) + " | crossover |",
           "|---|" + "---|" * (len(seq_lens) + 1)]
    cell = {(r["layout"], r["seq_len"]): r for r in time_rows}
    for name in LAYOUTS:
        row = [f"{cell[(name, t)]['step_ms']:.0f}" + (
            "" if name == "dense" else f" ({cell[(name, t)]['speedup']:.2f}x)")
            for t in seq_lens]
        cross = "-" if name == "dense" else (crossover(time_rows, name) or "none")
        md.append(f"| {name} | " + " | ".join(row) + f" | {cross} |")
    md += ["", f"Loss on Tiny Shakespeare after {args.loss_steps} steps (T {args.loss_seq_len}, "
           f"batch {args.loss_batch}, d_model {args.d_model}, lr {args.lr}, the same seed and "
           f"batches): mean training loss of the last {args.loss_window} steps, validation "
           "loss on 4 held-out batches.", "",
           "| layout | training loss | validation loss |", "|---|---|---|"]
    md += [f"| {r['layout']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} |" for r in loss_rows]
    return md


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128, help="of the time and loss runs")
    parser.add_argument("--search-d-model", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64, help="of the search and time runs")
    parser.add_argument("--block", type=int, default=16, help="DeepSpeed's default block")
    parser.add_argument("--budget-mib", type=float, default=256.0)
    parser.add_argument("--max-seq-len", type=int, default=65536)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--loss-seq-len", type=int, default=256)
    parser.add_argument("--loss-batch", type=int, default=8)
    parser.add_argument("--loss-steps", type=int, default=150)
    parser.add_argument("--loss-window", type=int, default=20)
    parser.add_argument("--out", default="results/sparse_gpt")
    args = parser.parse_args()
    comm = Comm()
    if comm.size != 1:
        sys.exit("bench_sparse_gpt.py runs on one rank")
    if args.block != 16:
        for sparse in LAYOUTS.values():
            if sparse is not None:
                sparse["block"] = args.block
    longest_rows, time_rows, loss_rows = longest(args), step_times(args), losses(args)
    md = tables(args, longest_rows, time_rows, loss_rows)
    write_results(args.out, longest_rows, md, comm, argv=sys.argv, args=vars(args),
                  layouts=LAYOUTS, step_times=time_rows, losses=loss_rows)
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Block-sparse attention's step time against dense attention's, and where it starts to win.

    python experiments/bench_sparse_attention.py --out results/sparse_attention

One thread, the attention core alone (no projections): forward + backward of
zmpi.nn.attention (dense causal, query blocks of ATTENTION_BLOCK rows) and of
zmpi.nn.sparse_attention on the same qkv (B, T, 3C) for each --seq-lens T and each layout of
--layouts: the least of --repeats rounds that run dense and each layout in turn (after a
warm-up each). Layouts (causal, --block):
  window  a sliding window of --local-blocks blocks (the query's own and the ones before it)
          plus the first --global-blocks blocks as global keys: O(T) kept blocks;
  fixed   DeepSpeed's "fixed" (zmpi.nn.sparsity's FixedSparsityConfig, num_local_blocks
          --local-blocks, num_global_blocks --global-blocks, unidirectional): each query sees
          its chunk and the global block of every earlier chunk, O(T^2 / local blocks).
Reports per T and layout the kept blocks (over heads) and their share of the causal ones, the
dense and sparse times and the speed-up, and per layout the crossover: the least T from which
sparse is faster at every longer T measured. Timings on a shared machine compare the two
paths, not hardware.
"""
import argparse
import math
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from results import write_results  # noqa: E402
from zmpi.comm import Comm  # noqa: E402
from zmpi.nn import attention as A  # noqa: E402
from zmpi.nn.sparse_attention import (  # noqa: E402
    sparse_attention_backward,
    sparse_attention_forward,
)
from zmpi.nn.sparsity import FixedSparsityConfig, causal_layout, kept_blocks  # noqa: E402


def window_layout(n_head, nb, local, global_):
    """(n_head, nb, nb): block row i keeps blocks i - local + 1 .. i and 0 .. global_ - 1."""
    rows, cols = np.arange(nb)[:, None], np.arange(nb)[None, :]
    keep = ((cols <= rows) & (cols > rows - local)) | (cols < global_)
    return np.broadcast_to(np.tril(keep), (n_head, nb, nb))


def fixed_layout(n_head, nb, local, global_, block):
    """DeepSpeed's unidirectional "fixed" layout, as causal attention runs it."""
    config = FixedSparsityConfig(num_heads=n_head, block=block, num_local_blocks=local,
                                 num_global_blocks=global_, attention="unidirectional")
    return causal_layout(config.make_layout(nb * block))


LAYOUTS = {  # name -> (args, nb) -> layout
    "window": lambda a, nb: window_layout(a.n_head, nb, a.local_blocks, a.global_blocks),
    "fixed": lambda a, nb: fixed_layout(a.n_head, nb, a.local_blocks, a.global_blocks, a.block),
}


def fastest_steps(steps: dict, repeats: int) -> dict:
    """{name: the least seconds of one call of steps[name]}, over `repeats` rounds that call
    each once in turn (after a warm-up call each), so that a shared machine's noise falls on
    all alike; the least is the figure that does not move with the neighbours
    (zmpi.plan.measure.fastest_seconds)."""
    for step in steps.values():
        step()
    best = dict.fromkeys(steps, math.inf)
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def attention_step(forward, backward, qkv, dy):
    """One forward + backward of an attention core."""
    def step():
        y, cache = forward(qkv)
        backward(dy, cache)
    return step


def crossover(rows):
    """The least T from which sparse beats dense at every longer T measured (rows in T's
    order), or None."""
    first = None
    for r in reversed(rows):
        if r["speedup"] <= 1:
            break
        first = r["T"]
    return first


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--local-blocks", type=int, default=4)
    parser.add_argument("--global-blocks", type=int, default=1)
    parser.add_argument("--seq-lens", default="256,512,1024,2048,4096")
    parser.add_argument("--layouts", default="window,fixed")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the least is kept")
    parser.add_argument("--out", default=None, help="results folder (table.md, table.csv, "
                                                     "run.json)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    names = args.layouts.split(",")
    if not set(names) <= LAYOUTS.keys():
        parser.error(f"--layouts: {', '.join(sorted(set(names) - LAYOUTS.keys()))} unknown "
                     f"(known: {', '.join(LAYOUTS)})")
    rows = []
    for T in (int(t) for t in args.seq_lens.split(",")):
        qkv = rng.standard_normal((args.batch, T, 3 * args.d_model)).astype(args.dtype)
        dy = rng.standard_normal((args.batch, T, args.d_model)).astype(args.dtype)
        nb = T // args.block
        layouts = {name: LAYOUTS[name](args, nb) for name in names}
        steps = {"dense": attention_step(lambda x: A.attention_forward(x, args.n_head),
                                         A.attention_backward, qkv, dy)}
        for name, layout in layouts.items():
            steps[name] = attention_step(
                lambda x, layout=layout: sparse_attention_forward(x, args.n_head, layout,
                                                                  args.block),
                sparse_attention_backward, qkv, dy)
        seconds = fastest_steps(steps, args.repeats)
        causal_blocks = args.n_head * nb * (nb + 1) // 2
        for name, layout in layouts.items():
            kept = kept_blocks(causal_layout(layout))
            rows.append({"T": T, "layout": name, "kept_blocks": kept,
                         "kept_share": kept / causal_blocks, "dense_ms": seconds["dense"] * 1e3,
                         "sparse_ms": seconds[name] * 1e3,
                         "speedup": seconds["dense"] / seconds[name]})
            r = rows[-1]
            print(f"T {T:>5}  {name:<6}  kept {r['kept_share']:6.1%} of the causal blocks  "
                  f"dense {r['dense_ms']:8.1f} ms  sparse {r['sparse_ms']:8.1f} ms  "
                  f"({r['speedup']:.2f}x)", flush=True)
    crossovers = {name: crossover([r for r in rows if r["layout"] == name]) for name in names}
    md = [f"Attention core forward + backward on one thread, {args.dtype}, d_model "
          f"{args.d_model}, {args.n_head} heads, B {args.batch}, block {args.block} (the least "
          f"of {args.repeats} rounds); crossover T (sparse faster from there on): "
          + ", ".join(f"{k} {v}" for k, v in crossovers.items()), "",
          "| T | layout | kept blocks | of causal | dense ms | sparse ms | speed-up |",
          "|---" * 7 + "|"]
    md += [f"| {r['T']} | {r['layout']} | {r['kept_blocks']} | {r['kept_share']:.1%} | "
           f"{r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | {r['speedup']:.2f}x |" for r in rows]
    print(md[0])
    if args.out:
        write_results(args.out, rows, md, Comm(), argv=sys.argv, crossover=crossovers)
        print(f"wrote {args.out}/table.md, table.csv, run.json")


if __name__ == "__main__":
    main()

"""Block-sparse attention's step time against dense attention's, and where it starts to win.

    python experiments/bench_sparse_attention.py --out results/sparse_attention

One thread, the attention core alone (no projections): forward + backward of
zmpi.nn.attention (dense causal, query blocks of ATTENTION_BLOCK rows) and of
zmpi.nn.sparse_attention on the same qkv (B, T, 3C) for each --seq-lens T and each layout of
--layouts, the median of --repeats calls after a warm-up. Layouts (causal, --block):
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
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from results import write_results  # noqa: E402
from zmpi.comm import Comm  # noqa: E402
from zmpi.nn import attention as A  # noqa: E402
from zmpi.nn.sparse_attention import (  # noqa: E402
    sparse_attention_backward,
    sparse_attention_forward,
)
from zmpi.plan.measure import call_seconds  # noqa: E402


def window_layout(n_head, nb, local, global_):
    """(n_head, nb, nb): block row i keeps blocks i - local + 1 .. i and 0 .. global_ - 1."""
    rows = np.arange(nb)[:, None]
    cols = np.arange(nb)[None, :]
    keep = ((cols <= rows) & (cols > rows - local)) | (cols < global_)
    return np.broadcast_to(np.tril(keep), (n_head, nb, nb))


def fixed_layout(n_head, nb, local, global_, block):
    from zmpi.nn.sparsity import FixedSparsityConfig, causal_layout
    config = FixedSparsityConfig(num_heads=n_head, block=block, num_local_blocks=local,
                                 num_global_blocks=global_, attention="unidirectional")
    return causal_layout(config.make_layout(nb * block))


def layout_maker(name, args):
    """nb -> layout, or None when this zmpi cannot make `name` (reported, skipped)."""
    if name == "window":
        return lambda nb: window_layout(args.n_head, nb, args.local_blocks, args.global_blocks)
    if name == "fixed":
        try:
            import zmpi.nn.sparsity  # noqa: F401
        except ImportError:
            return None
        return lambda nb: fixed_layout(args.n_head, nb, args.local_blocks, args.global_blocks,
                                       args.block)
    raise SystemExit(f"--layouts: unknown layout {name!r} (window, fixed)")


def step_seconds(forward, backward, qkv, dy, repeats):
    """Median seconds of one forward + backward."""
    def step():
        y, cache = forward(qkv)
        backward(dy, cache)
    return statistics.median(call_seconds(step, repeats))


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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="results folder (table.md, table.csv, "
                                                     "run.json)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    makers = {}
    for name in args.layouts.split(","):
        maker = layout_maker(name, args)
        if maker is None:
            print(f"layout {name}: not available in this zmpi (no zmpi.nn.sparsity), skipped")
        else:
            makers[name] = maker
    rows = []
    for T in (int(t) for t in args.seq_lens.split(",")):
        qkv = rng.standard_normal((args.batch, T, 3 * args.d_model)).astype(args.dtype)
        dy = rng.standard_normal((args.batch, T, args.d_model)).astype(args.dtype)
        dense_s = step_seconds(lambda x: A.attention_forward(x, args.n_head),
                               A.attention_backward, qkv, dy, args.repeats)
        nb = T // args.block
        causal_blocks = args.n_head * nb * (nb + 1) // 2
        for name, make in makers.items():
            layout = make(nb)
            sparse_s = step_seconds(
                lambda x, layout=layout: sparse_attention_forward(x, args.n_head, layout,
                                                                  args.block),
                sparse_attention_backward, qkv, dy, args.repeats)
            kept = int(np.tril(layout).sum())
            rows.append({"T": T, "layout": name, "kept_blocks": kept,
                         "kept_share": kept / causal_blocks, "dense_ms": dense_s * 1e3,
                         "sparse_ms": sparse_s * 1e3, "speedup": dense_s / sparse_s})
            r = rows[-1]
            print(f"T {T:>5}  {name:<6}  kept {r['kept_share']:6.1%} of the causal blocks  "
                  f"dense {r['dense_ms']:8.1f} ms  sparse {r['sparse_ms']:8.1f} ms  "
                  f"({r['speedup']:.2f}x)", flush=True)
    crossovers = {name: crossover([r for r in rows if r["layout"] == name]) for name in makers}
    md = [f"Attention core forward + backward on one thread, {args.dtype}, d_model "
          f"{args.d_model}, {args.n_head} heads, B {args.batch}, block {args.block} (median of "
          f"{args.repeats}); crossover T (sparse faster from there on): "
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

"""Host float16 kernels: zmpi.kernels.host's compiled loops against NumPy and PyTorch on the CPU.

    make bench-host-kernels  # python experiments/bench_host_kernels.py --out results/host_kernels

One thread, on arrays of --sizes M elements: the float16 -> float32 cast, the float32 ->
float16 cast and the in-place float16 add (`dst += src`, what ZeRO-2/3 do with each
micro-step's gradient shard), each by the compiled loops (the `fast` extra, Numba; skipped if
missing), by NumPy (ZMPI_NUMBA=0's path) and by torch on the CPU (the `bench` extra; skipped
if missing). Before timing, the compiled result is checked bit for bit against NumPy's.
Prints ns per element and the speed-up over NumPy; timings are the median of --repeats calls
after one warm-up call.
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from results import write_results  # noqa: E402
from zmpi.comm import Comm  # noqa: E402
from zmpi.kernels import host as host_kernels  # noqa: E402
from zmpi.plan.measure import call_seconds  # noqa: E402


def median_seconds(call, repeats: int) -> float:
    """The median of `repeats` timed calls (after a warm-up): a benchmark's typical figure."""
    return statistics.median(call_seconds(call, repeats))


def operations(n):
    """{name: (compiled, numpy, torch-or-None)}: three calls that do the same on the same data."""
    rng = np.random.default_rng(0)
    wide = rng.standard_normal(n, dtype=np.float32)
    half, other = wide.astype(np.float16), (-wide[::-1]).astype(np.float16)
    half_out, wide_out, acc = np.empty(n, np.float16), np.empty(n, np.float32), half.copy()
    ops = {
        "float16 -> float32": (lambda: host_kernels.cast_(wide_out, half),
                               lambda: np.copyto(wide_out, half)),
        "float32 -> float16": (lambda: host_kernels.cast_(half_out, wide),
                               lambda: np.copyto(half_out, wide)),
        "float16 += float16": (lambda: host_kernels.add_(acc, other),
                               lambda: np.add(acc, other, out=acc)),
    }
    try:
        import torch
    except ImportError:
        return {k: (*v, None) for k, v in ops.items()}
    torch.set_num_threads(1)
    t_half, t_wide, t_other = (torch.from_numpy(a) for a in (half, wide, other))
    t_half_out, t_wide_out = torch.empty(n, dtype=torch.float16), torch.empty(n)
    peers = [lambda: t_wide_out.copy_(t_half), lambda: t_half_out.copy_(t_wide),
             lambda: t_half.add_(t_other)]  # t_half shares `half`'s memory: add last
    return {k: (*v, peer) for (k, v), peer in zip(ops.items(), peers, strict=True)}


def check_bits(n=1 << 16):
    """The compiled loops give NumPy's bits on random finite data (tests/test_host_kernels.py
    checks every pattern)."""
    rng = np.random.default_rng(1)
    wide = (rng.standard_normal(n) * 1e3).astype(np.float32)
    half = wide.astype(np.float16)
    assert np.array_equal(host_kernels.astype(half, np.float32), half.astype(np.float32))
    assert np.array_equal(host_kernels.astype(wide, np.float16).view(np.uint16),
                          wide.astype(np.float16).view(np.uint16))
    acc = half.copy()
    host_kernels.add_(acc, half[::-1].copy())
    assert np.array_equal(acc.view(np.uint16), (half + half[::-1]).view(np.uint16))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,16", help="array sizes in M elements")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None, help="results folder (table.md, table.csv)")
    args = parser.parse_args()
    if host_kernels.adam is None:
        sys.exit("the compiled loops are not there (numba missing, or ZMPI_NUMBA=0)")
    check_bits()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        n = size << 20
        for name, (compiled, numpy_call, torch_call) in operations(n).items():
            with host_kernels.disabled():
                numpy_s = median_seconds(numpy_call, args.repeats)
            compiled_s = median_seconds(compiled, args.repeats)
            torch_s = median_seconds(torch_call, args.repeats) if torch_call else float("nan")
            rows.append({"M_elements": size, "operation": name,
                         "compiled_ns": compiled_s / n * 1e9, "numpy_ns": numpy_s / n * 1e9,
                         "torch_ns": torch_s / n * 1e9, "speedup_vs_numpy": numpy_s / compiled_s,
                         "vs_torch": torch_s / compiled_s})
            r = rows[-1]
            print(f"{size:>3} M  {name:<20} compiled {r['compiled_ns']:5.2f}  NumPy "
                  f"{r['numpy_ns']:5.2f}  torch {r['torch_ns']:5.2f} ns/element  "
                  f"({r['speedup_vs_numpy']:.1f}x NumPy, {r['vs_torch']:.2f}x torch)", flush=True)
    md = [f"Host float16 kernels on one thread, ns per element (median of {args.repeats}); "
          "the compiled loops give NumPy's bits", "",
          "| M elements | operation | compiled | NumPy | torch CPU | vs NumPy | vs torch |",
          "|---" * 7 + "|"]
    md += [f"| {r['M_elements']} | {r['operation']} | {r['compiled_ns']:.2f} | "
           f"{r['numpy_ns']:.2f} | {r['torch_ns']:.2f} | {r['speedup_vs_numpy']:.1f}x | "
           f"{r['vs_torch']:.2f}x |" for r in rows]
    if args.out:
        write_results(args.out, rows, md, Comm(), argv=sys.argv)
        print(f"wrote {args.out}/table.md, table.csv, run.json")


if __name__ == "__main__":
    main()

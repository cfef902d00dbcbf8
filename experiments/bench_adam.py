"""Host Adam speed: zmpi's HostAdam against a naive NumPy Adam and PyTorch's CPU AdamW.

    make bench-adam          # python experiments/bench_adam.py --out results/bench_adam

On the same arrays, one thread each (the setting an offloading rank gets per core), for
shards of 1 M to 64 M fp32 elements: zmpi's `HostAdam` (fp32 gradients, and fp16 gradients
as ZeRO-Offload hands them over), once as one compiled loop (zmpi.kernels.host, Numba: the
`fast` extra, skipped if missing) and once as NumPy ufuncs (ZMPI_NUMBA=0), a textbook NumPy
Adam whose every line allocates shard-sized temporaries, and torch.optim.AdamW with
`foreach=True` and `fused=True` (torch from the `bench` extra; skipped if missing). Prints
elements/s, the ratio to torch fused and the fraction of the memory-bandwidth limit: Adam
reads p, g, m, v and writes p, m, v, 28 bytes per fp32 element (26 with fp16 gradients),
against the copy bandwidth measured at start-up.
Before timing, zmpi's result is checked against the textbook one. Timings are the best of
--repeats steps after one warm-up step.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from results import write_results  # noqa: E402
from zmpi.comm import Comm  # noqa: E402
from zmpi.kernels import host as host_kernels  # noqa: E402
from zmpi.optim.adam import HostAdam  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def best_time(step, repeats):
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(n) -> float:
    """Bytes/s of a large array copy (read + write), the bandwidth Adam is bound by."""
    a, b = np.ones(n, np.float32), np.empty(n, np.float32)
    return 2 * a.nbytes / best_time(lambda: np.copyto(b, a), 5)


def naive_adam(p, g, m, v, t, lr, betas, eps, weight_decay):
    """AdamW as the formulas read: every line makes shard-sized temporaries."""
    m[...] = betas[0] * m + (1 - betas[0]) * g
    v[...] = betas[1] * v + (1 - betas[1]) * g * g
    m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
    p[...] = p * (1 - lr * weight_decay) - lr * m_hat / (np.sqrt(v_hat) + eps)


def bench_numpy(n, repeats, grad_dtype):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(n, dtype=np.float32)
    grads = rng.standard_normal(n, dtype=np.float32).astype(grad_dtype)
    results = {}
    opt = HostAdam(**HYPER, threads=1)
    state = [p.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)]
    if host_kernels.adam is not None:
        results["zmpi HostAdam (Numba)"] = best_time(
            lambda: opt.step_(state[0], grads, *state[1:]), repeats)
    with host_kernels.disabled():
        results["zmpi HostAdam (NumPy ufuncs)"] = best_time(
            lambda: opt.step_(state[0], grads, *state[1:]), repeats)
    if grad_dtype == np.float32:
        naive = [p.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32), [0]]

        def naive_step():
            naive[3][0] += 1
            naive_adam(naive[0], grads, naive[1], naive[2], naive[3][0], **HYPER)

        results["naive NumPy"] = best_time(naive_step, repeats)
        # The two implement the same update: same result to fp32 rounding.
        check = HostAdam(**HYPER, threads=1)
        a = [p[:4096].copy(), np.zeros(4096, np.float32), np.zeros(4096, np.float32)]
        b = [p[:4096].copy(), np.zeros(4096, np.float32), np.zeros(4096, np.float32)]
        for t in range(1, 4):
            check.step_(a[0], grads[:4096], a[1], a[2])
            naive_adam(b[0], grads[:4096], b[1], b[2], t, **HYPER)
        assert np.allclose(a[0], b[0], rtol=0, atol=1e-6), "HostAdam != textbook Adam"
    return results


def bench_torch(n, repeats):
    try:
        import torch
    except ImportError:
        return {}
    torch.set_num_threads(1)
    results = {}
    for kind in ("foreach", "fused"):
        p = torch.randn(n, generator=torch.Generator().manual_seed(0))
        p.grad = torch.randn(n)
        opt = torch.optim.AdamW([p], **HYPER, **{kind: True})
        results[f"torch AdamW {kind}"] = best_time(opt.step, repeats)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="shard sizes in M elements")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="results folder (table.md, table.csv)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(64 << 20)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; one thread; best of {args.repeats}")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        n = size << 20
        timings = {}
        timings.update(bench_numpy(n, args.repeats, np.float32))
        timings.update({k + ", fp16 grads": t
                        for k, t in bench_numpy(n, args.repeats, np.float16).items()})
        timings.update(bench_torch(n, args.repeats))
        fused = timings.get("torch AdamW fused")
        for name, seconds in timings.items():
            bytes_per = 26 if "fp16" in name else 28
            rows.append({"M_elements": size, "implementation": name,
                         "G_elements_per_s": n / seconds / 1e9,
                         "vs_torch_fused": fused / seconds if fused else float("nan"),
                         "bandwidth_fraction": n * bytes_per / seconds / bandwidth})
            r = rows[-1]
            print(f"{size:>3} M  {name:<40} {r['G_elements_per_s']:6.3f} G elem/s  "
                  f"{r['vs_torch_fused']:5.2f}x torch fused  "
                  f"{r['bandwidth_fraction']:5.1%} of bandwidth", flush=True)
    md = [f"Adam step on one thread, fp32 state; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(28 bytes moved per element, 26 with fp16 gradients)", "",
          "| shard (M elements) | implementation | G elements/s | vs torch fused | "
          "of bandwidth limit |", "|---" * 5 + "|"]
    md += [f"| {r['M_elements']} | {r['implementation']} | {r['G_elements_per_s']:.3f} | "
           f"{r['vs_torch_fused']:.2f} | {r['bandwidth_fraction']:.0%} |" for r in rows]
    if args.out:
        write_results(args.out, rows, md, Comm(), argv=sys.argv, copy_bandwidth=bandwidth)
        print(f"wrote {args.out}/table.md, table.csv, run.json")


if __name__ == "__main__":
    main()

"""Stage 3's parameter shards on NVMe: the same GPT as bench_nvme.py trains at ZeRO stage 3
with `offload_param` on the host and on NVMe (the optimizer on the host in both), each in a
process of its own; the table gives the ledger's peak host bytes of "param", the process's
peak RSS, the median step and whether the parameters, optimizer state and losses are equal.

    python experiments/bench_nvme_param.py --out results/nvme_param [--nvme-path DIR]

The NVMe pool is bench_nvme.PARAM_POOL: 2 buffers, each the largest unit's shard rounded up
to 4 KiB (`max_in_cpu` 0, so every unit is on the drive).
"""
import argparse
import os
import sys
import tempfile

from bench_nvme import AIO, MIB, PARAM_POOL, train_in_child

from results import write_results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/nvme_param")
    ap.add_argument("--nvme-path", default=None, help="a directory on the drive (default: a "
                    "new one under $TMPDIR, removed after)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()
    from zmpi.comm import Comm

    path = args.nvme_path or tempfile.mkdtemp(prefix="zmpi-bench-nvme-param-")
    runs = {mode: train_in_child(mode, path, args) for mode in ("param_cpu", "param_nvme")}
    if args.nvme_path is None:
        os.rmdir(path)
    cpu, nv = runs["param_cpu"], runs["param_nvme"]
    same = all(cpu[k] == nv[k] for k in ("losses", "params_digest", "optimizer_digest"))
    rows = [{**runs[m], "bits_equal_cpu_offload": same} for m in runs]
    md = [f"GPT {cpu['params']:,} parameters ({args.n_layer} layers, d_model {args.d_model}), "
          f"fp16, ZeRO stage 3, optimizer on the host, 1 rank, {args.steps} steps; NVMe pool "
          f"{nv['pool_bytes'] / MIB:.2f} MiB ({PARAM_POOL['buffer_count']} buffers of the "
          f"largest unit's shard); O_DIRECT: {nv['direct']}; aio {AIO}", "",
          "| parameters on | host bytes of param, ledger peak (MiB) | process peak RSS (MiB) "
          "| median step ms | step waiting for I/O (s, all steps) | bits equal to CPU offload |",
          "|---|---|---|---|---|---|"]
    for name, r in (("host (offload_param cpu)", cpu), ("nvme", nv)):
        md.append(f"| {name} | {r['host_param_peak'] / MIB:.2f} | "
                  f"{r['peak_rss_kib'] / 1024:.1f} | {r['step_ms']:.1f} | "
                  f"{r.get('io_wait_s', 0):.3f} | {'yes' if same else 'NO'} |")
    write_results(args.out, rows, md, Comm(), argv=sys.argv)
    print("\n".join(md))


if __name__ == "__main__":
    main()

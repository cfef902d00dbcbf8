"""ZeRO-Offload on the demo GPT: step time and memory with and without offload, and DPU.

    mpiexec -n 2 python experiments/bench_offload.py --out results/offload    # make bench-offload

Trains the demo GPT (`zmpi train`'s defaults: 4 layers, d_model 128, Tiny Shakespeare, global
batch 32 x 64 tokens, fp16 storage, ZeRO stage 2) three times from the same seed and batches:
without offload, with the optimizer offloaded to the host, and with offload plus the one-step
delayed update (DPU, warm-up --warmup steps). Reports per mode the median step time, tokens/s,
host Adam time per step, for DPU the share of the host Adam time hidden behind forward and
backward (1 - time the training thread waited for the update / time the update took), the
ledger's device and host model-state bytes per rank, and the loss; plots the loss curves
(loss.png) so DPU's effect on convergence is visible. On a CPU-only machine "device" and host
share the same cores: the host Adam can only hide behind compute when a core is free.
"""
import argparse
import statistics
import sys
import time

import numpy as np

from results import write_losses, write_results
from zmpi.comm import Comm
from zmpi.data import BatchSampler, CharTokenizer, load_text, train_val_split
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

MIB = 2**20
MODES = {  # name: zero_optimization entries on top of stage 2
    "no offload": {},
    "offload": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "offload + DPU": {"offload_optimizer": {"device": "cpu", "pin_memory": True,
                                            "delay_update": True}},
}


TIMING_SKIP = 10  # first steps, compiling and first-touching buffers: not timed


def train(comm, mode, args, tokens, vocab_size):
    zero = {"stage": args.stage, **MODES[mode]}
    if "delay_update" in zero.get("offload_optimizer", {}):
        zero["offload_optimizer"]["delay_update_warmup"] = args.warmup
    micro = args.batch // comm.size
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "fp16": {"enabled": True}, "zero_optimization": zero, "seed": 0}
    model_cfg = GPTConfig(vocab_size, args.seq_len, args.n_layer, 4, args.d_model)
    engine = Engine(GPT(model_cfg, seed=0), config, comm)
    data = BatchSampler(tokens, args.seq_len, args.batch, comm.rank, comm.size, seed=0)
    losses, times = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        losses.append(engine.train_step(*data.sample(step)))
        times.append(time.perf_counter() - start)
        if comm.rank == 0 and step % 50 == 0:
            print(f"  {mode}: step {step} loss {losses[-1]:.3f}", flush=True)
    engine.close()
    timing = engine.update_timing
    delayed = timing["delayed_steps"]
    step_s = statistics.median(times[TIMING_SKIP:])
    return {
        "mode": mode, "params": engine.num_params, "ranks": comm.size,
        "median_step_ms": 1e3 * step_s,
        "tokens_per_s": args.batch * args.seq_len / step_s,
        "adam_ms_per_step": 1e3 * timing["optimizer_s"] / args.steps,
        "hidden_fraction": (1 - timing["waited_s"] / timing["optimizer_s"]) if delayed else
        float("nan"),
        "device_MiB": engine.memory.model_state_bytes("device") / MIB,
        "host_MiB": engine.memory.model_state_bytes("host") / MIB,
        "final_loss": losses[-1], "mean_last_50": float(np.mean(losses[-50:])),
        "losses": losses,
    }


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(r["losses"], label=r["mode"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"demo GPT, {rows[0]['ranks']} ranks, ZeRO-2 fp16: offload and DPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300,
                        help="at least 11: the first 10 are warm-up, left out of the timing")
    parser.add_argument("--warmup", type=int, default=40, help="DPU warm-up steps (paper: 40)")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.steps <= TIMING_SKIP:
        parser.error(f"--steps must be more than {TIMING_SKIP} (the warm-up steps the median "
                     f"step time leaves out), got {args.steps}")
    comm = Comm()
    text = load_text()
    tokenizer = CharTokenizer(text)
    tokens, _ = train_val_split(tokenizer.encode(text), 0.1)
    rows = [train(comm, mode, args, tokens, tokenizer.vocab_size) for mode in MODES]
    if comm.rank != 0:
        return
    md = [f"demo GPT ({rows[0]['params']:,} params), {comm.size} ranks, ZeRO stage "
          f"{args.stage}, fp16, {args.steps} steps, DPU warm-up {args.warmup}; per rank", "",
          "| mode | median step ms | tokens/s | host Adam ms/step | Adam hidden | device "
          "MiB | host MiB | loss (mean of last 50) |", "|---" * 8 + "|"]
    for r in rows:
        hidden = "-" if np.isnan(r["hidden_fraction"]) else f"{r['hidden_fraction']:.0%}"
        md.append(f"| {r['mode']} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['adam_ms_per_step']:.2f} | {hidden} | {r['device_MiB']:.3f} | "
                  f"{r['host_MiB']:.3f} | {r['mean_last_50']:.3f} |")
    print("\n".join(md))
    if args.out:
        out = write_results(args.out, rows, md, comm, argv=sys.argv, args=vars(args))
        write_losses(out, rows, "mode")
        plot(rows, out / "loss.png")
        print(f"wrote {out}/table.md, table.csv, losses.csv, loss.png, run.json")


if __name__ == "__main__":
    main()

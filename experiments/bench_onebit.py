"""1-bit Adam against Adam on a small GPT: the loss after 300 steps, and the bytes each step
sends before and after the warm-up.

    mpiexec -n 4 python experiments/bench_onebit.py --out results/onebit    # make bench-onebit

Trains one GPT (Tiny Shakespeare, fp16 storage, ZeRO stage 0, the same seed, batches and
learning-rate warm-up) three times: with zmpi's Adam (AdamW), with OneBitAdam and a
freeze_step past the last step (its warm-up rule only: Adam without bias correction,
DeepSpeed's), and with OneBitAdam and --freeze-step (1-bit Adam). Reports per run the
training loss (mean of the last 50 steps), the validation loss at the end, and the bytes this
rank sent per step in the warm-up and after it (Comm's counters), next to an fp16 and an fp32
allreduce of the model (2 (N - 1) / N x Psi x 2 or 4 bytes) and to the formula of the
compressed allreduce (zmpi.comm.compressed); plots the loss curves (loss.png). The loss gaps
(training and validation) are judged against Tang et al.'s claim that 1-bit Adam converges
like Adam: here, within --tolerance of Adam's loss. All runs use betas (0.9, --beta2): 1-bit
Adam freezes v at freeze_step, which the paper places where v has become stable, several
1 / (1 - beta2) steps in; with DeepSpeed's uncorrected v, beta2 0.999 and freeze_step 100
freeze a v about 10x too small (1 - 0.999^100 = 0.095).
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
from zmpi.memory import ring_bytes
from zmpi.models.gpt import GPT, GPTConfig


def runs(args):
    """(name, optimizer section) of each run."""
    betas = [0.9, args.beta2]
    onebit = {"type": "OneBitAdam", "params": {"lr": args.lr, "weight_decay": args.wd,
                                               "betas": betas, "freeze_step": args.freeze_step}}
    uncompressed = {"type": "OneBitAdam", "params": {**onebit["params"],
                                                     "freeze_step": args.steps + 1}}
    return [("Adam", {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": args.wd,
                                                  "betas": betas}}),
            ("OneBitAdam (warm-up rule only)", uncompressed),
            (f"OneBitAdam (freeze_step {args.freeze_step})", onebit)]


def train(comm, name, optimizer, args, train_tokens, val_tokens, vocab_size):
    config = {"train_micro_batch_size_per_gpu": args.batch // comm.size,
              "optimizer": optimizer, "fp16": {"enabled": True},
              "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_min_lr": 0, "warmup_max_lr": args.lr,
                  "warmup_num_steps": args.lr_warmup}},
              "zero_optimization": {"stage": 0}, "seed": 0}
    model = GPTConfig(vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    engine = Engine(GPT(model, seed=0), config, comm)
    data = BatchSampler(train_tokens, args.seq_len, args.batch, comm.rank, comm.size, seed=0)
    losses, sent, declared, times, warm, applied = [], [], [], [], [], []
    for step in range(args.steps):
        warm.append(engine.optimizer.reduces_gradients)
        declared.append(engine.expected_traffic()["world"] if optimizer["type"] == "OneBitAdam"
                        else engine.strategy.expected_traffic()["world"])
        before, skipped = engine.sent_bytes()["world"], engine.scaler.skipped_steps
        start = time.perf_counter()
        losses.append(engine.train_step(*data.sample(step)))
        times.append(time.perf_counter() - start)
        sent.append(engine.sent_bytes()["world"] - before)
        applied.append(engine.scaler.skipped_steps == skipped)  # a skipped step after the
        # warm-up sends nothing: the overflow check comes before the compressed allreduce
        if comm.rank == 0 and step % 50 == 0:
            print(f"  {name}: step {step} loss {losses[-1]:.3f} sent {sent[-1]:,} B",
                  flush=True)
    val = BatchSampler(val_tokens, args.seq_len, args.batch, comm.rank, comm.size, seed=1)
    val_loss = float(np.mean([engine.eval_loss(*val.sample(i)) for i in range(args.val_batches)]))
    psi = engine.num_params
    before_freeze = [s for s, w in zip(sent, warm, strict=True) if w]
    after = [s for s, w in zip(sent, warm, strict=True) if not w]
    declared_after = [d for d, w in zip(declared, warm, strict=True) if not w]
    row = {"run": name, "params": psi, "full_numel": engine.layout.full_numel,
           "ranks": comm.size, "steps": args.steps,
           "warm_steps": sum(warm), "mean_last_50": float(np.mean(losses[-50:])),
           "val_loss": val_loss, "skipped_steps": engine.scaler.skipped_steps,
           "bytes_warm": statistics.median(before_freeze or [0]),
           "bytes_after": statistics.median(after) if after else float("nan"),
           "declared_after": statistics.median(declared_after) if after else float("nan"),
           "sent_equals_declared": all(s == d for s, d, a in zip(sent, declared, applied,
                                                                  strict=True) if a),
           "fp16_allreduce": ring_bytes(2 * psi, comm.size, 2),
           "fp32_allreduce": ring_bytes(4 * psi, comm.size, 2),
           "median_step_ms": 1e3 * statistics.median(times[10:]), "losses": losses}
    engine.close()
    return row


def plot(rows, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ax.plot(r["losses"], label=r["run"], linewidth=1)
    ax.axvline(args.freeze_step, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"GPT ({rows[0]['params']:,} params), {rows[0]['ranks']} ranks, fp16: "
                 "Adam and 1-bit Adam")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows, args) -> list[str]:
    adam = rows[0]
    md = [f"GPT ({adam['params']:,} params), {adam['ranks']} ranks, fp16, ZeRO stage 0, "
          f"{args.steps} steps, global batch {args.batch} x {args.seq_len} tokens, lr "
          f"{args.lr:g} (WarmupLR over {args.lr_warmup} steps), betas (0.9, {args.beta2:g}); "
          "bytes sent per step by each rank (Comm's counters)", "",
          "| run | loss (mean of last 50) | vs Adam | val loss | vs Adam | bytes/step, "
          "warm-up | bytes/step, after | / fp16 allreduce | / fp32 allreduce | median step "
          "ms |", "|---" * 10 + "|"]
    for r in rows:
        after = r["bytes_after"]
        compressed = not np.isnan(after)
        md.append(
            f"| {r['run']} | {r['mean_last_50']:.4f} | "
            f"{100 * (r['mean_last_50'] / adam['mean_last_50'] - 1):+.2f} % | "
            f"{r['val_loss']:.4f} | {100 * (r['val_loss'] / adam['val_loss'] - 1):+.2f} % | "
            f"{r['bytes_warm']:,.0f} | " + (f"{after:,.0f} | 1/{r['fp16_allreduce'] / after:.1f}"
                                            f" | 1/{r['fp32_allreduce'] / after:.1f}"
                                            if compressed else "- | - | -")
            + f" | {r['median_step_ms']:.1f} |")
    return md


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--freeze-step", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-warmup", type=int, default=50)
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--beta2", type=float, default=0.99,
                        help="Adam's beta2 (all runs): 1-bit Adam freezes v at freeze_step, "
                             "which should be several 1 / (1 - beta2) steps (the paper: once v "
                             "is stable); 0.999 would need thousands")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="the largest relative loss gap to Adam that counts as converging "
                             "like Adam")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    comm = Comm()
    text = load_text()
    tokenizer = CharTokenizer(text)
    train_tokens, val_tokens = train_val_split(tokenizer.encode(text), 0.1)
    rows = [train(comm, name, opt, args, train_tokens, val_tokens, tokenizer.vocab_size)
            for name, opt in runs(args)]
    if comm.rank != 0:
        return
    md = table(rows, args)
    verdicts = []
    for key, what in (("mean_last_50", "training loss (mean of the last 50 steps)"),
                      ("val_loss", "validation loss")):
        gap = rows[-1][key] / rows[0][key] - 1
        warm_rule = rows[1][key] / rows[0][key] - 1
        verdicts.append(f"{what} {100 * gap:+.2f} % ({100 * warm_rule:+.2f} % without "
                        f"compression: DeepSpeed's warm-up rule alone; tolerance "
                        f"{100 * args.tolerance:g} %: "
                        f"{'within' if abs(gap) <= args.tolerance else 'OUTSIDE'})")
    md += ["", "1-bit Adam against Adam: " + "; ".join(verdicts) + ". After the warm-up "
           "every applied step sent exactly the compressed allreduce's formula: "
           f"{rows[-1]['sent_equals_declared']}."]
    print("\n".join(md))
    if args.out:
        out = write_results(args.out, rows, md, comm, argv=sys.argv, args=vars(args))
        write_losses(out, rows, "run")
        plot(rows, args, out / "loss.png")
        print(f"wrote {out}/table.md, table.csv, losses.csv, loss.png, run.json")


if __name__ == "__main__":
    main()

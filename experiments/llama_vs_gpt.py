"""A small Llama against a GPT-2 of equal parameters on Tiny Shakespeare: the loss at equal
tokens and the step time, with the same data, seed, optimizer and steps.

    python experiments/llama_vs_gpt.py --out results/llama_vs_gpt     # make bench-llama

The GPT-2 (models/gpt.py: LayerNorm, learned positions, GELU MLP of 4 d, biases, tied head)
has --n-layer blocks of width --d-model. Each Llama (models/llama.py: RMSNorm, RoPE, SwiGLU,
no biases, untied head, as transformers' LlamaConfig defaults) has the same layers, width and
heads, and the SwiGLU width (intermediate_size) that brings its parameters closest to the
GPT's (`matched_intermediate`): with multi-head attention, and with grouped-query attention
(--kv-heads key/value heads, the freed parameters given to the MLP). The runs' steps are
interleaved (each step of each model in turn, so that machine noise falls on all alike), all
on one rank, fp32, AdamW at --lr, the same batches (character tokens). Reported: parameters,
the median step time, the training loss (mean of the last --window steps), the validation
loss on --val-batches held-out batches, and the loss curves (losses.csv, loss.png).

Timings are this machine's (2 shared CPU cores, under the load of other jobs): they compare the
models side by side, not hardware.
"""
import argparse
import sys
from pathlib import Path

import numpy as np
from interleaved import add_arguments, shakespeare, train_interleaved

from results import write_losses, write_results
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_num_params
from zmpi.models.llama import Llama, LlamaConfig, llama_num_params


def llama_config(args, vocab: int, kv_heads: int, intermediate: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=args.d_model,
                       intermediate_size=intermediate, num_hidden_layers=args.n_layer,
                       num_attention_heads=args.n_head, num_key_value_heads=kv_heads,
                       max_position_embeddings=args.seq_len)


def matched_intermediate(args, vocab: int, kv_heads: int, target: int) -> int:
    """The intermediate_size whose Llama has the parameter count nearest `target` (the count
    grows by 3 d n_layer per unit of it; the smaller on a tie)."""
    base = llama_num_params(llama_config(args, vocab, kv_heads, 1))
    per_unit = llama_num_params(llama_config(args, vocab, kv_heads, 2)) - base
    return max(1, 1 + round((target - base) / per_unit))


def models(args, vocab: int) -> dict:
    """{name: (model, parameters)} of the runs, the GPT first."""
    gpt = GPTConfig(vocab, args.seq_len, args.n_layer, args.n_head, args.d_model)
    target = gpt_num_params(args.n_layer, args.d_model, vocab, args.seq_len)
    runs = {"GPT-2": (GPT(gpt, seed=args.seed), target)}
    for kv in dict.fromkeys((args.n_head, args.kv_heads)):
        cfg = llama_config(args, vocab, kv, matched_intermediate(args, vocab, kv, target))
        name = "Llama" if kv == args.n_head else f"Llama GQA {kv} kv"
        runs[name] = (Llama(cfg, seed=args.seed), llama_num_params(cfg))
    return runs


def train(args, comm) -> list[dict]:
    tok, train_tokens, val = shakespeare()
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
              "zero_optimization": {"stage": 0}}
    runs = models(args, tok.vocab_size)
    engines = {name: Engine(model, config, comm) for name, (model, _) in runs.items()}
    rows = {name: {"model": name, "params": params, "config": vars(model.config),
                   "losses": [], "step_s": []} for name, (model, params) in runs.items()}
    train_interleaved(args, engines, rows, train_tokens, val)
    return list(rows.values())


def loss_figure(rows, window: int, path: Path) -> None:
    """loss.png: each model's training loss, a running mean of `window` steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    for i, r in enumerate(rows):
        smooth = np.convolve(r["losses"], np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window - 1, len(r["losses"])), smooth, color=f"C{i}",
                label=f"{r['model']} ({r['params']:,} parameters)")
    ax.set(xlabel="step", ylabel=f"training loss (mean of {window} steps)",
           title="Tiny Shakespeare, the same batches")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def table(args, rows) -> list[str]:
    gpt = rows[0]
    md = [f"{args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, T "
          f"{args.seq_len}, batch {args.batch}, AdamW lr {args.lr}, gradient clipping 1.0, fp32, "
          f"{args.steps} steps on Tiny Shakespeare (characters), the same seed and batches, "
          "one rank, the models' steps interleaved on this 2-core machine (machine-relative). "
          "Each Llama's SwiGLU width brings its parameters nearest the GPT-2's; training "
          f"loss: mean of the last {args.window} steps; validation: {args.val_batches} "
          "held-out batches.", "",
          "| model | parameters | vs GPT-2 | SwiGLU width | step ms | training loss | "
          "validation loss |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        width = r["config"].get("intermediate_size")
        md.append(f"| {r['model']} | {r['params']:,} | {r['params'] / gpt['params'] - 1:+.2%} | "
                  f"{width if width else '- (MLP ' + str(4 * args.d_model) + ')'} | "
                  f"{r['step_ms']:.1f} | {r['train_loss']:.4f} | {r['val_loss']:.4f} |")
    return md


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--kv-heads", type=int, default=1, help="of the GQA Llama")
    parser.add_argument("--out", default="results/llama_vs_gpt")
    args = parser.parse_args()
    comm = Comm()
    if comm.size != 1:
        sys.exit("llama_vs_gpt.py runs on one rank")
    rows = train(args, comm)
    md = table(args, rows)
    summary = [{k: v for k, v in r.items() if k not in ("losses", "step_s", "config")}
               for r in rows]
    write_results(args.out, summary, md, comm, argv=sys.argv, args=vars(args), runs=rows)
    write_losses(args.out, rows, "model")
    loss_figure(rows, args.window, Path(args.out) / "loss.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()

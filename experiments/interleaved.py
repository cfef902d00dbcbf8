"""Training several models side by side on Tiny Shakespeare: the same batches, each step of
each model in turn (so that machine noise falls on all alike), then each one's validation loss.
The loss runs of moe_train.py and llama_vs_gpt.py.

    tok, train, val = shakespeare()
    engines = {"a": Engine(...), "b": Engine(...)}
    rows = {name: {"losses": [], "step_s": []} for name in engines}
    train_interleaved(args, engines, rows, train, val)   # args: add_arguments' options
"""
import statistics
import time

import numpy as np

from zmpi.data import BatchSampler, CharTokenizer, load_text, train_val_split


def add_arguments(parser) -> None:
    """The options of the models' shape and of the loss runs, which `train_interleaved`
    reads (--seq-len, --batch, --steps, --seed, --window, --val-batches)."""
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences a step, of the loss runs")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=4)


def shakespeare():
    """(tokenizer, training tokens, validation tokens): Tiny Shakespeare in characters, the
    last 10 % held out."""
    text = load_text()
    tok = CharTokenizer(text)
    train, val = train_val_split(tok.encode(text), 0.1)
    return tok, train, val


def train_interleaved(args, engines: dict, rows: dict, train, val,
                      observe=lambda name, engine, loss: loss, describe=lambda name: {}) -> None:
    """Train every engine of `engines` ({name: Engine}, one rank) --steps steps of --batch
    sequences of --seq-len tokens of `train`, step by step in turn on the same batches (seed
    --seed), then close it. Appends to rows[name]["step_s"] each step's seconds and to
    rows[name]["losses"] `observe(name, engine, loss)` (the loss train_step returned, by
    default; a caller that records more per step does it there); then sets rows[name]'s
    "val_loss" (mean over --val-batches batches of `val`, seed --seed + 1), the items of
    `describe(name)`, "train_loss" (mean of the last --window losses) and "step_ms" (median),
    in this order (the order of the results' columns)."""
    batches = BatchSampler(train, args.seq_len, args.batch, 0, 1, seed=args.seed)
    for step in range(args.steps):
        data = batches.sample(step)
        for name, engine in engines.items():
            t0 = time.perf_counter()
            loss = engine.train_step(*data)
            rows[name]["step_s"].append(time.perf_counter() - t0)
            rows[name]["losses"].append(observe(name, engine, loss))
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: " + ", ".join(f"{n} {r['losses'][-1]:.3f}"
                                               for n, r in rows.items()), flush=True)
    held_out = BatchSampler(val, args.seq_len, args.batch, 0, 1, seed=args.seed + 1)
    for name, engine in engines.items():
        r = rows[name]
        r["val_loss"] = float(np.mean([engine.eval_loss(*held_out.sample(i))
                                       for i in range(args.val_batches)]))
        engine.close()
        r.update(describe(name))
        r["train_loss"] = float(np.mean(r["losses"][-args.window:]))
        r["step_ms"] = 1e3 * statistics.median(r["step_s"])

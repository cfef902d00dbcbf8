"""The `zmpi` command.

    mpiexec -n 2 python -m zmpi.cli train --stage 3          # what `make demo` runs
    mpiexec -n 4 python -m zmpi.cli train --config configs/gpt_stage2_fp16.json --steps 200
    python -m zmpi.cli estimate --params 7.5e9 --world-size 64   # the ZeRO paper's Fig. 1

`train` trains a character-level GPT on the shipped Tiny Shakespeare corpus with any ZeRO
stage, shows a progress bar on rank 0 (loss, tokens/s), prints every rank's measured
model-state memory next to the paper's formula, samples some text, and writes the run's config,
git revision, environment, metrics and sample to `--out` (default runs/<time>).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

from models.gpt import GPT, GPTConfig
from zmpi.memory import MODEL_STATE, model_state_bytes

DEFAULTS = {  # the demo: ~0.8M parameters, about 1.5 minutes on 2 cores
    "steps": 600, "batch": 32, "seq_len": 64, "n_layer": 4, "n_head": 4, "d_model": 128,
    "lr": 3e-3,
}


def build_config(args, world_size: int) -> dict:
    """DeepSpeed-style config: --config file if given, else defaults; flags override it.

    The global batch (--batch, or the config's train_batch_size) counts sequences per optimizer
    step over all ranks and accumulation steps; it must split evenly over both.
    """
    cfg = json.loads(Path(args.config).read_text()) if args.config else {}
    accumulation = cfg.get("gradient_accumulation_steps", 1)
    if args.batch is not None or "train_micro_batch_size_per_gpu" not in cfg:
        batch = args.batch or cfg.get("train_batch_size") or DEFAULTS["batch"]
        if batch % (world_size * accumulation):
            raise SystemExit(f"global batch {batch} does not split over {world_size} ranks x "
                             f"{accumulation} accumulation steps")
        cfg["train_micro_batch_size_per_gpu"] = batch // (world_size * accumulation)
        cfg["train_batch_size"] = batch
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": DEFAULTS["lr"]}})
    if args.lr is not None:
        cfg["optimizer"].setdefault("params", {})["lr"] = args.lr
    cfg.setdefault("gradient_clipping", 1.0)
    if args.stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = args.stage
    if args.precision is not None:  # exactly one of fp16/bf16 on (or neither for fp32)
        for section in ("fp16", "bf16"):
            cfg[section] = {**cfg.get(section, {}), "enabled": args.precision == section}
    cfg["seed"] = args.seed
    return cfg


def memory_table(engine, comm) -> str:
    """Every rank's measured model-state bytes (ledger) next to the SC'20 formula."""
    s = engine.strategy
    stage = s.shard_optimizer + s.shard_gradients + s.shard_parameters  # the formula's stage
    pbytes, k = engine.dtype.itemsize, 3 * engine.master_dtype.itemsize
    formula = model_state_bytes(engine.layout.full_numel, comm.size, stage, pbytes, pbytes, k)
    rows = comm.allgather_object((comm.rank, engine.memory.model_state_bytes(),
                                  engine.memory.peak(MODEL_STATE)))
    lines = [f"model-state memory per rank ({engine.strategy.name}, {engine.dtype.name} params, "
             f"Psi = {engine.num_params:,} + {engine.layout.padding} padding, "
             f"K = {k}, N = {comm.size})",
             f"{'rank':>4} {'measured MiB':>13} {'formula MiB':>12} {'peak MiB':>9}"]
    for rank, now, peak in rows:
        lines.append(f"{rank:>4} {now / 2**20:>13.3f} {formula / 2**20:>12.3f} "
                     f"{peak / 2**20:>9.3f}")
    return "\n".join(lines)


def train(args) -> None:
    from tqdm import tqdm

    from zmpi.comm import Comm
    from zmpi.data import BatchSampler, CharTokenizer, load_text, train_val_split
    from zmpi.engine import Engine
    from zmpi.runinfo import rank_logger, run_metadata

    comm = Comm()
    log = rank_logger(comm.rank, args.log_dir)
    text = load_text()
    tokenizer = CharTokenizer(text)
    train_tokens, val_tokens = train_val_split(tokenizer.encode(text), 0.1)
    model_cfg = GPTConfig(tokenizer.vocab_size, args.seq_len, args.n_layer, args.n_head,
                          args.d_model)
    engine = Engine(GPT(model_cfg, seed=args.seed), build_config(args, comm.size), comm)
    cfg = engine.config
    rows = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    global_batch = rows * comm.size
    train_data = BatchSampler(train_tokens, args.seq_len, global_batch, comm.rank, comm.size,
                              seed=args.seed)
    val_data = BatchSampler(val_tokens, args.seq_len, global_batch, comm.rank, comm.size,
                            seed=args.seed + 1)
    log.info(f"zmpi train: GPT {engine.num_params:,} params, {comm.size} ranks, "
             f"{engine.strategy.name}, {engine.dtype.name}, global batch {global_batch} x "
             f"{args.seq_len} tokens, {args.steps} steps")

    out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    metrics = []
    bar = tqdm(range(args.steps), disable=comm.rank != 0, file=sys.stdout, mininterval=0.5,
               dynamic_ncols=True)
    start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        loss = engine.train_step(*train_data.sample(step))
        tokens_per_s = global_batch * args.seq_len / (time.perf_counter() - t0)
        metrics.append((step, loss, tokens_per_s, engine.scaler.scale))
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        if args.log_dir and step % 10 == 0:
            log.info(f"step {step} loss {loss:.4f} tokens/s {tokens_per_s:.0f}")
    elapsed = time.perf_counter() - start
    val_loss = np.mean([engine.eval_loss(*val_data.sample(i)) for i in range(4)])
    mean_tps = args.steps * global_batch * args.seq_len / elapsed
    log.info(f"loss {metrics[0][1]:.3f} -> {metrics[-1][1]:.3f} (val {val_loss:.3f}); "
             f"{mean_tps:,.0f} tokens/s over {elapsed:.1f} s")
    log.info(memory_table(engine, comm))

    prompt = tokenizer.encode("ROMEO:\n")[None, :]
    sample = tokenizer.decode(engine.model.generate(prompt, args.sample_tokens, temperature=0.8,
                                                    rng=args.seed)[0])
    log.info("--- sample ---\n" + sample)
    if comm.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sample.txt").write_text(sample)
        with open(out / "metrics.csv", "w", newline="") as f:
            csv.writer(f).writerows([("step", "loss", "tokens_per_s", "loss_scale"), *metrics])
        meta = run_metadata(comm, argv=sys.argv, config=cfg.to_dict(), model=vars(model_cfg),
                            engine=engine.describe(), val_loss=float(val_loss),
                            tokens_per_s=mean_tps, memory=engine.memory.snapshot())
        (out / "run.json").write_text(json.dumps(meta, indent=2, default=str))
        log.info(f"wrote {out}/run.json, metrics.csv, sample.txt")


def estimate(args) -> None:
    """Print the paper's per-rank model-state memory and traffic for each stage."""
    from zmpi.memory import comm_volume_elements

    psi, n = args.params, args.world_size
    print(f"Psi = {psi:.3g} parameters, N = {n} ranks, {args.param_bytes}-byte params and "
          f"grads, K = {args.optimizer_bytes}")
    print(f"{'stage':>5} {'GB per rank':>12} {'traffic per step (elements)':>28}")
    for stage in range(4):
        gb = model_state_bytes(psi, n, stage, args.param_bytes, args.param_bytes,
                               args.optimizer_bytes) / 1e9
        print(f"{stage:>5} {gb:>12.1f} {comm_volume_elements(psi, n, stage):>28.3g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="zmpi", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a char-level GPT on Tiny Shakespeare")
    t.add_argument("--config", help="DeepSpeed-style JSON config (flags below override it)")
    t.add_argument("--stage", type=int, choices=range(4), help="ZeRO stage (default 3)")
    t.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default=None,
                   help="parameter/gradient storage; overrides the config's fp16/bf16 "
                   "sections (default: from --config, else fp32)")
    t.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    t.add_argument("--batch", type=int, default=None,
                   help="sequences per optimizer step over all ranks and accumulation steps "
                   f"(default: the config's train_batch_size, else {DEFAULTS['batch']})")
    t.add_argument("--lr", type=float, default=None, help=f"default {DEFAULTS['lr']}")
    for name in ("seq_len", "n_layer", "n_head", "d_model"):
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=DEFAULTS[name])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sample-tokens", type=int, default=200)
    t.add_argument("--out", help="output directory (default runs/<time>)")
    t.add_argument("--log-dir", help="every rank logs to LOG_DIR/rank<r>.log")
    e = sub.add_parser("estimate", help="model-state memory per rank from the ZeRO formulas")
    e.add_argument("--params", type=float, required=True)
    e.add_argument("--world-size", type=int, required=True)
    e.add_argument("--param-bytes", type=int, default=2)
    e.add_argument("--optimizer-bytes", type=int, default=12)
    args = parser.parse_args(argv)
    if args.command == "train":
        if args.stage is None and not args.config:
            args.stage = 3
        train(args)
    else:
        estimate(args)


if __name__ == "__main__":
    main()

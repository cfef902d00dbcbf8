"""The `zmpi` command.

    mpiexec -n 2 python -m zmpi.cli train --stage 3          # what `make demo` runs
    mpiexec -n 4 python -m zmpi.cli train --config configs/gpt_stage2_fp16.json --steps 200
    python -m zmpi.cli estimate --params 7.5e9 --world-size 64   # the ZeRO paper's Fig. 1
    mpiexec -n 2 python -m zmpi.cli train --stage 2 --offload-optimizer --delay-update
    mpiexec -n 2 python -m zmpi.cli train --save-every 100 --ckpt-dir ckpt --steps 300
    mpiexec -n 4 python -m zmpi.cli train --resume ckpt --steps 600   # any world size
    python -m zmpi.cli ckpt inspect ckpt        # also: verify, consolidate ckpt out.h5

`train` trains a character-level GPT on the shipped Tiny Shakespeare corpus with any ZeRO
stage, shows a progress bar on rank 0 (loss, tokens/s), prints every rank's measured
model-state memory next to the paper's formula, samples some text, and writes the run's config,
git revision, environment, metrics and sample to `--out` (default runs/<time>). With
`--save-every K` it saves a sharded checkpoint every K steps and at the end; `--resume` goes
on from the newest one, at any world size and stage. `ckpt` inspects, verifies and
consolidates checkpoints without MPI.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from zmpi.memory import DEVICES, MODEL_STATE, model_state_placement
from zmpi.models.gpt import GPT, GPTConfig

DEFAULTS = {  # the demo: ~0.8M parameters, about 1.5 minutes on 2 cores
    "steps": 600, "batch": 32, "seq_len": 64, "n_layer": 4, "n_head": 4, "d_model": 128,
    "lr": 3e-3,
}


def _set(cfg: dict, path: str, value, flag: str, notes: list) -> None:
    """cfg[a][b]... = value for path 'a.b...'; a note when it replaces a different value."""
    *parents, key = path.split(".")
    for name in parents:
        cfg = cfg.setdefault(name, {})
    if key in cfg and cfg[key] != value:
        notes.append(f"{flag} overrides the config's {path} = {cfg[key]!r} with {value!r}")
    cfg[key] = value


def _get(cfg: dict, path: str):
    for name in path.split("."):
        cfg = cfg.get(name, {}) if isinstance(cfg, dict) else {}
    return cfg


def _read_config(path: str) -> dict:
    """The JSON object in `path`; a ConfigError (one line) if it cannot be read or parsed."""
    from zmpi.config import ConfigError

    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("", f"{path} is not valid JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("", f"{path} holds a JSON {type(cfg).__name__}, not an object")
    return cfg


def _fill_auto(cfg: dict, notes: list, args) -> None:
    """Replace the "auto" values that follow from zmpi train's flags: the optimizer's lr (and
    its other parameters, zmpi's defaults), the scheduler's steps and rates, gradient
    clipping, fp16/bf16. What cannot be derived stays "auto" and the config names it."""
    from zmpi.config import AUTO, OptimizerConfig

    lr = args.lr if args.lr is not None else DEFAULTS["lr"]
    defaults = OptimizerConfig()
    sources = {
        "optimizer.params.lr": (lr, "--lr"),
        "optimizer.params.betas": (list(defaults.betas), "zmpi's default"),
        "optimizer.params.eps": (defaults.eps, "zmpi's default"),
        "optimizer.params.weight_decay": (defaults.weight_decay, "zmpi's default"),
        "scheduler.params.total_num_steps": (args.steps, "--steps"),
        "scheduler.params.warmup_max_lr": (lr, "--lr"),
        "scheduler.params.warmup_min_lr": (0.0, "DeepSpeed's default"),
        "gradient_clipping": (1.0, "zmpi train's default"),
        "fp16.enabled": (args.precision == "fp16", "--precision"),
        "bf16.enabled": (args.precision == "bf16", "--precision"),
    }
    if args.warmup_steps is not None:
        sources["scheduler.params.warmup_num_steps"] = (args.warmup_steps, "--warmup-steps")
    for path, (value, source) in sources.items():
        *parents, key = path.split(".")
        section = _get(cfg, ".".join(parents)) if parents else cfg
        if isinstance(section, dict) and section.get(key) == AUTO:
            section[key] = value
            notes.append(f"{path}: 'auto' is {value!r} ({source})")


SCHEDULE_FLAGS = ("constant", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _schedule_from_flags(cfg: dict, args, notes: list) -> None:
    """--lr-schedule and --warmup-steps: the common schedules without writing a config."""
    if args.lr_schedule == "constant":
        if cfg.get("scheduler"):
            notes.append(f"--lr-schedule constant drops the config's scheduler "
                         f"{cfg['scheduler'].get('type')!r}")
        cfg.pop("scheduler", None)
        if args.warmup_steps is not None:
            raise SystemExit("zmpi train: --warmup-steps needs a schedule, not constant")
        return
    kind = args.lr_schedule or _get(cfg, "scheduler.type") or (
        "WarmupLR" if args.warmup_steps is not None else None)
    if kind is None:
        return
    _set(cfg, "scheduler.type", kind, "--lr-schedule", notes)
    if args.warmup_steps is not None:
        _set(cfg, "scheduler.params.warmup_num_steps", args.warmup_steps, "--warmup-steps",
             notes)
    if args.lr_schedule is None:
        return  # the config's own schedule, maybe with --warmup-steps
    lr = args.lr if args.lr is not None else _get(cfg, "optimizer.params.lr") or DEFAULTS["lr"]
    if kind in ("WarmupLR", "WarmupDecayLR"):
        _set(cfg, "scheduler.params.warmup_max_lr", lr, "--lr-schedule", notes)
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        _set(cfg, "scheduler.params.total_num_steps", args.steps, "--lr-schedule", notes)


def build_config(args, world_size: int, notes: list | None = None) -> dict:
    """DeepSpeed-style config: --config file if given, else defaults; flags override it, and
    each override of a value the config set is described in `notes` (the CLI prints them).
    "auto" values that follow from the flags are filled in (and noted).

    The global batch (--batch, or the config's train_batch_size) counts sequences per optimizer
    step over all ranks and accumulation steps; it must split evenly over both.
    """
    from zmpi.config import AUTO

    notes = [] if notes is None else notes
    cfg = _read_config(args.config) if args.config else {}
    _fill_auto(cfg, notes, args)
    if cfg.get("train_batch_size") == AUTO:
        cfg["train_batch_size"] = args.batch or DEFAULTS["batch"]
        notes.append(f"train_batch_size: 'auto' is {cfg['train_batch_size']} (--batch)")
    accumulation = cfg.get("gradient_accumulation_steps", 1)
    if AUTO in (accumulation, cfg.get("train_micro_batch_size_per_gpu")):
        if args.batch is not None:  # the engine derives the "auto" keys from the batch
            _set(cfg, "train_batch_size", args.batch, "--batch", notes)
    elif args.batch is not None or "train_micro_batch_size_per_gpu" not in cfg:
        batch = args.batch or cfg.get("train_batch_size") or DEFAULTS["batch"]
        if batch % (world_size * accumulation):
            raise SystemExit(f"global batch {batch} does not split over {world_size} ranks x "
                             f"{accumulation} accumulation steps")
        _set(cfg, "train_micro_batch_size_per_gpu", batch // (world_size * accumulation),
             "--batch", notes)
        _set(cfg, "train_batch_size", batch, "--batch", notes)
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {"lr": DEFAULTS["lr"]}})
    if args.lr is not None:
        _set(cfg, "optimizer.params.lr", args.lr, "--lr", notes)
    _schedule_from_flags(cfg, args, notes)
    cfg.setdefault("gradient_clipping", 1.0)
    if args.stage is not None:
        _set(cfg, "zero_optimization.stage", args.stage, "--stage", notes)
    if args.strategy is not None:
        _set(cfg, "zero_optimization.strategy", args.strategy, "--strategy", notes)
    strategy = cfg.get("zero_optimization", {}).get("strategy")
    if args.stage is not None and strategy not in (None, f"stage{args.stage}"):
        raise SystemExit(f"zmpi train: --stage {args.stage} contradicts the strategy "
                         f"{strategy!r} (from {'--strategy' if args.strategy else '--config'}); "
                         "give one of them")
    if args.precision is not None:  # exactly one of fp16/bf16 on (or neither for fp32)
        for section in ("fp16", "bf16"):
            _set(cfg, f"{section}.enabled", args.precision == section, "--precision", notes)
    if args.offload_optimizer or args.delay_update is not None:
        flag = "--offload-optimizer" if args.offload_optimizer else "--delay-update"
        _set(cfg, "zero_optimization.offload_optimizer.device", "cpu", flag, notes)
        if args.delay_update is not None:
            for key, value in (("delay_update", True), ("delay_update_warmup", args.delay_update)):
                _set(cfg, f"zero_optimization.offload_optimizer.{key}", value, "--delay-update",
                     notes)
    if args.offload_param:
        _set(cfg, "zero_optimization.offload_param.device", "cpu", "--offload-param", notes)
    if args.shard_group_size is not None:
        _set(cfg, "zero_optimization.shard_group_size", args.shard_group_size,
             "--shard-group-size", notes)
    if args.seed is not None:
        _set(cfg, "seed", args.seed, "--seed", notes)
    cfg.setdefault("seed", 0)
    return cfg


def memory_table(engine, comm) -> str:
    """Every rank's measured model-state bytes (ledger) on the device and on the host, next
    to what the strategy declares (for stages 0-3: the SC'20 formula extended with
    ZeRO-Offload's placement, zmpi.memory; the test suite checks they agree)."""
    s = engine.strategy
    mbytes = engine.master_dtype.itemsize
    formula = s.expected_model_state()
    rows = comm.allgather_object((comm.rank, *(engine.memory.model_state_bytes(d)
                                               for d in DEVICES),
                                  engine.memory.peak(MODEL_STATE, "device")))
    want = [sum(formula[d].values()) / 2**20 for d in DEVICES]
    lines = [f"model-state memory per rank ({s.name}, {engine.dtype.name} params, "
             f"Psi = {engine.num_params:,} + {engine.layout.padding} padding, "
             f"K = {3 * mbytes}, N = {comm.size}, sharded over {s.world_size}; offload: optimizer "
             f"{'on' if s.offload_optimizer else 'off'}, params "
             f"{'on' if s.offload_param else 'off'})",
             f"{'rank':>4} {'device MiB':>11} {'formula':>9} {'host MiB':>9} {'formula':>9} "
             f"{'device peak':>12}"]
    for rank, device, host, peak in rows:
        lines.append(f"{rank:>4} {device / 2**20:>11.3f} {want[0]:>9.3f} {host / 2**20:>9.3f} "
                     f"{want[1]:>9.3f} {peak / 2**20:>12.3f}")
    return "\n".join(lines)


def traffic_line(engine, steps: int) -> str:
    """This rank's bytes sent by array collectives per communicator since the engine started
    (ring model, Comm's counters), next to what the strategy declares per step."""
    declared = engine.strategy.expected_traffic()
    parts = []
    for kind, sent in engine.sent_bytes().items():
        parts.append(f"{kind} {sent / 2**20:.2f} MiB ({sent / 2**20 / max(steps, 1):.3f} per "
                     f"step; declared {declared.get(kind, 0) / 2**20:.3f} without accumulation)")
    return f"traffic sent by this rank over {steps} steps: " + "; ".join(parts)


def train(args) -> None:
    from tqdm import tqdm

    from zmpi.comm import Comm
    from zmpi.config import ConfigError
    from zmpi.data import BatchSampler, CharTokenizer, load_text, load_tokens, train_val_split
    from zmpi.engine import Engine
    from zmpi.runinfo import PreemptionGuard, RunRecord, rank_logger

    comm = Comm()
    log = rank_logger(comm.rank, args.log_dir)
    if args.data:  # a binary token file, memory-mapped
        try:
            tokens, vocab_size = load_tokens(args.data, args.vocab_size)
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"zmpi train: --data {args.data}: {e}") from None
        tokenizer = None
    else:
        text = load_text()
        tokenizer = CharTokenizer(text)
        tokens, vocab_size = tokenizer.encode(text), tokenizer.vocab_size
    train_tokens, val_tokens = train_val_split(tokens, 0.1)
    model_cfg = GPTConfig(vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    notes = []
    try:
        config = build_config(args, comm.size, notes)
        args.seed = config["seed"]  # the config's, unless --seed overrides it
        engine = Engine(GPT(model_cfg, seed=args.seed), config, comm)
    except ConfigError as e:  # the same on every rank: one line from rank 0, no tracebacks
        if comm.rank == 0:
            where = f"config {args.config}" if args.config else "config from the flags"
            print(f"zmpi train: {where}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for note in notes:
        log.info(note)
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

    out = Path(comm.bcast_object(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"))
    ckpt_dir = Path(args.ckpt_dir or out / "checkpoints")
    first = _resume(args, engine, comm, log) if args.resume is not None else 0
    record = RunRecord(out, comm, argv=sys.argv, config=cfg.to_dict(), model=vars(model_cfg),
                       engine=engine.describe(), first_step=first)
    guard = PreemptionGuard()
    metrics = []
    bar = tqdm(range(first, args.steps), disable=comm.rank != 0, file=sys.stdout,
               mininterval=0.5, dynamic_ncols=True)
    start = time.perf_counter()
    for step in bar:
        t0 = time.perf_counter()
        loss = engine.train_step(*train_data.sample(step))
        tokens_per_s = global_batch * args.seq_len / (time.perf_counter() - t0)
        metrics.append((step, loss, tokens_per_s, engine.scaler.scale, engine.lr,
                        engine.scaler.skipped_steps))
        record.append(metrics[-1])
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        if args.log_dir and step % cfg.steps_per_print == 0:
            log.info(f"step {step} loss {loss:.4f} tokens/s {tokens_per_s:.0f}")
        preempted = guard.requested(comm)
        if preempted or (args.save_every and ((step + 1) % args.save_every == 0
                                              or step + 1 == args.steps)):
            t0 = time.perf_counter()
            path = engine.save_checkpoint(ckpt_dir, f"step{step + 1}", args.keep_last,
                                          async_=args.async_save and not preempted,
                                          client_state={"step": step + 1, "seed": args.seed})
            if args.log_dir or preempted:
                log.info(f"{'started saving' if args.async_save else 'saved'} {path} "
                         f"({time.perf_counter() - t0:.2f} s)")
        if preempted:
            bar.close()
            engine.close()  # finishes the save
            log.info(f"zmpi train: {guard.received or 'a signal on another rank'}: stopped "
                     f"after step {step}; go on with --resume {ckpt_dir}")
            record.close(status="preempted", last_step=step, checkpoint=str(ckpt_dir))
            return
    elapsed = time.perf_counter() - start
    engine.flush()  # a delayed update in flight lands before evaluation
    log.info(traffic_line(engine, len(metrics)))
    profile = engine.phases.table(comm) if args.profile else None
    if profile:
        log.info("time per step by phase (ms):\n" + profile)
    val_loss = np.mean([engine.eval_loss(*val_data.sample(i)) for i in range(4)])
    mean_tps = len(metrics) * global_batch * args.seq_len / elapsed
    log.info(f"loss {metrics[0][1]:.3f} -> {metrics[-1][1]:.3f} (val {val_loss:.3f}); "
             f"{mean_tps:,.0f} tokens/s over {elapsed:.1f} s")
    log.info(memory_table(engine, comm))

    prompt = (tokenizer.encode("ROMEO:\n") if tokenizer else val_tokens[:8].astype(np.int64))
    ids = engine.model.generate(prompt[None, :], args.sample_tokens, temperature=0.8,
                                rng=args.seed)[0]
    sample = tokenizer.decode(ids) if tokenizer else " ".join(map(str, ids.tolist()))
    log.info("--- sample ---\n" + sample)
    if comm.rank == 0:
        (out / "sample.txt").write_text(sample)
    record.close(status="finished", val_loss=float(val_loss), tokens_per_s=mean_tps,
                 profile=profile,
                 memory=engine.memory.snapshot(), optimizer_timing=engine.update_timing)
    log.info(f"wrote {out}/run.json, metrics.csv, sample.txt")
    engine.close()


def _resume(args, engine, comm, log) -> int:
    """Load the checkpoint --resume names (or --ckpt-dir's); returns the step to go on from.
    A bad checkpoint ends the run on every rank with one line from rank 0."""
    from zmpi.checkpoint import CheckpointError

    directory = args.resume or args.ckpt_dir or (Path(args.out) / "checkpoints" if args.out
                                                 else None)
    if directory is None:
        raise SystemExit("zmpi train: --resume needs a directory, --ckpt-dir or --out")
    try:
        loaded = engine.load_checkpoint(directory)
    except CheckpointError as e:
        if comm.rank == 0:
            print(f"zmpi train: cannot resume: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    saved_seed = loaded.client_state.get("seed", args.seed)
    notes = loaded.notes + ([f"the data seed is {args.seed} (the checkpoint had {saved_seed})"]
                            if saved_seed != args.seed else [])
    first = loaded.client_state["step"]
    for note in notes:
        log.info(note)
    log.info(f"resumed from {loaded.path} (step {first}, saved by {loaded.world_size} ranks "
             f"with {loaded.strategy}) on {comm.size} ranks with {engine.strategy.name}")
    if first >= args.steps:
        raise SystemExit(f"zmpi train: the checkpoint is at step {first}; ask for more "
                         f"--steps than that to go on")
    return first


def ckpt(args) -> None:
    """zmpi ckpt inspect|verify|consolidate: offline, no MPI. Exit code 1 on any problem."""
    from zmpi.checkpoint import CheckpointError, tools

    try:
        if args.ckpt_command == "inspect":
            print(tools.inspect(args.directory, args.tag))
        elif args.ckpt_command == "verify":
            problems = tools.verify(args.directory, args.tag)
            for problem in problems:
                print(problem)
            print(f"{len(problems)} problems" if problems else "ok: every checksum matches")
            raise SystemExit(1 if problems else 0)
        else:
            out = tools.consolidate(args.directory, args.out, args.tag, args.npz)
            print(f"wrote {out}")
    except CheckpointError as e:
        print(f"zmpi ckpt {args.ckpt_command}: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def gpt_num_params(n_layer: int, d_model: int, vocab_size: int, seq_len: int) -> int:
    """Parameters of zmpi's GPT (tied LM head): embeddings V d + T d, per block 12 d^2 + 13 d
    (qkv, proj, fc, proj with biases; two LayerNorms), the final LayerNorm 2 d."""
    return (vocab_size + seq_len) * d_model + n_layer * (12 * d_model**2 + 13 * d_model) \
        + 2 * d_model


def estimate_rows(psi, n, stages, param_bytes, optimizer_bytes, offload_optimizer=False,
                  offload_param=False) -> list[dict]:
    """Per stage: model-state GB per rank on the device and the host (ZeRO Fig. 1, with
    ZeRO-Offload's placement) and elements each rank sends per step; a stage the offload
    settings exclude carries its reason instead."""
    from zmpi.memory import comm_volume_elements

    rows = []
    for stage in stages:
        row = {"stage": stage, "traffic_elements": comm_volume_elements(psi, n, stage)}
        try:
            place = model_state_placement(psi, n, stage, param_bytes, param_bytes,
                                          optimizer_bytes / 3, optimizer_bytes / 3,
                                          offload_optimizer, offload_param)
        except ValueError as e:
            rows.append({**row, "error": str(e)})
            continue
        row.update(device_gb=sum(place["device"].values()) / 1e9,
                   host_gb=sum(place["host"].values()) / 1e9)
        rows.append(row)
    return rows


def estimate(args) -> None:
    """Print the ZeRO paper's per-rank model-state memory and traffic for each stage (or
    --stage); with offload flags, device and host memory (ZeRO-Offload); --json for a
    machine-readable answer."""
    if (args.params is None) == (args.n_layer is None):
        raise SystemExit("zmpi estimate: give --params, or a GPT shape (--n-layer, --d-model, "
                         "--vocab-size, --seq-len)")
    psi = args.params if args.params is not None else gpt_num_params(
        args.n_layer, args.d_model, args.vocab_size, args.seq_len)
    pb = args.param_bytes or (4 if args.precision == "fp32" else 2)
    k = args.optimizer_bytes or 12
    stages = range(4) if args.stage is None else [args.stage]
    rows = estimate_rows(psi, args.world_size, stages, pb, k, args.offload_optimizer,
                         args.offload_param)
    if args.json:
        print(json.dumps({"params": psi, "world_size": args.world_size, "param_bytes": pb,
                          "optimizer_bytes": k, "offload_optimizer": args.offload_optimizer,
                          "offload_param": args.offload_param, "stages": rows}, indent=2))
        return
    offload = args.offload_optimizer or args.offload_param
    print(f"Psi = {psi:.4g} parameters, N = {args.world_size} ranks, {pb}-byte params and "
          f"grads, K = {k}" + (f"; offload: optimizer {'on' if args.offload_optimizer else 'off'}"
                               f", params {'on' if args.offload_param else 'off'}"
                               if offload else ""))
    if not offload:
        print(f"{'stage':>5} {'GB per rank':>12} {'traffic per step (elements)':>28}")
        for r in rows:
            print(f"{r['stage']:>5} {r['device_gb']:>12.1f} {r['traffic_elements']:>28.3g}")
        return
    print(f"{'stage':>5} {'device GB':>10} {'host GB':>9} {'traffic per step (elements)':>28}")
    for r in rows:
        if "error" in r:
            print(f"{r['stage']:>5} {'-':>10} {'-':>9} {'':>28}  ({r['error']})")
        else:
            print(f"{r['stage']:>5} {r['device_gb']:>10.1f} {r['host_gb']:>9.1f} "
                  f"{r['traffic_elements']:>28.3g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="zmpi", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a char-level GPT on Tiny Shakespeare")
    t.add_argument("--config", help="DeepSpeed-style JSON config (flags below override it)")
    t.add_argument("--stage", type=int, choices=range(4), help="ZeRO stage (default 3)")
    t.add_argument("--strategy", help="a registered partition strategy, an installed "
                   "entry point, or package.module:ClassName (overrides the stage)")
    t.add_argument("--shard-group-size", type=int, metavar="G", default=None,
                   help="hybrid strategies: shard over groups of G ranks (default: a node)")
    t.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default=None,
                   help="parameter/gradient storage; overrides the config's fp16/bf16 "
                   "sections (default: from --config, else fp32)")
    t.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    t.add_argument("--batch", type=int, default=None,
                   help="sequences per optimizer step over all ranks and accumulation steps "
                   f"(default: the config's train_batch_size, else {DEFAULTS['batch']})")
    t.add_argument("--lr", type=float, default=None, help=f"default {DEFAULTS['lr']}")
    t.add_argument("--lr-schedule", choices=SCHEDULE_FLAGS, default=None,
                   help="DeepSpeed schedule to --lr (warm-up from 0, log-shaped as DeepSpeed's "
                   "default; decay/cosine end at --steps); default: the config's, else constant")
    t.add_argument("--warmup-steps", type=int, metavar="W", default=None,
                   help="warm-up steps of the schedule (alone: WarmupLR)")
    for name in ("seq_len", "n_layer", "n_head", "d_model"):
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=DEFAULTS[name])
    t.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: master weights, Adam state and update on the host "
                   "(sets zero_optimization.offload_optimizer.device=cpu; stages 1-3)")
    t.add_argument("--offload-param", action="store_true",
                   help="stage 3: parameter shards on the host (offload_param.device=cpu)")
    t.add_argument("--delay-update", type=int, metavar="WARMUP", default=None,
                   help="one-step delayed update after WARMUP synchronous steps (implies "
                   "--offload-optimizer; the paper uses 40)")
    t.add_argument("--seed", type=int, default=None,
                   help="model init and data order (default: the config's seed, else 0)")
    t.add_argument("--sample-tokens", type=int, default=200)
    t.add_argument("--data", metavar="FILE.bin", help="train on a flat uint16 token file "
                   "(nanoGPT's format; memory-mapped; the last 10%% is validation) instead of "
                   "Tiny Shakespeare")
    t.add_argument("--vocab-size", type=int, default=None,
                   help="the vocabulary of --data (default: meta.json or meta.pkl beside it)")
    t.add_argument("--profile", action="store_true",
                   help="print (and save in run.json) each rank's time per step by phase: "
                   "forward, backward, step, optimizer, waited-for communication (the "
                   "first step, a warm-up, left out when there are more)")
    t.add_argument("--out", help="output directory (default runs/<time>)")
    t.add_argument("--log-dir", help="every rank logs to LOG_DIR/rank<r>.log")
    t.add_argument("--save-every", type=int, metavar="K", default=0,
                   help="save a checkpoint every K steps and at the end (default: never)")
    t.add_argument("--ckpt-dir", help="checkpoint directory (default OUT/checkpoints)")
    t.add_argument("--keep-last", type=int, metavar="K", default=None,
                   help="keep only the K newest checkpoints (default: all)")
    t.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread while training goes on")
    t.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="go on from the newest checkpoint in DIR (default: --ckpt-dir)")
    e = sub.add_parser("estimate", help="model-state memory per rank from the ZeRO formulas")
    e.add_argument("--params", type=float, default=None,
                   help="the model's parameter count Psi (e.g. 7.5e9); or give a GPT shape")
    for flag, text in (("--n-layer", "layers"), ("--d-model", "hidden size"),
                       ("--vocab-size", "vocabulary"), ("--seq-len", "context length")):
        e.add_argument(flag, type=int, default=None if flag == "--n-layer" else
                       {"--d-model": 768, "--vocab-size": 50257, "--seq-len": 1024}[flag],
                       help=f"GPT shape instead of --params: {text}"
                       + ("" if flag == "--n-layer" else " (default %(default)s)"))
    e.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    e.add_argument("--stage", type=int, choices=range(4), default=None,
                   help="one ZeRO stage (default: all four)")
    e.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                   help="fp16/bf16: 2-byte params and grads; fp32: 4-byte; K = 12 either way "
                   "(zmpi keeps fp32 master weights, Adam m and v) (default fp16)")
    e.add_argument("--param-bytes", type=int, default=None,
                   help="bytes per parameter and per gradient (overrides --precision)")
    e.add_argument("--optimizer-bytes", type=int, default=None,
                   help="optimizer bytes per parameter K (overrides --precision)")
    e.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: master weights, Adam state and gradient shard on the host")
    e.add_argument("--offload-param", action="store_true",
                   help="stage 3 parameter shards on the host")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c = sub.add_parser("ckpt", help="inspect, verify or consolidate a checkpoint (no MPI)")
    csub = c.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (("inspect", "print the manifest: step, world size, dtypes, files"),
                       ("verify", "check every checksum; exit code 0 if sound, else 1"),
                       ("consolidate", "one file of full fp32 tensors (tied weights once)")):
        p = csub.add_parser(name, help=text)
        p.add_argument("directory", help="checkpoint directory (the one holding `latest`)")
        if name == "consolidate":
            p.add_argument("out", help="output file (.h5, or .npz with --npz)")
            p.add_argument("--npz", action="store_true", help="write a NumPy .npz")
        p.add_argument("--tag", help="which checkpoint (default: the one `latest` names)")
    args = parser.parse_args(argv)
    if args.command == "ckpt":
        ckpt(args)
    elif args.command == "train":
        if args.save_every < 0 or (args.keep_last is not None and args.keep_last < 1):
            parser.error("--save-every must be >= 0 and --keep-last >= 1")
        if not args.save_every and (args.keep_last is not None or args.async_save):
            parser.error("--keep-last and --async-save act only with --save-every K")
        if args.stage is None and not args.config and not args.strategy:
            args.stage = 3
        train(args)
    else:
        estimate(args)


if __name__ == "__main__":
    main()

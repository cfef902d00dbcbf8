"""`zmpi train`'s flags into a DeepSpeed-style config (`build_config`): the --config file read,
each flag written over it with a note where it replaces a value the config set, and the "auto"
values that follow from the flags filled in. A flag that cannot act is an InputError (one
line); zmpi.cli.inputs checks the flags, the data and the config around it."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULTS = {  # the demo: ~0.8M parameters, about 1.5 minutes on 2 cores
    "steps": 600, "batch": 32, "seq_len": 64, "n_layer": 4, "n_head": 4, "d_model": 128,
    "lr": 3e-3,
}
DEFAULT_STAGE = 3  # without --config, --stage or --strategy; a config without a stage: 0


class InputError(SystemExit):
    """A bad `zmpi train` input (a flag, the config, the --data file), described in one line.
    `zmpi train` prints it once, on rank 0, and exits with code 2 (`_exit_bad_input`); left
    uncaught it exits printing the line, as SystemExit does."""


MODEL_FLAGS = ("seq_len", "n_layer", "n_head", "d_model")  # also the config's model section
MOE_FLAGS = (  # (flag, key of the moe section, type, metavar, what it does)
    ("--moe-experts", "num_experts", int, "E", "mixture of experts: the MoE blocks' MLP "
     "becomes E experts (DeepSpeed-MoE, GShard)"),
    ("--moe-k", "k", int, "K", "with MoE: experts per token (1 Switch, 2 GShard; default 1)"),
    ("--moe-interval", "moe_layer_interval", int, "K", "with MoE: every K-th block is an MoE "
     "block (default 1: all)"),
    ("--moe-capacity-factor", "capacity_factor", float, "F", "with MoE: each expert takes at "
     "most ceil(k x sequence / E x F) tokens of a sequence (default 1.0)"),
)


def _set(cfg: dict, path: str, value, flag: str, notes: list) -> None:
    """cfg[a][b]... = value for path 'a.b...'; a note when it replaces a different value; a
    ConfigError if the config holds something other than an object on the way."""
    from zmpi.config import ConfigError

    *parents, key = path.split(".")
    for i, name in enumerate(parents):
        cfg = cfg.setdefault(name, {})
        if not isinstance(cfg, dict):
            raise ConfigError(".".join(parents[:i + 1]),
                              f"expected object, got {json.dumps(cfg)}")
    if key in cfg and cfg[key] != value:
        notes.append(f"{flag} overrides the config's {path} = {cfg[key]!r} with {value!r}")
    cfg[key] = value


def _get(cfg: dict, path: str):
    for name in path.split("."):
        cfg = cfg.get(name, {}) if isinstance(cfg, dict) else {}
    return cfg


def _read_config(path: str) -> dict:
    """The JSON object in `path` (zmpi.config.parse_json: no repeated key, no NaN or
    Infinity); a ConfigError (one line) if it is no regular file (zmpi.files.check_input:
    a device or a FIFO would never end, or wait forever), or cannot be read or parsed."""
    from zmpi.config import ConfigError, parse_json
    from zmpi.files import check_input

    try:  # a device (/dev/zero) or a FIFO would never end or wait forever
        check_input(path, "")
    except ValueError as e:
        raise ConfigError("", f"cannot read {e}") from None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{path} is not UTF-8 text (byte {e.start})") from None
    cfg = parse_json(text)
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
            raise InputError("--warmup-steps needs a schedule, not constant")
        return
    kind = args.lr_schedule or _get(cfg, "scheduler.type") or (
        "WarmupLR" if args.warmup_steps is not None else None)
    if kind is None:
        return
    _set(cfg, "scheduler.type", kind, "--lr-schedule", notes)
    if args.warmup_steps is not None:
        _set(cfg, "scheduler.params.warmup_num_steps", args.warmup_steps, "--warmup-steps",
             notes)
    if args.lr_schedule is None:  # the config's own schedule, maybe with --warmup-steps
        if args.lr is not None and kind in ("WarmupLR", "WarmupDecayLR"):
            _set(cfg, "scheduler.params.warmup_max_lr", args.lr, "--lr", notes)
        elif args.lr is not None and kind == "OneCycle":
            raise InputError("--lr has no effect under the config's OneCycle schedule: its "
                             "rates are scheduler.params.cycle_min_lr and cycle_max_lr")
        return
    lr = args.lr if args.lr is not None else _get(cfg, "optimizer.params.lr") or DEFAULTS["lr"]
    if kind in ("WarmupLR", "WarmupDecayLR"):
        _set(cfg, "scheduler.params.warmup_max_lr", lr, "--lr-schedule", notes)
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        _set(cfg, "scheduler.params.total_num_steps", args.steps, "--lr-schedule", notes)


def _data_parallel_size(cfg: dict, args, world_size: int, notes: list) -> int:
    """--tp, --sequence-parallel and --pp into `cfg` (tensor_parallel.autotp_size,
    tensor_parallel.sequence_parallel, pipeline.stages); returns the data-parallel size,
    world_size / (tp x pp), over which the global batch splits."""
    from zmpi.config import Config
    from zmpi.parallel.mesh import mesh_sizes

    for flag, path in (("tp", "tensor_parallel.autotp_size"), ("pp", "pipeline.stages"),
                       ("sequence_parallel", "tensor_parallel.sequence_parallel")):
        if getattr(args, flag, None) is not None:
            _set(cfg, path, getattr(args, flag), f"--{flag.replace('_', '-')}", notes)
    sizes = Config.from_dict({k: cfg[k] for k in ("tensor_parallel", "pipeline") if k in cfg})
    try:
        dp, _, _ = mesh_sizes(world_size, sizes.tensor_parallel.autotp_size,
                              sizes.pipeline.stages)
    except ValueError as e:
        raise InputError(str(e)) from None
    return dp


def build_config(args, world_size: int, notes: list | None = None) -> dict:
    """DeepSpeed-style config: --config file if given, else defaults; flags override it, and
    each override of a value the config set is described in `notes` (the CLI prints them).
    "auto" values that follow from the flags are filled in (and noted).

    The global batch (--batch, or the config's train_batch_size) counts sequences per optimizer
    step over all data-parallel ranks (world_size / (tp x pp)) and accumulation steps; it must
    split evenly over both.
    """
    from zmpi.config import AUTO, Config, ModelConfig
    from zmpi.words import count

    notes = [] if notes is None else notes
    cfg = _read_config(args.config) if args.config else {}
    # the batch keys' types and ranges (the engine's own checks) before any arithmetic on them
    Config.from_dict({k: cfg[k] for k in Config._BATCH if k in cfg})
    world_size = _data_parallel_size(cfg, args, world_size, notes)  # the batch splits over dp
    _fill_auto(cfg, notes, args)
    micro_given = isinstance(cfg.get("train_micro_batch_size_per_gpu"), int)
    if cfg.get("train_batch_size") == AUTO and (args.batch is not None or not micro_given):
        cfg["train_batch_size"] = args.batch if args.batch is not None else DEFAULTS["batch"]
        notes.append(f"train_batch_size: 'auto' is {cfg['train_batch_size']} "
                     f"({'--batch' if args.batch is not None else 'the default'})")
    accumulation = cfg.get("gradient_accumulation_steps", 1)
    if AUTO in (accumulation, cfg.get("train_micro_batch_size_per_gpu")):
        if args.batch is not None:  # the engine derives the "auto" keys from the batch
            _set(cfg, "train_batch_size", args.batch, "--batch", notes)
    elif args.batch is not None or "train_micro_batch_size_per_gpu" not in cfg:
        if args.batch is not None:
            batch, source = args.batch, "--batch"
        elif cfg.get("train_batch_size") is not None:  # checked above: an int >= 1
            batch, source = cfg["train_batch_size"], f"train_batch_size in {args.config}"
        else:
            batch, source = DEFAULTS["batch"], "the default"
        if batch < 1:
            raise InputError(f"--batch must be >= 1, got {batch}")
        if batch % (world_size * accumulation):
            raise InputError(f"global batch {batch} ({source}) does not split over "
                             f"{count(world_size, 'data-parallel rank')} x "
                             f"{count(accumulation, 'accumulation step')}")
        _set(cfg, "train_micro_batch_size_per_gpu", batch // (world_size * accumulation),
             "--batch", notes)
        _set(cfg, "train_batch_size", batch, "--batch", notes)
    if "optimizer" not in cfg:
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": args.lr if args.lr is not None else DEFAULTS["lr"]}}
    elif args.lr is not None:
        _set(cfg, "optimizer.params.lr", args.lr, "--lr", notes)
    _schedule_from_flags(cfg, args, notes)
    cfg.setdefault("gradient_clipping", 1.0)
    if args.stage is not None or not (args.config or args.strategy):
        stage = DEFAULT_STAGE if args.stage is None else args.stage
        _set(cfg, "zero_optimization.stage", stage, "--stage", notes)
    if args.strategy is not None:
        _set(cfg, "zero_optimization.strategy", args.strategy, "--strategy", notes)
    strategy = _get(cfg, "zero_optimization.strategy") or None
    built_in = strategy in ("stage0", "stage1", "stage2", "stage3")  # others: _check_stage_agrees
    if args.stage is not None and built_in and strategy != f"stage{args.stage}":
        raise InputError(f"--stage {args.stage} contradicts the strategy "
                         f"{strategy!r} (from {'--strategy' if args.strategy else '--config'}); "
                         "give one of them")
    if args.precision is not None:  # one of fp16/bf16 on, or neither (fp32, fp64: the model's)
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
    if args.recompute is not None:
        _set(cfg, "activation_checkpointing.recompute", args.recompute, "--recompute", notes)
    if getattr(args, "profile", False) and (  # --profile times the recomputes too
            _get(cfg, "activation_checkpointing.recompute") == "full"
            or _get(cfg, "pipeline.activation_checkpoint_interval")):
        _set(cfg, "activation_checkpointing.profile", True, "--profile", notes)
    if getattr(args, "sparse_attention", None) is not None:
        _sparse_attention_from_flag(cfg, args.sparse_attention, notes)
    for flag, key, *_ in MOE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            _set(cfg, f"moe.{key}", value, flag, notes)
    if getattr(args, "model", None) is not None:
        _set(cfg, "model.model_type", args.model, "--model", notes)
    llama = _get(cfg, "model.model_type") == "llama"  # the flags set its names of the shape
    for name in MODEL_FLAGS:
        key = ModelConfig.LLAMA_NAMES.get(name, name) if llama else name
        _set(cfg, f"model.{key}", getattr(args, name), f"--{name.replace('_', '-')}", notes)
    cfg.setdefault("seed", 0)
    return cfg


def _sparse_attention_from_flag(cfg: dict, mode: str, notes: list) -> None:
    """--sparse-attention MODE: the config's sparse_attention section if it is of that mode
    already (its keys kept), else {"mode": MODE} (that mode's defaults), with a note naming
    the section it replaces. "none" removes the section (dense attention)."""
    from zmpi.nn.sparsity import DEFAULT_MODE

    section = cfg.get("sparse_attention")
    given = section.get("mode", DEFAULT_MODE) if isinstance(section, dict) and section else None
    if given == mode:
        return
    if section:
        notes.append(f"--sparse-attention {mode} replaces the config's sparse_attention "
                     f"{json.dumps(section)}")
    if mode == "none":
        cfg.pop("sparse_attention", None)
    else:
        cfg["sparse_attention"] = {"mode": mode}

"""Typed, validated training config that reads DeepSpeed-style JSON.

Every section is a frozen dataclass whose fields are type-checked and validated on
construction, so a `Config` that exists is a valid one. `Config.from_json` accepts the
DeepSpeed schema users know (https://www.deepspeed.ai/docs/config-json/) restricted to what
zmpi implements; unknown keys are errors that name the full key path, list the allowed keys and
suggest the closest one. Example (`configs/gpt_stage2_fp16.json`)::

    {
      "train_batch_size": 32,
      "train_micro_batch_size_per_gpu": 8,
      "gradient_accumulation_steps": 2,
      "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW",
                    "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                               "weight_decay": 0.1}},
      "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16},
      "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000000,
                            "overlap_comm": true}
    }

Usage::

    cfg = Config.from_json("configs/gpt_stage2_fp16.json").resolve_batch(world_size=2)
    cfg.dtype_name, cfg.strategy_name            # ('float16', 'stage2')
    cfg.replace(zero_optimization={"stage": 3})  # a new, re-validated Config

zmpi extensions to the schema: `zero_optimization.strategy` (a registered strategy name, an
installed "zmpi.strategies" entry point or "package.module:ClassName"; default
f"stage{stage}"; resolved by the engine through zmpi.zero.get_strategy, not here) and
`zero_optimization.prefetch` (stage-3 prefetch of the next unit) and
`zero_optimization.shard_group_size` (the `hybrid` strategies' group of G ranks; an error for
a strategy that does not split the ranks). This module imports no MPI.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

__all__ = ["ConfigError", "OptimizerConfig", "SchedulerConfig", "FP16Config", "BF16Config",
           "OffloadConfig", "OffloadParamConfig", "ZeroConfig", "DebugConfig",
           "MemoryBudgetConfig", "Config"]


class ConfigError(ValueError):
    """A config problem; `key` is the dotted path of the offending key ('' for the root)."""

    def __init__(self, key: str, msg: str):
        self.key, self.msg = key, msg
        super().__init__(f"{key}: {msg}" if key else msg)

    def __reduce__(self):  # picklable, e.g. to send across ranks
        return (ConfigError, (self.key, self.msg))

    def prefixed(self, prefix: str) -> ConfigError:
        return ConfigError(f"{prefix}.{self.key}" if self.key else prefix, self.msg)


def _type_name(tp) -> str:
    if tp is type(None):
        return "null"
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        return f"list of {len(args)} numbers"
    if args:  # X | None
        return " or ".join(_type_name(a) for a in args)
    return "object" if dataclasses.is_dataclass(tp) else tp.__name__


def _coerce(key: str, value, tp):
    """Check `value` against the annotation `tp`; return it normalised (int->float, list->tuple,
    dict->section, integral float->int as DeepSpeed's "5e8" bucket sizes need). Booleans are
    neither ints nor floats."""
    bad = ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} ({value!r})")
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise bad
        return tuple(_coerce(f"{key}[{i}]", v, a)
                     for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if args:  # Optional[X], written X | None
        if value is None:
            return None
        try:
            return _coerce(key, value, next(a for a in args if a is not type(None)))
        except ConfigError as e:  # a mismatch here names the full type, 'int or null'
            raise (bad if e.key == key else e) from None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            try:
                return tp.from_dict(value)
            except ConfigError as e:
                raise e.prefixed(key) from None
        raise bad
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
        raise bad
    return value


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(key, msg)


AUTO = "auto"


class _Section:
    """Mixin for the frozen dataclasses below: type checks on construction, then `_validate`.

    Besides its fields, a section accepts DeepSpeed keys that zmpi handles without a field:
    `_ALWAYS` maps a key to (the value zmpi always behaves as, what that is); another value is
    an error. `_INERT` maps a key to why it has no effect in zmpi; any value is accepted and
    `notes()` lists it. `_AUTO_DEFAULT`: fields whose "auto" means zmpi's default. Everything
    else is an unknown key.
    """

    _ALWAYS: dict = {}
    _INERT: dict = {}
    _AUTO_DEFAULT: tuple = ()
    _own_notes: tuple = ()

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name), hints[f.name]))
        self._validate()

    def _validate(self) -> None:
        pass

    def _at_least(self, lo, *keys, strict=False, note=""):
        """Check that each (non-None) field in `keys` is >= lo (> lo if strict)."""
        for k in keys:
            v = getattr(self, k)
            if v is not None and not (v > lo if strict else v >= lo):
                raise ConfigError(k, f"must be {'>' if strict else '>='} {lo}{note}, got {v}")

    @classmethod
    def _check_keys(cls, d, allowed) -> None:
        if not isinstance(d, Mapping):
            raise ConfigError("", f"expected object, got {type(d).__name__} ({d!r})")
        for k in d:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(str(k), f"unknown key; {hint}allowed keys: {', '.join(allowed)}")

    @classmethod
    def from_dict(cls, d: Mapping):
        """Build from a JSON-style dict; missing keys take their defaults."""
        cls._check_keys(d, [f.name for f in fields(cls)] + list(cls._ALWAYS) + list(cls._INERT))
        kwargs, notes = cls._special_keys(d)
        obj = cls(**kwargs)
        object.__setattr__(obj, "_own_notes", tuple(notes))
        return obj

    @classmethod
    def _special_keys(cls, d: Mapping) -> tuple[dict, list[str]]:
        """(the field values of `d`, notes): `_ALWAYS` keys checked, `_INERT` keys noted,
        "auto" resolved to the default where `_AUTO_DEFAULT` allows it."""
        kwargs, notes = {}, []
        for k, v in d.items():
            if k in cls._INERT:
                notes.append(f"{k}: accepted without effect ({cls._INERT[k]})")
            elif k in cls._ALWAYS:
                want, behaviour = cls._ALWAYS[k]
                _check(v == want or v == AUTO, k, f"zmpi always {behaviour} (only {want!r} is "
                       f"supported), got {v!r}")
            elif isinstance(v, str) and v == AUTO:
                _check(k in cls._AUTO_DEFAULT, k, "'auto' has nothing to be derived from "
                       "here; give a value (zmpi train fills optimizer, scheduler, "
                       "gradient_clipping and fp16/bf16 'auto' values from its flags)")
                notes.append(f"{k}: 'auto' is zmpi's default, "
                             f"{next(f.default for f in fields(cls) if f.name == k)!r}")
            else:
                kwargs[k] = v
        return kwargs, notes

    def notes(self) -> list[str]:
        """What this section (and its subsections, as dotted paths) accepted without effect or
        resolved from "auto": one line each, for the engine to print once."""
        out = list(self._own_notes)
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                out += [f"{f.name}.{n}" for n in v.notes()]
        return out

    def to_dict(self) -> dict:
        """JSON-ready dict that `from_dict` maps back to an equal object (None keys omitted)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            if v is not None:
                out[f.name] = v
        return out

    def replace(self, **kw):
        """A copy with fields replaced and re-validated; a dict for a section updates it."""
        for k, v in kw.items():
            cur = getattr(self, k, None)
            if isinstance(cur, _Section) and isinstance(v, Mapping):
                try:
                    kw[k] = cur.replace(**v)
                except ConfigError as e:
                    raise e.prefixed(k) from None
        try:
            new = dataclasses.replace(self, **kw)
        except TypeError as e:  # unknown field name
            raise ConfigError("", str(e)) from None
        names = {f.name for f in fields(self)}
        for k, v in vars(self).items():  # what from_dict recorded: notes, "auto" batch keys
            if k not in names:
                object.__setattr__(new, k, v)
        return new


_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW"}


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """Adam(W). JSON form: {"type": "AdamW", "params": {"lr", "betas", "eps", "weight_decay",
    "adam_w_mode"}}.

    `type` is case-insensitive and normalised to "Adam" or "AdamW". As in DeepSpeed, "Adam"
    decays the weights directly (AdamW; Loshchilov & Hutter, ICLR'19) unless `adam_w_mode` is
    false, which adds weight decay to the gradient instead (L2, torch.optim.Adam).
    """

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.type == "AdamW" or self.adam_w_mode

    def _validate(self):
        _check(self.type.lower() in _OPTIMIZERS, "type",
               f"unknown optimizer {self.type!r}; allowed: {', '.join(_OPTIMIZERS.values())}")
        object.__setattr__(self, "type", _OPTIMIZERS[self.type.lower()])
        self._at_least(0, "lr", "eps", strict=True)
        self._at_least(0, "weight_decay")
        for i, b in enumerate(self.betas):
            _check(0.0 <= b < 1.0, f"betas[{i}]", f"must be in [0, 1), got {b}")

    @classmethod
    def from_dict(cls, d):
        cls._check_keys(d, ["type", "params"])
        params = d.get("params", {})
        try:
            cls._check_keys(params, [f.name for f in fields(cls) if f.name != "type"])
            params, _ = cls._special_keys(params)  # "auto" is an error here
        except ConfigError as e:
            raise e.prefixed("params") from None
        try:
            return cls(**({"type": d["type"]} if "type" in d else {}), **params)
        except ConfigError as e:
            raise (e if e.key == "type" else e.prefixed("params")) from None

    def to_dict(self):
        flat = super().to_dict()
        return {"type": flat.pop("type"), "params": flat}


@dataclass(frozen=True)
class SchedulerConfig(_Section):
    """`scheduler`: a learning-rate schedule, {"type": "WarmupDecayLR", "params": {...}}, with
    DeepSpeed's types, parameters, defaults and step semantics (zmpi.optim.lr_schedules:
    WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle). No type: the optimizer's lr."""

    type: str | None = None
    params: dict = field(default_factory=dict)

    def _validate(self):
        if self.type is None:
            _check(not self.params, "params", "given without a scheduler type")
            return
        from zmpi.optim.lr_schedules import check_params

        for k, v in self.params.items():
            _check(v != AUTO, f"params.{k}", "'auto' has nothing to be derived from here; "
                   "give a value (zmpi train fills it from --steps, --warmup-steps and --lr)")
        try:
            check_params(self.type, self.params)
        except ValueError as e:
            key, _, msg = str(e).partition(": ")
            if key.startswith("params."):
                raise ConfigError(key, msg) from None
            raise ConfigError("type", str(e)) from None


@dataclass(frozen=True)
class FP16Config(_Section):
    """fp16 mixed precision; `loss_scale` 0 means dynamic scaling starting at
    2**initial_scale_power, halved on overflow after `hysteresis` overflows, doubled after
    `loss_scale_window` clean steps, never below `min_loss_scale` (DeepSpeed semantics)."""

    _ALWAYS = {
        "consecutive_hysteresis": (False, "restores the hysteresis only when the scale grows"),
        "fp16_master_weights_and_grads": (False, "keeps fp32 master weights"),
    }
    _INERT = {"auto_cast": "layers cast their inputs to the compute dtype"}

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    def _validate(self):
        self._at_least(0, "loss_scale", note=" (0 = dynamic)")
        self._at_least(1, "loss_scale_window", "hysteresis")
        self._at_least(0, "min_loss_scale", strict=True)
        _check(0 <= self.initial_scale_power <= 64, "initial_scale_power",
               f"must be in 0..64, got {self.initial_scale_power}")


@dataclass(frozen=True)
class BF16Config(_Section):
    """bfloat16 mixed precision (no loss scaling needed: bf16 has fp32's exponent range)."""

    enabled: bool = False


_OFFLOAD_DEVICES = ("none", "cpu")


@dataclass(frozen=True)
class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: keep stage 3's parameter shards in host memory
    (ZeRO-Infinity's CPU tier); a unit reaches the device only while it is gathered.
    `pin_memory`: page-locked host buffers (faster, asynchronous copies on a GPU)."""

    _INERT = {"buffer_count": "host buffers are allocated per state, not pooled",
              "buffer_size": "host buffers are allocated per state, not pooled",
              "max_in_cpu": "every offloaded shard is in host memory",
              "nvme_path": "there is no NVMe tier", "fast_init": "initialisation is on the host"}

    device: str = "none"
    pin_memory: bool = False

    def _validate(self):
        _check(self.device != "nvme", "device",
               "'nvme' (ZeRO-Infinity's NVMe tier) is not implemented in zmpi; use 'cpu' or "
               "'none'")
        _check(self.device in _OFFLOAD_DEVICES, "device",
               f"must be one of {', '.join(map(repr, _OFFLOAD_DEVICES))}, got {self.device!r}")

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"


@dataclass(frozen=True)
class OffloadConfig(OffloadParamConfig):
    """`zero_optimization.offload_optimizer`: fp32 master weights, Adam's moments and the
    update on the host (ZeRO-Offload, Ren et al., ATC'21); stages 1-3.

    zmpi extension: `delay_update` turns on the one-step delayed parameter update (DPU, ATC'21
    Sec. 5.2) after `delay_update_warmup` synchronous steps (the paper uses 40): the host Adam
    of step t runs in a background thread while forward and backward of step t+1 use the
    parameters of step t-1.
    """

    _ALWAYS = {"ratio": (1.0, "offloads the whole optimizer state")}

    delay_update: bool = False
    delay_update_warmup: int = 40

    def _validate(self):
        super()._validate()
        self._at_least(0, "delay_update_warmup")
        _check(self.enabled or not self.delay_update, "delay_update",
               'needs the optimizer on the host: set "device": "cpu"')


@dataclass(frozen=True)
class ZeroConfig(_Section):
    """`zero_optimization`: which stage (or registered strategy) and how it communicates.

    Buckets: `reduce_bucket_size` elements of consecutive units per gradient allreduce (stage
    0) or reduce-scatter (stage 1), launched as backward completes the bucket on the last
    micro-step; stages 2-3 reduce each unit as its backward ends. `allgather_bucket_size`
    elements per allgather of updated shards (stages 1-2). A unit of 16 Ki elements or more
    is always sent alone (`Strategy.solo_numel`).
    Stage 3 keys that act: `stage3_prefetch_bucket_size` (elements of the following units
    whose allgather starts before the current unit computes; default: one unit, zmpi's
    `prefetch`), `stage3_param_persistence_threshold` (units of at most this many elements
    stay gathered for the whole run and are refreshed once per step, trading memory for two
    allgathers per step; default 0, none) and `stage3_max_live_parameters` (an error if the
    units zmpi keeps gathered at once exceed it). The other DeepSpeed keys are in `_ALWAYS`
    and `_INERT` (README, "Config keys").
    """

    _ALWAYS = {
        "contiguous_gradients": (True, "keeps gradients in one flat buffer per unit"),
        "allgather_partitions": (True, "allgathers parameter partitions"),
        "reduce_scatter": (True, "reduce-scatters gradients (stages 1-3)"),
        "load_from_fp32_weights": (True, "restores parameters from the fp32 master weights"),
        "zero_quantized_weights": (False, "communicates weights in the storage dtype"),
        "zero_quantized_gradients": (False, "communicates gradients in the storage dtype"),
        "zero_hpz_partition_size": (1, "keeps one parameter partition (for hierarchical "
                                       "partitioning use \"strategy\": \"hybrid\")"),
        "mics_shard_size": (-1, "shards over the whole world unless \"strategy\": "
                                "\"hybrid\" with \"shard_group_size\" is set"),
        "cpu_offload": (False, "offloads through offload_optimizer (set \"device\": \"cpu\")"),
    }
    _INERT = {
        "round_robin_gradients": "gradient shards are copied to the host unit by unit",
        "sub_group_size": "Adam already updates the shard in chunks",
        "stage3_max_reuse_distance": "a released unit is always gathered again when used "
                                     "(reuse distance 0)",
        "stage3_gather_16bit_weights_on_model_save": "use `zmpi ckpt consolidate`",
        "gather_16bit_weights_on_model_save": "use `zmpi ckpt consolidate`",
        "elastic_checkpoint": "every checkpoint loads at any world size",
        "ignore_unused_parameters": "unused parameters get zero gradients",
        "memory_efficient_linear": "zmpi's Linear keeps only its input",
    }
    _AUTO_DEFAULT = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters")

    stage: int = 0
    strategy: str | None = None
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    prefetch: bool = True
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int = 0
    stage3_max_live_parameters: int | None = None
    shard_group_size: int | None = None
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)

    def _validate(self):
        _check(self.stage in (0, 1, 2, 3), "stage", f"must be one of 0, 1, 2, 3, got {self.stage}")
        _check(self.strategy is None or self.strategy != "", "strategy", "must not be empty")
        self._at_least(1, "reduce_bucket_size", "allgather_bucket_size")
        self._at_least(0, "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                       "stage3_max_live_parameters")
        _check(self.shard_group_size is None or self.shard_group_size >= 1, "shard_group_size",
               f"must be >= 1, got {self.shard_group_size}")

    @property
    def strategy_name(self) -> str:
        return self.strategy if self.strategy is not None else f"stage{self.stage}"


@dataclass(frozen=True)
class MemoryBudgetConfig(_Section):
    """`memory_budget` (zmpi's): the bytes each rank may hold on the device and on the host,
    as the MemoryLedger counts them (model states, gathered units, communication buffers); an
    allocation beyond raises zmpi.memory.OutOfMemory naming the buffer and what is held. For
    experiments that find the largest trainable model, and for GPUs shared with others."""

    device: int | None = None
    host: int | None = None

    def _validate(self):
        self._at_least(1, "device", "host")


@dataclass(frozen=True)
class DebugConfig(_Section):
    """`debug` (zmpi's): `check_collectives` compares every collective's op, dtype and size
    across ranks before it runs (also ZMPI_DEBUG=1); `check_replicas_every` K > 0 compares
    the replicated state of every rank every K steps (0: never)."""

    check_collectives: bool = False
    check_replicas_every: int = 0

    def _validate(self):
        self._at_least(0, "check_replicas_every")


@dataclass(frozen=True)
class Config(_Section):
    """The whole training config. Batch rule (DeepSpeed): train_batch_size ==
    train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size; see
    `resolve_batch`, which also derives the batch keys given as "auto"."""

    _ALWAYS = {
        "prescale_gradients": (False, "divides the summed gradients once, after reducing"),
        "gradient_predivide_factor": (1.0, "divides the summed gradients once, after reducing"),
        "sparse_gradients": (False, "communicates dense gradients"),
        "communication_data_type": (None, "communicates in the parameters' storage dtype"),
    }
    _INERT = {
        "wall_clock_breakdown": "zmpi train reports tokens/s and the DPU timing",
        "memory_breakdown": "the MemoryLedger always counts (engine.memory.report())",
        "zero_allow_untested_optimizer": "zmpi runs its own Adam(W) only",
        "activation_checkpointing": "zmpi does not checkpoint activations: activation memory "
                                    "is not reduced",
        "flops_profiler": "no FLOP profiler", "tensorboard": "no monitor backends",
        "wandb": "no monitor backends", "csv_monitor": "zmpi train writes metrics.csv",
        "comms_logger": "Comm counts every collective (engine.traffic())",
        "checkpoint": "zmpi checkpoints are configured by save_checkpoint's arguments",
        "dump_state": "see engine.describe()",
    }
    _BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    _auto_batch = frozenset()  # batch keys given as "auto", derived by resolve_batch

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int = 1
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    memory_budget: MemoryBudgetConfig = field(default_factory=MemoryBudgetConfig)
    seed: int = 0
    steps_per_print: int = 10

    def _validate(self):
        self._at_least(1, "train_batch_size", "train_micro_batch_size_per_gpu",
                       "gradient_accumulation_steps", "steps_per_print")
        self._at_least(0, "gradient_clipping", note=" (0 = off)")
        self._at_least(0, "seed")
        _check(not (self.fp16.enabled and self.bf16.enabled), "fp16.enabled",
               "fp16 and bf16 are both enabled; enable at most one")

    @classmethod
    def from_dict(cls, d: Mapping) -> Config:
        autos = frozenset(k for k in cls._BATCH
                          if isinstance(d, Mapping) and isinstance(d.get(k), str)
                          and d[k] == AUTO)
        obj = super().from_dict({k: v for k, v in d.items() if k not in autos}
                                if autos else d)
        object.__setattr__(obj, "_auto_batch", autos)
        return obj

    @classmethod
    def from_json(cls, path_or_str: str | os.PathLike) -> Config:
        """Load from a file path, or from a JSON string if it starts with '{'."""
        text = str(path_or_str)
        if not text.lstrip().startswith("{"):
            with open(path_or_str, encoding="utf-8") as fh:
                text = fh.read()
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("", f"invalid JSON in {path_or_str!s:.60}: {e}") from None
        return cls.from_dict(d)

    @property
    def dtype_name(self) -> str:
        """Storage/communication dtype of parameters and gradients."""
        return "float16" if self.fp16.enabled else "bfloat16" if self.bf16.enabled else "float32"

    @property
    def strategy_name(self) -> str:
        return self.zero_optimization.strategy_name

    def resolve_batch(self, world_size: int) -> Config:
        """Fill in train_batch_size (or check it) for `world_size` ranks; raise ConfigError if
        train_batch_size != micro * grad_accum * world_size."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError("world_size", f"must be an int >= 1, got {world_size!r}")
        if self._auto_batch:
            return self._derive_auto_batch(world_size).resolve_batch(world_size)
        micro, accum = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        product = micro * accum * world_size
        if self.train_batch_size is None:
            return self.replace(train_batch_size=product)
        if self.train_batch_size != product:
            q, r = divmod(self.train_batch_size, micro * world_size)
            hint = f"; gradient_accumulation_steps={q} would match" if r == 0 and q else ""
            raise ConfigError(
                "train_batch_size",
                f"{self.train_batch_size} != train_micro_batch_size_per_gpu ({micro}) * "
                f"gradient_accumulation_steps ({accum}) * world_size ({world_size}) "
                f"= {product}{hint}")
        return self

    def replace(self, **kw) -> Config:
        new = super().replace(**kw)
        object.__setattr__(new, "_auto_batch", self._auto_batch - set(kw))  # given: not auto
        return new

    def _derive_auto_batch(self, world_size: int) -> Config:
        """The batch keys given as "auto" derived from the others and the world size (an
        "auto" accumulation is 1 when the micro-batch or the global batch is "auto" too)."""
        auto, batch = self._auto_batch, self.train_batch_size
        micro, accum = self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        derived = {}
        if batch is None and "train_micro_batch_size_per_gpu" not in auto:
            derived = {"gradient_accumulation_steps": 1} if "gradient_accumulation_steps" in \
                auto else {}  # nothing to split: DeepSpeed's accumulation of 1
        elif "train_micro_batch_size_per_gpu" in auto or "gradient_accumulation_steps" in auto:
            key = ("train_micro_batch_size_per_gpu" if "train_micro_batch_size_per_gpu" in auto
                   else "gradient_accumulation_steps")
            _check(batch is not None, key, "'auto' needs train_batch_size (a number)")
            accum = 1 if "gradient_accumulation_steps" in auto else accum
            other = accum if key == "train_micro_batch_size_per_gpu" else micro
            _check(batch % (other * world_size) == 0, key,
                   f"'auto': train_batch_size {batch} does not split over {world_size} ranks x "
                   f"{other}")
            derived = {"gradient_accumulation_steps": accum,
                       key: batch // (other * world_size)}
        new = self.replace(**derived)
        object.__setattr__(new, "_auto_batch", frozenset())
        object.__setattr__(new, "_own_notes", self._own_notes + tuple(
            f"{k}: 'auto' is {getattr(new, k) if k != 'train_batch_size' else 'derived'}"
            for k in sorted(auto)))
        return new


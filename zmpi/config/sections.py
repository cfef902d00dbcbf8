"""The smaller DeepSpeed sections of zmpi.config: `optimizer`, `scheduler`, `fp16`, `bf16`,
`tensor_parallel`, `pipeline`, `activation_checkpointing`, and zmpi's own `debug` and
`memory_budget`.

`zero_optimization` and its offload subsections are in zmpi.config.zero; the top-level
`Config` is in zmpi.config.core. This module imports no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from .base import AUTO, ConfigError, _check, _Section
from .onebit import ONEBIT, ONEBIT_ALWAYS, check_onebit_fields, onebit_params

__all__ = ["OptimizerConfig", "SchedulerConfig", "FP16Config", "BF16Config",
           "TensorParallelConfig", "PipelineConfig", "ActivationCheckpointingConfig",
           "DebugConfig", "MemoryBudgetConfig", "ModelConfig", "AioConfig", "RECOMPUTE"]


_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", ONEBIT.lower(): ONEBIT}


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """Adam(W). JSON form: {"type": "AdamW", "params": {"lr", "betas", "eps", "weight_decay",
    "adam_w_mode"}}.

    `type` is case-insensitive and normalised to "Adam", "AdamW" or "OneBitAdam". As in
    DeepSpeed, "Adam" decays the weights directly (AdamW; Loshchilov & Hutter, ICLR'19) unless
    `adam_w_mode` is false, which adds weight decay to the gradient instead (L2,
    torch.optim.Adam). "OneBitAdam" is 1-bit Adam (docs/onebit.md) with DeepSpeed's
    `freeze_step` (default 100000), `cuda_aware` and `comm_backend_name`, and its other keys
    at the values zmpi always behaves as (zmpi.config.onebit); they are errors with Adam(W).
    """

    _COUNTS = ("freeze_step",)

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True
    freeze_step: int | None = None  # OneBitAdam: the steps of plain Adam before compressing
    cuda_aware: bool | None = None  # OneBitAdam: whether MPI takes device buffers (checked)
    comm_backend_name: str | None = None  # OneBitAdam: "mpi"

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
        for k, v in check_onebit_fields(self).items():  # OneBitAdam's keys (and defaults)
            object.__setattr__(self, k, v)

    @classmethod
    def from_dict(cls, d):
        cls._check_keys(d, ["type", "params"])
        params = d.get("params", {})
        try:
            cls._check_keys(params, [f.name for f in fields(cls) if f.name != "type"]
                            + list(ONEBIT_ALWAYS))
            params, _ = cls._special_keys(params)  # "auto" is an error here
        except ConfigError as e:
            raise e.prefixed("params") from None
        params = onebit_params(d.get("type"), params)  # OneBitAdam's fixed DeepSpeed keys
        try:
            return cls(**({"type": d["type"]} if "type" in d else {}), **params)
        except ConfigError as e:
            raise (e if e.key == "type" else e.prefixed("params")) from None

    def to_dict(self):
        flat = super().to_dict()
        return {"type": flat.pop("type"), "params": flat}


# what zmpi train puts in place of a scheduler parameter's "auto" (zmpi.cli.config_from_flags)
_TRAIN_FILLS = {"total_num_steps": "fills it from --steps", "warmup_max_lr": "fills it from --lr",
                "warmup_min_lr": "makes it 0", "warmup_num_steps": "takes it from --warmup-steps"}


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
            hint = f" (zmpi train {_TRAIN_FILLS[k]})" if k in _TRAIN_FILLS else ""
            _check(v != AUTO, f"params.{k}",
                   f"'auto' has nothing to be derived from here; give a value{hint}")
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
    `loss_scale_window` clean steps, never below `min_loss_scale` (DeepSpeed semantics). A
    static `loss_scale` never changes: `hysteresis` overflows in a row end the run, and so
    does one below 1 that flushes every gradient to zero (zmpi.engine.step)."""

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

    def notes(self) -> list[str]:
        scaling = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                   "min_loss_scale")
        return super().notes() + ([] if self.enabled else
                                  self._idle(scaling, "with fp16 disabled"))


@dataclass(frozen=True)
class BF16Config(_Section):
    """bfloat16 mixed precision (no loss scaling needed: bf16 has fp32's exponent range)."""

    enabled: bool = False


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
class ModelConfig(_Section):
    """`model` (zmpi's): the GPT shape the config is for (what `zmpi plan` writes): n_layer,
    d_model, n_head, seq_len and vocab_size (the model's vocabulary, at least the data's;
    None: the data's). `zmpi train` builds this model (its flags override a key, with a
    note); an Engine given another model raises ConfigError naming the key. Empty: any.
    `vocab_multiple`: the token table padded to a multiple of it (times tp) for aligned LM-head
    GEMMs; None: 128 on a GPU, 1 on a CPU (docs/gpu.md). Not a shape: a checkpoint loads
    across paddings.

    `model_type` "llama" (`zmpi train --model llama`; docs/models.md) makes it a Llama's
    shape, in transformers' LlamaConfig names: hidden_size, num_hidden_layers and
    num_attention_heads in place of d_model, n_layer and n_head (those GPT names are then
    refused, naming the Llama's), and intermediate_size, num_key_value_heads,
    max_position_embeddings, rms_norm_eps, rope_theta, rope_scaling, tie_word_embeddings (all
    refused for a GPT). seq_len, vocab_size and vocab_multiple serve both. rope_scaling's
    keys are checked where the model is built (zmpi.nn.llama_functional.rope_inv_freq: this
    package imports no layer code)."""

    model_type: str | None = None  # None: "gpt"
    n_layer: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    vocab_multiple: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    intermediate_size: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    tie_word_embeddings: bool | None = None

    SHAPE = ("n_layer", "d_model", "n_head", "seq_len", "vocab_size")
    TYPES = ("gpt", "llama")
    # zmpi's GPT names -> a Llama's (transformers' LlamaConfig names) for the same setting
    LLAMA_NAMES = {"n_layer": "num_hidden_layers", "d_model": "hidden_size",
                   "n_head": "num_attention_heads"}
    LLAMA_ONLY = ("intermediate_size", "num_key_value_heads", "max_position_embeddings",
                  "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings")

    def _validate(self):
        _check(self.model_type in (None, *self.TYPES), "model_type",
               f"{self.model_type!r}: use {' or '.join(map(repr, self.TYPES))}")
        llama = self.model_type == "llama"
        for gpt_name, llama_name in self.LLAMA_NAMES.items():
            wrong, right = (gpt_name, llama_name) if llama else (llama_name, gpt_name)
            _check(getattr(self, wrong) is None, wrong,
                   f"a {'GPT' if llama else 'Llama'} key; model_type "
                   f"{self.model_type or 'gpt'!r} names it {right}")
        for key in () if llama else self.LLAMA_ONLY:
            _check(getattr(self, key) is None, key, "a Llama key: set model_type \"llama\" "
                   "(zmpi train --model llama)")
        self._at_least(1, *self.SHAPE, "vocab_multiple", *self.LLAMA_NAMES.values(),
                       "intermediate_size", "num_key_value_heads", "max_position_embeddings")
        self._at_least(0, "rms_norm_eps", "rope_theta", strict=True)
        d, heads = self.shape_value("d_model"), self.shape_value("n_head")
        if d is not None and heads is not None:
            _check(d % heads == 0, self.shape_key("n_head"),
                   f"{heads} does not divide {self.shape_key('d_model')} {d}")
        kv = self.num_key_value_heads
        if kv is not None and heads is not None:
            _check(heads % kv == 0, "num_key_value_heads",
                   f"{kv} does not divide num_attention_heads {heads}")
        if self.max_position_embeddings is not None and self.seq_len is not None:
            _check(self.seq_len <= self.max_position_embeddings, "seq_len",
                   f"{self.seq_len} > max_position_embeddings {self.max_position_embeddings}")

    def shape_key(self, name: str) -> str:
        """This section's key for the GPT shape name `name` (a Llama's own name for n_layer,
        d_model and n_head)."""
        return self.LLAMA_NAMES.get(name, name) if self.model_type == "llama" else name

    def shape_value(self, name: str):
        """The value of the GPT shape name `name` under this section's key for it."""
        return getattr(self, self.shape_key(name))

    def given(self) -> dict:
        """{key: value} of the keys set (model_type where it is "llama")."""
        keys = [self.shape_key(k) for k in self.SHAPE] + list(self.LLAMA_ONLY)
        out = {"model_type": "llama"} if self.model_type == "llama" else {}
        return {**out, **{k: getattr(self, k) for k in keys if getattr(self, k) is not None}}


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
class TensorParallelConfig(_Section):
    """`tensor_parallel` (DeepSpeed's AutoTP section): `autotp_size` T, the tensor-parallel
    degree of the process mesh (zmpi.parallel.mesh); zmpi's `sequence_parallel` (true/false),
    sequence parallelism over the tensor ranks (docs/tensor-parallel.md). At T = 1 it changes
    nothing (as in Megatron-LM), and `notes()` says so."""

    autotp_size: int = 1
    sequence_parallel: bool = False

    def _validate(self):
        self._at_least(1, "autotp_size")

    def notes(self) -> list[str]:
        out = super().notes()
        if self.sequence_parallel and self.autotp_size == 1:
            out.append("sequence_parallel: no effect at autotp_size 1 (there is no tensor "
                       "group to split the sequence over)")
        return out


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ActivationCheckpointingConfig(_Section):
    """`activation_checkpointing` (DeepSpeed's section, and Megatron-LM's recompute
    granularities as zmpi's `recompute`): "none" (default) keeps every activation until its
    backward; "selective" recomputes only the attention core (the probabilities); "full"
    keeps each unit's input only and runs its forward again before its backward
    (docs/recompute.md). DeepSpeed's keys act on the inputs full recompute keeps (so they
    need it, or pipeline.activation_checkpoint_interval): `partition_activations` (each
    sharded over the tensor ranks), `cpu_checkpointing` (on the host),
    `contiguous_memory_optimization` with `number_checkpoints` (one buffer of that many
    slots), `synchronize_checkpoint_boundary` (a device synchronisation around each
    checkpointed forward and recompute) and `profile` (seconds per recompute, per unit)."""

    recompute: str = "none"
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    _ON_KEPT_INPUTS = ("partition_activations", "cpu_checkpointing",
                       "contiguous_memory_optimization", "synchronize_checkpoint_boundary",
                       "profile")

    def _validate(self):
        _check(self.recompute in RECOMPUTE, "recompute",
               f"{self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        self._at_least(1, "number_checkpoints")
        _check(self.contiguous_memory_optimization == (self.number_checkpoints is not None),
               "number_checkpoints", "sizes the buffer of contiguous_memory_optimization: give "
               "both (the most inputs kept at once: recomputed units, or groups of units, "
               "times micro-batches in flight) or neither")

    def options_set(self) -> list[str]:
        """The DeepSpeed keys set that act on kept inputs (they need full recompute)."""
        return [k for k in self._ON_KEPT_INPUTS if getattr(self, k)]


@dataclass(frozen=True)
class PipelineConfig(_Section):
    """`pipeline` (DeepSpeed's pipeline section): `stages` P, the pipeline-parallel degree of
    the process mesh; `partition`, how the model's units are split over the stages (DeepSpeed's
    partition_method: "parameters", "uniform" or "type:REGEX"); `schedule`, "1f1b" (default)
    or "gpipe", in any case (read as lower case; docs/pipeline.md);
    `activation_checkpoint_interval` k > 0, full recompute in groups of k units, each keeping
    one input (docs/recompute.md; at any number of stages). Micro-batches are
    gradient_accumulation_steps."""

    _ALWAYS = {
        "pipe_partitioned": (False, "sends each stage's activations whole from every tensor "
                                    "rank"),
        "grad_partitioned": (False, "sends each stage's activation gradients whole from every "
                                    "tensor rank"),
        "seed_layers": (False, "initialises every unit from the model's one seed"),
    }

    stages: int = 1
    partition: str = "parameters"
    schedule: str = "1f1b"
    activation_checkpoint_interval: int = 0

    def _validate(self):
        self._at_least(1, "stages")
        self._at_least(0, "activation_checkpoint_interval", note=" (0 = no recompute)")
        from zmpi.parallel.pipeline.partition import check_method
        from zmpi.parallel.pipeline.schedule import SCHEDULES

        _check(self.schedule.lower() in SCHEDULES, "schedule", f"{self.schedule!r}: use "
               f"one of {', '.join(SCHEDULES)}, in any case (the interleaved schedule is "
               "not built)")
        object.__setattr__(self, "schedule", self.schedule.lower())
        if isinstance(self.partition, str):  # any case, as DeepSpeed reads it; the regex as given
            method, colon, regex = self.partition.partition(":")
            object.__setattr__(self, "partition", method.lower() + colon + regex)
        try:
            check_method(self.partition)
        except ValueError as e:
            raise ConfigError("partition", str(e)) from None

    def notes(self) -> list[str]:
        return super().notes() + ([] if self.stages > 1 else
                                  self._idle(("partition", "schedule"), "at stages 1"))


@dataclass(frozen=True)
class AioConfig(_Section):
    """`aio` (DeepSpeed's asynchronous I/O section): how the NVMe tier
    (`offload_optimizer.device` "nvme", zmpi.offload) reads and writes its files. `block_size`:
    bytes per request (a multiple of 4096, the alignment of direct I/O); `queue_depth`:
    requests in flight at most; `thread_count`: the threads that issue them (pread/pwrite,
    which release the GIL) and checksum them, zmpi's default 4 (DeepSpeed's 1: one thread
    checksums each request in series with its transfer, 38-56 % of a pass measured, against
    +1 % with 4, docs/offload.md). No effect without NVMe offload."""

    _ALWAYS = {
        "single_submit": (False, "submits a buffer's requests together, up to queue_depth"),
        "overlap_events": (True, "keeps up to queue_depth requests in flight"),
        "use_gds": (False, "swaps through host buffers (no GPUDirect Storage)"),
    }

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 4

    def _validate(self):
        self._at_least(1, "queue_depth", "thread_count")
        _check(self.block_size >= 4096 and self.block_size % 4096 == 0, "block_size",
               f"must be a positive multiple of 4096 bytes (direct I/O), got {self.block_size}")

"""The top-level `Config` of zmpi.config: the whole training config, its sections, the
DeepSpeed batch rule (`resolve_batch`, batch keys given as "auto"), `from_dict` and
`from_json`. This module imports no MPI.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from zmpi.words import count

from .base import AUTO, ConfigError, _check, _Section, parse_json
from .moe import MoEConfig, check_moe_layout
from .onebit import check_onebit_layout
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    DebugConfig,
    FP16Config,
    MemoryBudgetConfig,
    ModelConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorParallelConfig,
)
from .sparse import SparseAttentionConfig
from .zero import ZeroConfig

__all__ = ["Config"]


@dataclass(frozen=True)
class Config(_Section):
    """The whole training config. Batch rule (DeepSpeed): train_batch_size ==
    train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp, dp the data-parallel
    size (world size / (tensor_parallel.autotp_size * pipeline.stages)); see `resolve_batch`,
    which also derives the batch keys given as "auto"."""

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
        "flops_profiler": "no FLOP profiler", "tensorboard": "no monitor backends",
        "wandb": "no monitor backends", "csv_monitor": "zmpi train writes metrics.csv",
        "comms_logger": "Comm counts every collective (engine.traffic())",
        "checkpoint": "zmpi checkpoints are configured by save_checkpoint's arguments",
        "dump_state": "see engine.describe()",
    }
    _BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    _COUNTS = (*_BATCH, "seed", "steps_per_print")  # no float, 3.0 neither
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
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    memory_budget: MemoryBudgetConfig = field(default_factory=MemoryBudgetConfig)
    aio: AioConfig = field(default_factory=AioConfig)  # the NVMe tier's file I/O
    model: ModelConfig = field(default_factory=ModelConfig)
    sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts blocks
    seed: int = 0
    steps_per_print: int = 10
    kernels: str = "fused"  # zmpi.kernels: one launch per fused op on a GPU, or "composed"
    tf32: bool = False  # float32 matmuls on TensorFloat-32 tensor cores (CuPy on Ampere+)
    attention_kernel: str = "blocked"  # kernels.flash_attention: "flash" fuses attention (CuPy)

    def _validate(self):
        self._at_least(1, "train_batch_size", "train_micro_batch_size_per_gpu",
                       "gradient_accumulation_steps", "steps_per_print")
        self._at_least(0, "gradient_clipping", note=" (0 = off)")
        self._at_least(0, "seed")
        _check(self.kernels in ("fused", "composed"), "kernels",
               f"{self.kernels!r}: use \"fused\" (one kernel per fused op on a GPU) or "
               "\"composed\" (their array operations, one launch each)")
        _check(self.attention_kernel in ("blocked", "flash"), "attention_kernel",
               f"{self.attention_kernel!r}: use \"blocked\" (zmpi.nn.attention's array "
               "operations) or \"flash\" (fused flash attention kernels on a GPU)")
        _check(self.attention_kernel != "flash" or self.kernels == "fused", "attention_kernel",
               "\"flash\" is a fused kernel; it needs kernels \"fused\", not \"composed\"")
        _check(not (self.fp16.enabled and self.bf16.enabled), "fp16.enabled",
               "fp16 and bf16 are both enabled; enable at most one")
        ac = self.activation_checkpointing
        interval = self.pipeline.activation_checkpoint_interval
        _check(not (ac.recompute == "selective" and interval),
               "pipeline.activation_checkpoint_interval",
               f"{interval} recomputes groups of whole units, and activation_checkpointing."
               "recompute \"selective\" only the attention probabilities: choose one")
        for key in ac.options_set():
            _check(ac.recompute == "full" or interval, f"activation_checkpointing.{key}",
                   "acts on the inputs full recompute keeps: set activation_checkpointing."
                   "recompute \"full\" (or pipeline.activation_checkpoint_interval)")
        _check(not (ac.partition_activations and self.tensor_parallel.sequence_parallel
                    and self.tensor_parallel.autotp_size > 1),
               "activation_checkpointing.partition_activations", "with sequence_parallel each "
               "tensor rank's unit inputs are already its own share of the sequence: drop one")
        check_onebit_layout(self)  # 1-bit Adam: ZeRO stage 0 and data parallelism only
        check_moe_layout(self)  # MoE: what is not built yet at ep > 1
        if self.model.model_type == "llama":  # GPT-only paths (docs/models.md)
            _check(not self.moe.enabled, "moe", "a Llama has no MoE blocks yet: not with "
                   "model.model_type llama")

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
        return cls.from_dict(parse_json(text, f"{path_or_str!s:.60}"))

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
                   f"'auto': train_batch_size {batch} does not split over "
                   f"{count(world_size, 'rank')} x {other}")
            derived = {"gradient_accumulation_steps": accum,
                       key: batch // (other * world_size)}
        new = self.replace(**derived)
        object.__setattr__(new, "_auto_batch", frozenset())
        object.__setattr__(new, "_own_notes", self._own_notes + tuple(
            f"{k}: 'auto' is {getattr(new, k) if k != 'train_batch_size' else 'derived'}"
            for k in sorted(auto)))
        return new

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

Modules: `base` (ConfigError, "auto", the `_Section` mechanism), `sections` (optimizer,
scheduler, fp16/bf16, tensor_parallel, pipeline, debug, memory_budget, aio), `zero`
(zero_optimization and its offload subsections), `onebit` (1-bit Adam's keys and the layouts
it allows), `moe` (mixture-of-experts blocks), `core` (the top-level `Config`). Import from
`zmpi.config`; the split is an implementation detail.
"""

from .base import AUTO, ConfigError, parse_json
from .core import Config
from .moe import MoEConfig
from .sections import (
    RECOMPUTE,
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
from .zero import OffloadConfig, OffloadParamConfig, ZeroConfig

__all__ = ["ConfigError", "AUTO", "OptimizerConfig", "SchedulerConfig", "FP16Config",
           "BF16Config", "OffloadConfig", "OffloadParamConfig", "ZeroConfig",
           "TensorParallelConfig", "PipelineConfig", "ActivationCheckpointingConfig",
           "RECOMPUTE", "DebugConfig", "MemoryBudgetConfig", "AioConfig", "ModelConfig",
           "SparseAttentionConfig", "MoEConfig", "Config",
           "parse_json"]

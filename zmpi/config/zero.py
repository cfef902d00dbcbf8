"""The `zero_optimization` section of zmpi.config: `ZeroConfig` (stage, strategy, buckets,
stage-3 keys, hybrid `shard_group_size`) and its offload subsections, `OffloadConfig`
(`offload_optimizer`, with the delayed parameter update) and `OffloadParamConfig`
(`offload_param`). This module imports no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import _check, _Section

__all__ = ["OffloadParamConfig", "OffloadConfig", "ZeroConfig"]


_OFFLOAD_DEVICES = ("none", "cpu")


@dataclass(frozen=True)
class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: keep stage 3's parameter shards in host memory
    (ZeRO-Infinity's CPU tier); a unit reaches the device only while it is gathered.
    `pin_memory`: page-locked host buffers, so that the copies to and from the GPU run
    asynchronously and overlap (true by default in zmpi, false in DeepSpeed; no effect on
    NumPy)."""

    _INERT = {"buffer_count": "host buffers are allocated per state, not pooled",
              "buffer_size": "host buffers are allocated per state, not pooled",
              "max_in_cpu": "every offloaded shard is in host memory",
              "nvme_path": "there is no NVMe tier", "fast_init": "initialisation is on the host"}

    device: str = "none"
    pin_memory: bool = True

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

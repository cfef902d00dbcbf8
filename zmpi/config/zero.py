"""The `zero_optimization` section of zmpi.config: `ZeroConfig` (stage, strategy, buckets,
stage-3 keys, hybrid `shard_group_size`) and its offload subsections, `OffloadConfig`
(`offload_optimizer`, with the delayed parameter update and ZeRO-Infinity's NVMe tier) and
`OffloadParamConfig` (`offload_param`). This module imports no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import _check, _Section

__all__ = ["OffloadParamConfig", "OffloadConfig", "ZeroConfig"]


_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class OffloadParamConfig(_Section):
    """`zero_optimization.offload_param`: keep stage 3's parameter shards in host memory
    (ZeRO-Infinity's CPU tier); a unit reaches the device only while it is gathered.
    `pin_memory`: page-locked host buffers, so that the copies to and from the GPU run
    asynchronously and overlap (true by default in zmpi, false in DeepSpeed; no effect on
    NumPy). With `"device": "nvme"` (ZeRO-Infinity) the shards live in a file under
    `nvme_path`, a unit's read into one of `buffer_count` host buffers of `buffer_size` elements
    (each must hold the largest unit's shard) when its gather starts; the leading units whose
    shards fit in `max_in_cpu` elements stay in host memory (zmpi.offload.nvme_param). Given
    with another device, the NVMe keys are noted as without effect."""

    _INERT = {"fast_init": "initialisation is on the host"}
    _BUFFERS = (1, " (a unit's shard in flight needs one)")  # buffer_count's minimum, why
    _NVME_KEYS = ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")  # act with it only

    device: str = "none"
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    @classmethod
    def from_dict(cls, d):
        obj = super().from_dict(d)
        unused = [k for k in cls._NVME_KEYS if k in d] if not obj.nvme else []
        object.__setattr__(obj, "_own_notes", obj._own_notes + tuple(
            f"{k}: accepted without effect (the device is {obj.device!r}, not 'nvme')"
            for k in unused))
        return obj

    def _validate(self):
        _check(self.device in _OFFLOAD_DEVICES, "device",
               f"must be one of {', '.join(map(repr, _OFFLOAD_DEVICES))}, got {self.device!r}")
        _check(not self.nvme or bool(self.nvme_path), "nvme_path",
               'required with "device": "nvme": a directory on the drive (each rank swaps into '
               "a directory of its own under it)")
        if self.nvme:
            self._at_least(self._BUFFERS[0], "buffer_count", note=self._BUFFERS[1])
            self._at_least(1024, "buffer_size", note=" elements (4 KiB of fp32, the unit of "
                                                     "direct I/O)")
            self._at_least(0, "max_in_cpu")

    @property
    def enabled(self) -> bool:
        """Whether the state leaves the device (the host holds it, or streams it to NVMe)."""
        return self.device in ("cpu", "nvme")

    @property
    def nvme(self) -> bool:
        return self.device == "nvme"


@dataclass(frozen=True)
class OffloadConfig(OffloadParamConfig):
    """`zero_optimization.offload_optimizer`: fp32 master weights, Adam's moments and the
    update on the host (ZeRO-Offload, Ren et al., ATC'21); stages 1-3.

    `"device": "nvme"` (ZeRO-Infinity, Rajbhandari et al., SC'21): the master weights and
    moments live in a file under `nvme_path` and stream through `buffer_count` host buffers
    of `buffer_size` elements; the first `max_in_cpu` elements of each stay in host memory
    (0 by default here: everything is swapped); `pipeline_read` / `pipeline_write` (DeepSpeed's
    keys; true by default in zmpi, false in DeepSpeed) read the next blocks ahead and write
    the updated ones behind, while Adam runs (zmpi.offload.nvme; docs/offload.md).

    zmpi extension: `delay_update` turns on the one-step delayed parameter update (DPU, ATC'21
    Sec. 5.2) after `delay_update_warmup` synchronous steps (the paper uses 40): the host Adam
    of step t runs in a background thread while forward and backward of step t+1 use the
    parameters of step t-1.
    """

    _ALWAYS = {"ratio": (1.0, "offloads the whole optimizer state")}
    _BUFFERS = (3, " (a block in flight needs one buffer for each of the master weights, "
                   "Adam's m and v)")
    _NVME_KEYS = OffloadParamConfig._NVME_KEYS + ("pipeline_read", "pipeline_write")

    buffer_count: int = 6
    max_in_cpu: int = 0
    pipeline_read: bool = True
    pipeline_write: bool = True
    delay_update: bool = False
    delay_update_warmup: int = 40

    @classmethod
    def from_dict(cls, d):
        obj = super().from_dict(d)
        slots, spare = divmod(obj.buffer_count, 3)
        notes = [f"buffer_count: the last {spare} of {obj.buffer_count} buffers unused (a "
                 "block takes three: master, m and v)"] if obj.nvme and spare else []
        if obj.nvme and slots == 1 and (obj.pipeline_read or obj.pipeline_write):
            notes.append("pipeline_read, pipeline_write: no effect with one block of buffers "
                         f"(buffer_count {obj.buffer_count}): reads and writes cannot overlap "
                         "Adam; 6 or more lets them")
        object.__setattr__(obj, "_own_notes", obj._own_notes + tuple(notes))
        return obj

    def _validate(self):
        super()._validate()
        self._at_least(0, "delay_update_warmup")
        _check(self.enabled or not self.delay_update, "delay_update",
               'needs the optimizer on the host: set "device": "cpu"')
        _check(not (self.nvme and self.delay_update), "delay_update",
               'is not implemented with "device": "nvme" (the update would stream the state '
               'while the next step computes); use "device": "cpu" for the delayed update')


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
    units zmpi keeps gathered at once exceed it). ZeRO++ (Wang et al., 2023) with stage 3,
    acted on by the `zeropp` strategy (zmpi/zero/zeropp.py, docs/zeropp.md):
    `zero_quantized_weights` (qwZ: int8 parameter allgathers), `zero_quantized_gradients`
    (qgZ: int4 gradients reduced by all-to-all) and `zero_hpz_partition_size` (hpZ: a
    secondary parameter shard in groups of that many ranks, gathered in backward; not given,
    a node's ranks where the ranks span nodes in blocks, else 1: zmpi/zero/zeropp.py). The other
    DeepSpeed keys are in `_ALWAYS` and `_INERT` (README, "Config keys").
    """

    _ALWAYS = {
        "contiguous_gradients": (True, "keeps gradients in one flat buffer per unit"),
        "allgather_partitions": (True, "allgathers parameter partitions"),
        "reduce_scatter": (True, "reduce-scatters gradients (stages 1-3)"),
        "load_from_fp32_weights": (True, "restores parameters from the fp32 master weights"),
        "zero_quantized_nontrainable_weights": (False, "trains every parameter (none is frozen "
                                                       "to be kept quantized)"),
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
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int | None = None  # None: the zeropp strategy picks (hpz_size)
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
        self._at_least(1, "zero_hpz_partition_size")
        zeropp = self.zeropp_keys
        _check(not zeropp or self.stage == 3 or self.strategy is not None,
               zeropp[0] if zeropp else "", "ZeRO++ quantizes and partitions the parameter "
               f'gathers of ZeRO-3: it needs "stage": 3, got {self.stage}')

    def notes(self) -> list[str]:
        out = super().notes()
        if self.strategy is None and self.stage < 3:  # a registered strategy may use them
            out += self._idle(("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                               "stage3_max_live_parameters"), f"at stage {self.stage}")
        return out

    @property
    def zeropp_keys(self) -> list[str]:
        """The ZeRO++ keys set away from their defaults (zmpi/zero/zeropp.py acts on them)."""
        return [k for k, on in (("zero_quantized_weights", self.zero_quantized_weights),
                                ("zero_quantized_gradients", self.zero_quantized_gradients),
                                ("zero_hpz_partition_size",
                                 (self.zero_hpz_partition_size or 1) > 1))
                if on]

    @property
    def strategy_name(self) -> str:
        """The strategy named, else the stage's; stage 3 with a ZeRO++ key is "zeropp"."""
        if self.strategy is not None:
            return self.strategy
        return "zeropp" if self.stage == 3 and self.zeropp_keys else f"stage{self.stage}"

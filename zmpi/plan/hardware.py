"""The machine a plan is for: peak rates, memories, links and the host Adam's rate.

A `Hardware` is plain data (JSON through `to_dict` / `from_dict`, `save`); PRESETS holds
a100, h100, h200, v100 and cpu. `zmpi.plan.measure.load_hardware(spec)` gives a preset, the
current machine measured ("this") or a JSON file of the same fields. Rates are per device (per
rank) unless a field says otherwise; bandwidths are bytes per second in one direction,
latencies seconds.

    hw = Hardware.from_dict(PRESETS["a100"].to_dict())   # a copy of a preset
    parse_size("80GB", "--device-memory")       # 8e10; units in a file as in a flag
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from decimal import Decimal
from pathlib import Path

from zmpi.files import write_atomic


@dataclass(frozen=True)
class Link:
    """A link's alpha-beta cost: sending n bytes takes latency + n / bandwidth seconds.
    `per_call`: its latency comes once a call (a collective, a send), not per ring message:
    the `oversubscribed` link (its JSON leaves the flag out: it is that link's by definition)."""

    bandwidth: float  # bytes/s, one direction, per device
    latency: float  # seconds per message, or per call
    per_call: bool = False

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + nbytes / self.bandwidth

    def latencies(self, calls: int, messages: int) -> int:
        """How many latencies `calls` calls of `messages` ring messages in all cost."""
        return calls if self.per_call else messages


@dataclass(frozen=True)
class Hardware:
    """One kind of node and its devices (on a CPU, a rank is a device).

    peak_flops: {"fp32", "fp16", "bf16"}: dense matmul FLOP/s per device at that compute
        dtype. On a GPU zmpi computes fp16 and bf16 in their 16-bit type on tensor cores;
        "bf16" (optional) is the fp32 rate where left out, as on Volta, which has no bf16. On
        a CPU zmpi computes both in fp32: "fp16" is the fp32 rate, and "bf16" may only
        equal it.
    gemm_efficiency: the fraction of peak the model's large matmuls reach (the one efficiency
        constant; stated with the source of the figures).
    memory_bandwidth: bytes/s of device memory, for the elementwise work (LayerNorm, GELU,
        softmax, residual adds, the optimizer on the device).
    device_memory: bytes per device; host_memory: bytes per node; devices_per_node: devices
        (ranks) per node; cores_per_node: a CPU's cores (ranks beyond them share them), None
        for a GPU.
    intra_node: between the devices of a node (tensor parallelism); inter_node: per device,
        between nodes (data and pipeline parallelism across nodes); host_device: device <->
        host copies (offload), per device.
    host_adam_rate: fp32 parameters per second one rank's host Adam updates while every
        device of the node has its rank (fewer ranks spread the node's cores over theirs).
    host_add_rate: gradient elements per second one rank's thread adds into its accumulated
        host shard (offload at ZeRO-2/3, every micro-step; measured on float16); None: the
        host Adam's streaming rate at 6 bytes an element. `--hardware this` measures it.
    elementwise_rate: bytes/s at which a transformer block's work besides its matmuls
        (LayerNorm, GELU, softmax, residual adds, casts, and the engine's own per-unit work)
        goes through the block's activation bytes, forward and backward together; None: the
        memory bandwidth over `zmpi.plan.time.ELEMENTWISE_PASSES` passes (a GPU's streaming
        kernels). `--hardware this` measures it (zmpi.plan.engine_rates.measure_layer).
    layer_overhead: seconds a transformer block's forward and backward take per micro-batch
        whatever its size (launches, the engine's per-unit work): 0 in the presets (GPU
        kernels queue ahead of the host); `--hardware this` measures it with elementwise_rate.
    stage2_unit_overhead, stage3_unit_overhead: seconds per unit and micro-batch that ZeRO-2's
        (ZeRO-3's) per-unit work adds to ZeRO-0's on a CPU rank (a full gradient allocated,
        reduced into the shard and freed; ZeRO-3 also gathers and releases the parameters): 0
        in the presets (GPU kernels queue ahead of the host); `--hardware this` measures both.
    half_storage_rate: on a CPU, the parameters per second that fp16 storage costs each
        micro-batch (every weight cast to float32 at each use, every gradient back); None: no
        cost (the presets: GPUs compute in fp16). `--hardware this` measures it.
    half_reduction_rate: bytes/s at which the MPI sums float16 data beyond the link's time
        (MPICH sums MPIX_C_FLOAT16 in software on the CPU); None: no extra cost (the presets:
        GPU kernels). `--hardware this` measures it.
    sync_skew: seconds a synchronous collective between ranks that compute between calls
        waits beyond its transfer, for its peers to arrive (their compute's jitter; a
        tensor-parallel step makes a few per block): 0 in the presets. `--hardware this`
        measures it where the ranks have cores of their own (oversubscribed ranks wait
        inside the `oversubscribed` link instead).
    oversubscribed: on a CPU, the link as a rank sees it when the node's ranks outnumber its
        cores and compute between collectives: each call then also waits for peers the OS has
        descheduled, so its latency is a call's (a collective's or a send's, whatever its
        group), not a ring message's. Used instead of intra_node / inter_node for such jobs;
        None: those links at cores / ranks of their bandwidth. `--hardware this` measures it
        on a machine of at most 8 cores (2 x cores ranks).
    oversubscribed_efficiency: on a CPU whose ranks outnumber its cores, the fraction of its
        cores / ranks share a rank's compute gets (the rest goes to switching between ranks
        and to the caches they share): 1 by default; `--hardware this` measures it with the
        oversubscribed link, as a training step's time alone times cores / ranks over its
        time with all 2 x cores ranks training at once, a barrier before each step (0.72-0.87
        here; GEMMs without the barriers reached 0.93-0.96).
    source: where the figures come from.
    """

    name: str
    peak_flops: dict
    gemm_efficiency: float
    memory_bandwidth: float
    device_memory: float
    host_memory: float
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    host_device: Link
    host_adam_rate: float
    cores_per_node: int | None = None
    elementwise_rate: float | None = None
    layer_overhead: float = 0.0
    stage2_unit_overhead: float = 0.0
    stage3_unit_overhead: float = 0.0
    sync_skew: float = 0.0
    half_storage_rate: float | None = None
    host_add_rate: float | None = None
    half_reduction_rate: float | None = None
    oversubscribed: Link | None = None
    oversubscribed_efficiency: float = 1.0
    source: str = ""
    measured: dict = field(default_factory=dict)  # raw measurements, for "this"

    def __post_init__(self):
        self.peak_flops.setdefault("bf16", self.peak_flops["fp32"])  # no bf16 rate: fp32's

    @property
    def on_gpu(self) -> bool:
        return self.cores_per_node is None

    def core_share(self, ranks_per_node: int) -> float:
        """The share of a device's rates one rank gets: 1 on a GPU, cores / ranks of it (times
        `oversubscribed_efficiency`) on a CPU whose ranks outnumber its cores."""
        if self.on_gpu or ranks_per_node <= self.cores_per_node:
            return 1.0
        return self.cores_per_node / ranks_per_node * self.oversubscribed_efficiency

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in (*_LINKS, "oversubscribed"):  # per_call: implied by the field (from_dict)
            if d[key] is not None:
                del d[key]["per_call"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Hardware:
        """The Hardware a `to_dict` (or a JSON file of it) describes, checked strictly: an
        unknown or missing key, a malformed figure or one outside its plausible range
        (RANGES, COUNT_RANGE) is a ValueError naming the key. Sizes, rates and latencies
        may be numbers (bytes, bytes/s, FLOP/s, seconds) or strings with units ("80GB",
        "600GB/s", "5us", "312TFLOP/s": see `parse_size`)."""
        _check_keys(d, {f.name for f in fields(cls)}, _OPTIONAL, "hardware")
        values = dict(d)
        if not isinstance(d["name"], str) or not d["name"]:
            raise ValueError(f"hardware: name must be a non-empty string, got {d['name']!r}")
        flops = d["peak_flops"]
        _check_keys(flops, set(DTYPES), {"bf16"}, "peak_flops")
        values["peak_flops"] = {k: _figure(flops[k], f"peak_flops.{k}", "flops")
                                for k in flops}
        for key in ("gemm_efficiency", "oversubscribed_efficiency"):
            values[key] = _figure(d.get(key, 1.0), key, "fraction")
        for key, kind in _QUANTITIES.items():
            values[key] = _figure(d[key], key, kind)
        for key in _OVERHEADS:  # seconds, or "20us"; 0 allowed
            overhead = d.get(key, 0.0)
            values[key] = 0.0 if overhead == 0 and not isinstance(overhead, bool) \
                else _figure(overhead, key, "latency")
        for key, kind in _OPTIONAL_RATES.items():
            if d.get(key) is not None:
                values[key] = _figure(d[key], key, kind)
        for key in (*_LINKS, "oversubscribed"):
            link = d.get(key)
            if key == "oversubscribed" and link is None:
                continue
            _check_keys(link, {"bandwidth", "latency"}, set(), key)
            values[key] = Link(_figure(link["bandwidth"], f"{key}.bandwidth", "bandwidth"),
                               _figure(link["latency"], f"{key}.latency", "latency"),
                               per_call=key == "oversubscribed")
        for key in ("devices_per_node", "cores_per_node"):
            value = d.get(key)
            if key == "cores_per_node" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or \
                    not 1 <= value <= COUNT_RANGE[1]:
                raise ValueError(f"hardware: {key} must be an integer from 1 to "
                                 f"{COUNT_RANGE[1]:,}, got {value!r}")
        cpu_only = [k for k, unset in (("oversubscribed", None), ("half_storage_rate", None),
                                       ("oversubscribed_efficiency", 1.0))
                    if d.get(k, unset) != unset]
        if d.get("cores_per_node") is None and cpu_only:
            raise ValueError(f"hardware: {', '.join(cpu_only)} act only on a CPU (cores_per_node "
                             "set): a GPU's ranks have a device each")
        if d.get("cores_per_node") is not None and values["peak_flops"].get(
                "bf16", values["peak_flops"]["fp32"]) != values["peak_flops"]["fp32"]:
            raise ValueError("peak_flops.bf16: zmpi computes bf16 in fp32 on a CPU, priced at "
                             "the fp32 rate: leave bf16 out (or give it equal to fp32)")
        if not isinstance(d.get("source", ""), str):
            raise ValueError(f"hardware: source must be a string, got {d['source']!r}")
        if not isinstance(d.get("measured", {}), dict):
            raise ValueError(f"hardware: measured must be an object, got {d['measured']!r}")
        return cls(**values)

    def save(self, path) -> None:
        """Write `to_dict()` as JSON (numbers in bytes, bytes/s, FLOP/s, seconds), whole or
        not at all (an OSError)."""
        write_atomic(Path(path), (json.dumps(self.to_dict(), indent=2) + "\n").encode())


DTYPES = ("fp32", "fp16", "bf16")
_OVERHEADS = ("layer_overhead", "stage2_unit_overhead", "stage3_unit_overhead", "sync_skew")
_OPTIONAL_RATES = {"elementwise_rate": "bandwidth", "half_reduction_rate": "bandwidth",
                   "half_storage_rate": "number", "host_add_rate": "number"}  # None: unset
_OPTIONAL = {"cores_per_node", *_OVERHEADS, *_OPTIONAL_RATES, "oversubscribed",
             "oversubscribed_efficiency", "source", "measured"}
_LINKS = ("intra_node", "inter_node", "host_device")
_QUANTITIES = {"memory_bandwidth": "bandwidth", "device_memory": "bytes",
               "host_memory": "bytes", "host_adam_rate": "number"}
RANGES = {  # kind: (least, most, unit) of a hardware figure, in base units: from a slow core
    #         of a small VM to far beyond any device built, so that no prediction overflows
    "flops": (1e6, 1e18, "FLOP/s"),  # peak_flops: 1 MFLOP/s to 1 EFLOP/s per device
    "bandwidth": (1e3, 1e15, "B/s"),  # links, memory_bandwidth, the optional rates in B/s
    "bytes": (2.0**20, 2.0**60, "B"),  # device_memory, host_memory: 1 MiB to 1 EiB
    "latency": (0.0, 10.0, "s"),  # link latencies (> 0) and the overheads (>= 0)
    "number": (1e3, 1e15, "/s"),  # host_adam_rate, host_add_rate, half_storage_rate
    "fraction": (0.01, 1.0, ""),  # gemm_efficiency, oversubscribed_efficiency
}
COUNT_RANGE = (1, 1 << 20)  # devices_per_node, cores_per_node


def _figure(text, key: str, kind: str) -> float:
    """parse_size(text, key, kind) inside RANGES[kind] (a fraction: a plain number), else a
    ValueError naming `key` and the range."""
    value = parse_size(text, key, "number" if kind == "fraction" else kind)
    least, most, unit = RANGES[kind]
    if not least <= value <= most:
        raise ValueError(f"hardware: {key} {text!r} is outside the plausible range {least:g} "
                         f"to {most:g}{' ' + unit if unit else ''}")
    return value


def _check_keys(d, known: set, optional: set, what: str) -> None:
    """d is a dict with every key of `known` but `optional`, and no other."""
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected an object with keys {sorted(known)}, got {d!r}")
    for key in d:
        if key not in known:
            raise ValueError(f"{what}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    for key in sorted(known - optional):
        if key not in d:
            raise ValueError(f"{what}: missing key {key!r}")


_BYTES = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_FLOP = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
UNITS = {  # kind: {unit: its value in bytes, bytes/s, seconds or FLOP/s}
    "bytes": _BYTES,
    "bandwidth": {unit + "/s": scale for unit, scale in _BYTES.items()},
    "latency": {"s": 1, "ms": 1e-3, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ns": 1e-9},
    "flops": {p + unit: scale for p, scale in _FLOP.items() for unit in ("FLOP/s", "FLOPS")},
    "number": {},
}
_EXAMPLE = {"bytes": "80GB", "bandwidth": "600GB/s", "latency": "5us", "flops": "312TFLOP/s",
            "number": "1.5e9"}
_QUANTITY = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*)\s*")


def parse_size(text, what: str, kind: str = "bytes") -> float:
    """A positive, finite quantity of `kind` as a float in base units, from a number (taken
    as base units) or a string: "80GB" (bytes: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB),
    "600GB/s" (bandwidth: the same with /s), "5us" (latency: s, ms, us, ns),
    "312TFLOP/s" (flops: FLOP/s or FLOPS with k, M, G, T, P), "1.5e9" (any kind; "number"
    takes no unit). Units are case-sensitive ("Gb/s" would be bits). A ValueError names
    `what` (a key, a flag) on anything else."""
    if kind not in UNITS:
        raise ValueError(f"parse_size: kind must be one of {sorted(UNITS)}, got {kind!r}")
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    elif isinstance(text, str) and (match := _QUANTITY.fullmatch(text)):
        number, unit = match.groups()
        if unit and unit not in UNITS[kind]:
            units = ", ".join(UNITS[kind]) or "none"
            bits = (" (b is bits: 200Gb/s is 25GB/s)"
                    if re.fullmatch(r"[kKMGTP]?b(ps|/s)?", unit) else "")
            raise ValueError(f"{what}: unknown unit {unit!r} in {text!r}{bits}; "
                             f"units for {kind}: {units}")
        value = float(Decimal(number) * Decimal(repr(UNITS[kind].get(unit, 1))))  # 5us: 5e-6
    else:
        raise ValueError(f"{what}: expected a number or a string such as "
                         f"{_EXAMPLE[kind]!r}, got {text!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: must be positive and finite, got {text!r}")
    return value


GiB, TiB = 2**30, 2**40
GPU_NOTES = (
    "Per GPU, one direction. gemm_efficiency 0.75, fixed before any comparison: cuBLAS's "
    "large fp16 GEMMs reach about three quarters of the tensor-core peak on V100, A100 and "
    "H100 (docs/plan.md compares the predictions with the published runs). Latencies are chosen, "
    "not measured: 5 us per NVLink collective step, 10 us per InfiniBand step and per "
    "host<->device copy. device_memory is the HBM capacity (the datasheet's GB are GiB); the "
    "CUDA context takes a few hundred MiB of it. host_adam_rate: Adam moves 28 bytes per fp32 "
    "parameter (reads p, g, m, v; writes p, m, v); a node's rate is taken as 70% of its "
    "sockets' theoretical DRAM bandwidth / 28 B (zmpi's HostAdam reaches 60-100% of copy "
    "bandwidth on one thread: results/bench_adam), shared by the node's ranks. ")

H100 = Hardware(
    name="h100",
    peak_flops={"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
    gemm_efficiency=0.75,
    memory_bandwidth=3.35e12,
    device_memory=80 * GiB,
    host_memory=2 * TiB,
    devices_per_node=8,
    intra_node=Link(450e9, 5e-6),
    inter_node=Link(50e9, 10e-6),
    host_device=Link(50e9, 10e-6),
    host_adam_rate=0.7 * 614.4e9 / 28 / 8,
    source=GPU_NOTES + (
        "H100 SXM5 80GB (NVIDIA H100 datasheet): 989 TFLOP/s dense fp16/bf16 tensor "
        "(1,979 with sparsity), 67 TFLOP/s fp32, 3.35 TB/s HBM3. DGX H100 (NVIDIA DGX "
        "BasePOD reference architecture): 8 GPUs on NVLink 4 / 4 NVSwitch, 900 GB/s per "
        "GPU both ways = 450 one way; 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU; PCIe "
        "Gen5 x16, 64 GB/s theoretical, ~50 achieved; 2 TB DDR5; 2x Xeon Platinum 8480C "
        "(112 cores), 16 channels DDR5-4800 = 614.4 GB/s: "
        "0.7 x 614.4e9 / 28 / 8 ranks = 1.92e9 params/s."),
)

PRESETS: dict[str, Hardware] = {
    "a100": Hardware(
        name="a100",
        peak_flops={"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12},
        gemm_efficiency=0.75,
        memory_bandwidth=2.039e12,
        device_memory=80 * GiB,
        host_memory=2 * TiB,
        devices_per_node=8,
        intra_node=Link(300e9, 5e-6),
        inter_node=Link(25e9, 10e-6),
        host_device=Link(25e9, 10e-6),
        host_adam_rate=0.7 * 409.6e9 / 28 / 8,
        source=GPU_NOTES + (
            "A100 80GB SXM (NVIDIA A100 datasheet): 312 TFLOP/s dense fp16/bf16 tensor, "
            "19.5 TFLOP/s fp32 (156 with TF32, which zmpi's fp32 does not assume), "
            "2,039 GB/s HBM2e. DGX A100 640GB node as in Megatron-LM (Narayanan et al., "
            "SC'21): 8 GPUs on NVLink 3 / NVSwitch, 600 GB/s per GPU both ways = 300 one way; "
            "8x HDR 200 Gb/s InfiniBand = 8 x 25 GB/s / 8 GPUs = 25 GB/s per GPU; PCIe Gen4 "
            "x16, 32 GB/s theoretical, ~25 achieved (two GPUs share a PCIe switch's uplink, "
            "so all 8 copying at once may see less); 2 TB DDR4 (the 320GB DGX A100 has 1 TB); "
            "2x AMD EPYC 7742, 16 channels DDR4-3200 = 409.6 GB/s: "
            "0.7 x 409.6e9 / 28 / 8 ranks = 1.28e9 params/s."),
    ),
    "h100": H100,
    # the H100's chip with more and faster HBM, in the same DGX node
    "h200": replace(
        H100, name="h200", peak_flops=dict(H100.peak_flops), memory_bandwidth=4.8e12,
        device_memory=141 * GiB,
        source=GPU_NOTES + (
            "H200 SXM 141GB (NVIDIA H200 datasheet): the H100 SXM's compute, 989 TFLOP/s dense "
            "fp16/bf16 tensor (1,979 with sparsity), 67 TFLOP/s fp32, with 141 GB HBM3e at "
            "4.8 TB/s. DGX H200: the DGX H100's node (8 GPUs on NVLink 4 / 4 NVSwitch, 450 "
            "GB/s one way per GPU; 8x ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU; PCIe Gen5, "
            "~50 GB/s; 2 TB DDR5; 2x Xeon Platinum 8480C: 1.92e9 params/s per rank).")),
    "v100": Hardware(
        name="v100",
        peak_flops={"fp32": 15.7e12, "fp16": 125e12},
        gemm_efficiency=0.75,
        memory_bandwidth=900e9,
        device_memory=32 * GiB,
        host_memory=1.5 * TiB,
        devices_per_node=16,
        intra_node=Link(150e9, 5e-6),
        inter_node=Link(6.25e9, 10e-6),
        host_device=Link(12e9, 10e-6),
        host_adam_rate=0.7 * 256e9 / 28 / 16,
        source=GPU_NOTES + (
            "V100 SXM3 32GB (NVIDIA V100 datasheet): 125 TFLOP/s fp16 tensor, 15.7 TFLOP/s "
            "fp32, 900 GB/s HBM2; no bf16 on Volta: bf16 is given the fp32 rate. DGX-2 node "
            "as in ZeRO (Rajbhandari et al., SC'20: 25 DGX-2 nodes, 800 Gb/s between nodes) "
            "and ZeRO-Offload (Ren et al., ATC'21): 16 GPUs on NVLink 2 / NVSwitch, 300 GB/s "
            "per GPU both ways = 150 one way; 8x EDR 100 Gb/s InfiniBand = 8 x 12.5 GB/s / 16 "
            "GPUs = 6.25 GB/s per GPU; PCIe Gen3 x16, 15.75 GB/s theoretical, ~12 achieved; "
            "1.5 TB DDR4; 2x Xeon Platinum 8168, 12 channels DDR4-2666 = 256 GB/s: "
            "0.7 x 256e9 / 28 / 16 ranks = 4.0e8 params/s."),
    ),
    "cpu": Hardware(
        name="cpu",
        peak_flops={"fp32": 72e9, "fp16": 72e9},
        gemm_efficiency=0.9,
        memory_bandwidth=0.7 * 409.6e9 / 128,
        device_memory=512 * GiB,
        host_memory=512 * GiB,
        devices_per_node=128,
        intra_node=Link(0.7 * 409.6e9 / 128 / 4, 5e-6),
        inter_node=Link(25e9 / 128, 10e-6),
        host_device=Link(0.7 * 409.6e9 / 128 / 2, 1e-6),
        host_adam_rate=0.7 * 409.6e9 / 28 / 128,
        cores_per_node=128,
        source=(
            "A generic 2-socket server, one rank per core, one thread each (as zmpi runs on "
            "CPUs): 2x AMD EPYC 7742 (64 cores each, 2.25 GHz base, AVX2 with two 256-bit FMA "
            "units: 32 fp32 FLOP/cycle = 72 GFLOP/s per core; zmpi computes fp16/bf16 in "
            "fp32), gemm_efficiency 0.9 (what a tuned single-thread sgemm reaches; this "
            "machine's `this` measures its own); 512 GiB DDR4-3200 on 16 channels, 409.6 GB/s "
            "theoretical, 70% achieved, shared by 128 ranks = 2.24 GB/s per rank. Device and "
            "host are the same RAM: device_memory = host_memory = the node's, shared by its "
            "ranks. intra_node: a shared-memory MPI transfer copies into and out of a shared "
            "segment, 4 bytes moved per byte sent: memory_bandwidth / 4, 5 us per message "
            "(zmpi's Comm measures ~7 us on a 2-core EPYC VM); inter_node: one HDR 200 Gb/s "
            "NIC (25 GB/s) shared by 128 ranks, 10 us; host_device: a copy, "
            "memory_bandwidth / 2, 1 us; host_adam_rate: 28 bytes per parameter, "
            "2.24e9 / 28 = 8e7 params/s per rank."),
    ),
}

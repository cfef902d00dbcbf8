"""Memory accounting: the MemoryLedger and the ZeRO paper's model-state formulas.

Every persistent buffer zmpi allocates is registered with one `MemoryLedger` per rank under a
category (what it holds) and a device (where it lives), so experiments and tests can compare
the bytes that were actually held with the formulas of ZeRO (Rajbhandari et al., SC'20, Fig. 1)::

    ledger = MemoryLedger()
    w = ledger.allocate((1024,), "float16", "param")      # zeros, registered
    ledger.current("param"), ledger.peak(device="device") # 2048, 2048
    ledger.release(w)
    print(ledger.report())

    model_state_bytes(7.5e9, 64, stage=3) / 1e9           # 1.875 (paper: 1.9 GB)

Register owning buffers, not views into them, or bytes are counted twice. This module imports
no MPI; it is per-rank bookkeeping.
"""

from __future__ import annotations

import itertools

import numpy

__all__ = ["CATEGORIES", "MODEL_STATE", "ACTIVATION", "GROUPS", "DEVICES", "MemoryLedger",
           "OutOfMemory", "model_state_breakdown", "model_state_bytes", "model_state_placement",
           "held_model_state",
           "comm_volume_elements", "expert_groups", "estimate_rows", "ring_bytes",
           "ARRAY_OPS"]

CATEGORIES = ("param", "grad", "master", "adam_m", "adam_v", "layer_cache", "saved_input",
              "recompute", "comm_buffer", "checkpoint")
MODEL_STATE = ("param", "grad", "master", "adam_m", "adam_v")
# Activations, by what keeps them: the arrays layers save in forward for their backward; the
# input a recomputed (checkpointed) unit keeps instead; what layers save while a unit's forward
# runs again in backward.
ACTIVATION = ("layer_cache", "saved_input", "recompute")
GROUPS = {"activation": ACTIVATION, "model_state": MODEL_STATE}  # names current/peak accept
DEVICES = ("device", "host")
_MiB = 2**20


def _check_choice(kind: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(allowed)}")


class OutOfMemory(MemoryError):
    """An allocation would exceed the ledger's memory budget (`memory_budget`), or the
    allocator (NumPy's, CuPy's on a GPU) refused a buffer the ledger allocates; either way
    the message names the buffer and what this rank holds."""


class MemoryLedger:
    """Bytes held per (category, device) on this rank, now and at peak.

    Peaks are exact for every filter `current`/`peak` accept: the ledger keeps a running total
    for each (set of categories, device or None=both) pair, (2**10 - 1) * 3 of them in one
    array, and updates the ones containing the changed (category, device) on every
    register/release (one vectorised pass over all of them).
    """

    def __init__(self, device_pool=None, budget=None):
        """device_pool: optional callable returning {"used", "held"} bytes of the device
        allocator (the engine passes CuPy's memory-pool reading on a GPU), reported beside
        the ledger. budget: {"device"|"host": bytes} the ledger lets this rank hold; an
        allocation beyond it raises OutOfMemory before the buffer exists."""
        self._device_pool = device_pool
        self.budget = {d: b for d, b in (budget or {}).items() if b is not None}
        for d in self.budget:
            _check_choice("device", d, DEVICES)
        self._entries: dict[int, tuple] = {}  # id(array) -> (array, name, category, device)
        subsets = [frozenset(s) for r in range(1, len(CATEGORIES) + 1)
                   for s in itertools.combinations(CATEGORIES, r)]
        keys = [(s, d) for s in subsets for d in (*DEVICES, None)]
        self._index = {k: i for i, k in enumerate(keys)}
        self._total = numpy.zeros(len(keys), numpy.int64)
        self._peak = self._total.copy()
        self._in_total = {}  # (category, device) -> 1 where a total counts it, else 0
        for c in CATEGORIES:
            for d in DEVICES:
                mask = numpy.zeros(len(keys), numpy.int64)
                mask[[i for k, i in self._index.items() if c in k[0] and k[1] in (d, None)]] = 1
                self._in_total[c, d] = mask

    # -- registration ----------------------------------------------------------------------
    def register(self, array, category: str, device: str = "device", name: str = ""):
        """Account for `array` (anything with .nbytes); returns it. The ledger holds a reference
        until `release`, so ids stay unique. Registering the same array twice is an error."""
        _check_choice("category", category, CATEGORIES)
        _check_choice("device", device, DEVICES)
        if id(array) in self._entries:
            prev = self._entries[id(array)]
            raise ValueError(f"array already registered as {prev[1]!r} ({prev[2]}, {prev[3]})")
        self._check_budget(int(array.nbytes), category, device, name)
        self._entries[id(array)] = (array, name, category, device)
        self._add(category, device, int(array.nbytes))
        return array

    def holds(self, array) -> bool:
        """Whether `array` itself is registered."""
        return id(array) in self._entries

    def release(self, array) -> None:
        """Stop accounting for `array`; KeyError if it is not registered."""
        entry = self._entries.pop(id(array), None)
        if entry is None:
            raise KeyError(f"array {type(array).__name__}{getattr(array, 'shape', '')} "
                           "is not registered with this ledger")
        self._add(entry[2], entry[3], -int(array.nbytes))

    def allocate(self, shape, dtype, category: str, device: str = "device", name: str = "",
                 xp=numpy, zero: bool = True):
        """A registered array, of zeros unless `zero=False` (for a buffer that will be wholly
        overwritten: no memset); `xp` is the array module (numpy or cupy) used for
        device="device"; host buffers are always numpy."""
        _check_choice("category", category, CATEGORIES)
        _check_choice("device", device, DEVICES)
        nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * numpy.dtype(dtype).itemsize
        self._check_budget(nbytes, category, device, name)
        mod = numpy if device == "host" else xp
        make = mod.zeros if zero else mod.empty
        try:
            array = make(shape, dtype=dtype)
        except MemoryError as e:  # the allocator's own (NumPy's, CuPy's OutOfMemoryError)
            raise OutOfMemory(f"{device} allocation failed: "
                              f"{self._describe(nbytes, category, device, name)}: {e}") from e
        return self.register(array, category, device, name)

    def _check_budget(self, nbytes: int, category: str, device: str, name: str) -> None:
        budget = self.budget.get(device)
        if budget is not None and self.current(device=device) + nbytes > budget:
            raise OutOfMemory(f"{device} memory budget of {budget / _MiB:.1f} MiB exceeded: "
                              f"{self._describe(nbytes, category, device, name)}")

    def _describe(self, nbytes: int, category: str, device: str, name: str) -> str:
        """'NAME (CATEGORY, X MiB) on top of Y MiB held (what holds it)': an OutOfMemory's
        account of the buffer that did not fit."""
        held = ", ".join(f"{c} {self.current(c, device) / _MiB:.1f}" for c in CATEGORIES
                         if self.current(c, device))
        return (f"{name or 'a buffer'} ({category}, {nbytes / _MiB:.1f} MiB) on top of "
                f"{self.current(device=device) / _MiB:.1f} MiB held ({held or 'nothing'}; MiB)")

    def _add(self, category: str, device: str, nbytes: int) -> None:
        # dense passes over every total beat indexing the half that change (2x, measured)
        numpy.add(self._total, self._in_total[category, device] * nbytes, out=self._total)
        if nbytes > 0:  # a release lowers totals: no peak moves
            numpy.maximum(self._peak, self._total, out=self._peak)

    # -- queries ---------------------------------------------------------------------------
    def _key(self, category, device) -> int:
        names = CATEGORIES if category is None else (
            (category,) if isinstance(category, str) else tuple(category))
        cats = set()
        for c in names:
            if c in GROUPS:
                cats.update(GROUPS[c])
            else:
                _check_choice("category", c, (*CATEGORIES, *GROUPS))
                cats.add(c)
        if device is not None:
            _check_choice("device", device, DEVICES)
        return self._index[frozenset(cats), device]

    def current(self, category=None, device=None) -> int:
        """Bytes held now; `category` is a category, a group of them ("activation",
        "model_state": GROUPS), a tuple of those, or None (all); `device` is 'device', 'host'
        or None (both)."""
        return int(self._total[self._key(category, device)])

    def peak(self, category=None, device=None) -> int:
        """Highest value `current(category, device)` has had since creation or `reset_peaks`."""
        return int(self._peak[self._key(category, device)])

    def model_state_bytes(self, device=None) -> int:
        """Current bytes of params, grads, fp32 master and Adam moments."""
        return self.current(MODEL_STATE, device)

    def reset_peaks(self) -> None:
        """Start peak tracking afresh from the current totals (e.g. after initialisation)."""
        self._peak = self._total.copy()

    def buffers(self) -> list[tuple]:
        """(name, category, device, shape, dtype, nbytes) per registered array, in order."""
        return [(name, cat, dev, tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", "")),
                 int(a.nbytes)) for a, name, cat, dev in self._entries.values()]

    def device_pool_bytes(self) -> dict:
        """What the device allocator reports: {"used": bytes in live arrays (ledger buffers
        and temporaries), "held": bytes it holds, cached blocks included}; zeros without a
        device pool reader."""
        return dict(self._device_pool()) if self._device_pool else {"used": 0, "held": 0}

    def report(self) -> str:
        """Table of current and peak MiB per category and device, plus model-state and total."""
        rows = [(c, c) for c in CATEGORIES] + [("activation", ACTIVATION),
                                                ("model state", MODEL_STATE), ("total", None)]
        head = f"{'category':<12}" + "".join(f"{d + ' now':>14}{d + ' peak':>14}"
                                             for d in DEVICES)
        lines = [head + "   (MiB)", "-" * len(head)]
        for label, cats in rows:
            cells = "".join(f"{self.current(cats, d) / _MiB:>14.2f}"
                            f"{self.peak(cats, d) / _MiB:>14.2f}" for d in DEVICES)
            lines.append(f"{label:<12}{cells}")
        if self._device_pool:
            pool = self.device_pool_bytes()
            lines.append(f"{'device pool':<12}{pool['used'] / _MiB:>14.2f} used, "
                         f"{pool['held'] / _MiB:.2f} held (cached blocks included)")
        return "\n".join(lines)

    def snapshot(self) -> dict:
        """JSON-serialisable state: bytes now and at peak per device and category."""
        def table(which):
            return {d: {**{c: which(c, d) for c in CATEGORIES},
                        **{g: which(cats, d) for g, cats in GROUPS.items()},
                        "total": which(None, d)}
                    for d in DEVICES}
        return {"current": table(self.current), "peak": table(self.peak),
                "device_pool": self.device_pool_bytes(),
                "buffers": [{"name": n, "category": c, "device": d, "shape": list(s),
                             "dtype": t, "nbytes": b} for n, c, d, s, t, b in self.buffers()]}


# -- ZeRO formulas (SC'20, Section 5 and Figure 1) --------------------------------------------
# Which model-state categories each stage partitions over the N data-parallel ranks:
# P_os (stage 1) shards optimizer state, P_os+g (stage 2) adds gradients, P_os+g+p (stage 3)
# adds parameters. Unsharded categories are replicated on every rank.
_SHARDED = {0: (), 1: ("master", "adam_m", "adam_v")}
_SHARDED[2] = _SHARDED[1] + ("grad",)
_SHARDED[3] = _SHARDED[2] + ("param",)
# Collective passes over the parameters per step: reduce-scatter + allgather (or allreduce) of
# gradients/parameters for stages 0-2; stage 3 gathers parameters twice (forward, backward).
_PASSES = {0: 2, 1: 2, 2: 2, 3: 3}


def _check_stage(stage) -> None:
    if isinstance(stage, bool) or stage not in _SHARDED:
        raise ValueError(f"unknown ZeRO stage {stage!r}; valid: 0, 1, 2, 3")


def _check_sizes(num_params, world_size) -> None:
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size}")


def model_state_breakdown(num_params, world_size, stage, param_bytes=2, grad_bytes=2,
                          master_bytes=4, moment_bytes=4) -> dict[str, float]:
    """Bytes per rank of each model-state category under ZeRO `stage`.

    Defaults are mixed-precision Adam (fp16 params and grads, fp32 master, m and v: K = 12).
    For fp32 training pass param_bytes=4, grad_bytes=4, master_bytes=0.
    """
    _check_stage(stage)
    _check_sizes(num_params, world_size)
    per_param = {"param": param_bytes, "grad": grad_bytes, "master": master_bytes,
                 "adam_m": moment_bytes, "adam_v": moment_bytes}
    return {c: b * num_params / (world_size if c in _SHARDED[stage] else 1)
            for c, b in per_param.items()}


def model_state_bytes(num_params, world_size, stage, param_bytes=2, grad_bytes=2,
                      optimizer_bytes=12) -> float:
    """Model-state bytes per rank, ZeRO Fig. 1 with K = optimizer_bytes:
    stage 0 (p+g+K) Psi, 1 (p+g) Psi + K Psi/N, 2 p Psi + (g+K) Psi/N, 3 (p+g+K) Psi/N."""
    # All optimizer-state categories shard together, so K can be carried as 'master' alone.
    parts = model_state_breakdown(num_params, world_size, stage, param_bytes, grad_bytes,
                                  master_bytes=optimizer_bytes, moment_bytes=0)
    return sum(parts.values())


def model_state_placement(num_params, world_size, stage, param_bytes=2, grad_bytes=2,
                          master_bytes=4, moment_bytes=4, offload_optimizer=False,
                          offload_param=False, delay_update=False) -> dict[str, dict]:
    """Bytes per rank of each model-state category on the device and on the host:
    {"device": {category: bytes}, "host": {category: bytes}}.

    Without offload everything is on the device (`model_state_breakdown`). ZeRO-Offload
    (ATC'21) with `offload_optimizer` (stages 1-3) moves the fp32 master weights and Adam's
    moments (K Psi / N) to the host, together with the reduced gradient shard the host Adam
    reads (g Psi / N; twice that with `delay_update`, whose host step reads one shard while
    backward fills the other); stage 1 still keeps its full gradients on the device (g Psi),
    stages 2-3 none. `offload_param` (stage 3) keeps the parameter shards (p Psi / N) on the
    host: the device then holds no model state between units. For Psi = 7.5e9, N = 64, fp16:
    stage 2 + optimizer offload holds 15 GB on the device and 1.6 GB on the host per rank.
    """
    parts = model_state_breakdown(num_params, world_size, stage, param_bytes, grad_bytes,
                                  master_bytes, moment_bytes)
    if offload_optimizer and stage == 0:
        raise ValueError("optimizer offload needs stage 1, 2 or 3 (stage 0 keeps the "
                         "optimizer state whole on every rank)")
    if offload_param and stage != 3:
        raise ValueError("parameter offload needs stage 3 (parameter partitioning)")
    if delay_update and not offload_optimizer:
        raise ValueError("delay_update needs offload_optimizer")
    device, host = dict(parts), dict.fromkeys(MODEL_STATE, 0.0)
    if offload_optimizer:
        for c in ("master", "adam_m", "adam_v"):
            host[c], device[c] = device[c], 0.0
        host["grad"] = grad_bytes * num_params / world_size * (2 if delay_update else 1)
        if stage >= 2:
            device["grad"] = 0.0
    if offload_param:
        host["param"], device["param"] = device["param"], 0.0
    return {"device": device, "host": host}


def held_model_state(full_numel: int, shard_numel: int, param_bytes: int, master_bytes: int,
                     shard_optimizer: bool, shard_gradients: bool, shard_parameters: bool,
                     offload_optimizer: bool = False, offload_param: bool = False,
                     spare_grad_shard: bool = False) -> dict[str, dict[str, int]]:
    """{"device"|"host": {category: bytes}} of the model states one rank holds between steps
    under a partition strategy's sharding flags (ZeRO stage k: the optimizer from k = 1, the
    gradients from 2, the parameters from 3), for a layout of `full_numel` padded elements
    split into shards of `shard_numel`: what the ledger measures (`Strategy.
    expected_model_state`, which the shared test suite checks, and `zmpi plan`). Gradients
    are stored in the parameters' dtype (param_bytes), the master weights and Adam's moments
    in master_bytes. A rank keeps the full gradients unless they are sharded, and a gradient
    shard where they are sharded or the optimizer is offloaded (on the optimizer's side; a
    second one with `spare_grad_shard`, the delayed update's)."""
    P, S, b = full_numel, shard_numel, param_bytes
    opt = "host" if offload_optimizer else "device"
    held = {d: dict.fromkeys(MODEL_STATE, 0) for d in DEVICES}
    held["host" if offload_param else "device"]["param"] = (S if shard_parameters else P) * b
    held["device"]["grad"] = 0 if shard_gradients else P * b
    shards = int(shard_gradients or offload_optimizer) + int(spare_grad_shard)
    held[opt]["grad"] += shards * S * b
    for category in ("master", "adam_m", "adam_v"):
        held[opt][category] = (S if shard_optimizer else P) * master_bytes
    return held


ARRAY_OPS = ("allreduce", "reduce_scatter", "allgather", "alltoall")  # those that move model data


def ring_bytes(nbytes: int, world_size: int, passes: int = 1) -> int:
    """Bytes one rank sends in `passes` bandwidth-optimal ring passes over a buffer of `nbytes`
    on `world_size` ranks: passes * nbytes * (N-1) / N, rounded down (what Comm counts)."""
    return int(nbytes) * passes * (world_size - 1) // world_size


def comm_volume_elements(num_params, world_size, stage) -> float:
    """Elements each rank sends per step with ring collectives: 2 Psi (N-1)/N for stages 0-2,
    3 Psi (N-1)/N for stage 3 (ZeRO Section 7). Multiply by the element size for bytes."""
    _check_stage(stage)
    _check_sizes(num_params, world_size)
    return _PASSES[stage] * num_params * (world_size - 1) / world_size


def expert_groups(psi_experts, n, ep) -> list[tuple[float, int]]:
    """The (parameters per rank before ZeRO, ranks ZeRO shards them over) of the expert
    parameters at expert-parallel degree ep on n data-parallel ranks (docs/moe.md, "Expert
    parallelism in the engine"): each rank holds Psi_experts / ep of them, data parallel over
    the n / ep ranks that hold the same experts; [] without experts. ValueError, one line,
    where ep does not divide n."""
    if isinstance(ep, bool) or int(ep) != ep or ep < 1 or n % ep:
        raise ValueError(f"ep={ep} does not divide the data-parallel size {n}")
    return [(psi_experts / ep, n // ep)] if psi_experts else []


def estimate_rows(psi, n, stages, param_bytes, optimizer_bytes, offload_optimizer=False,
                  offload_param=False, psi_experts=0, ep=1) -> list[dict]:
    """Per stage: model-state GB per rank on the device and the host (ZeRO Fig. 1, with
    ZeRO-Offload's placement) and elements each rank sends per step; a stage the offload
    settings exclude carries its reason instead (what `zmpi estimate` prints). psi_experts
    of the psi parameters are experts split over ep ranks (`expert_groups`): their states
    and traffic counted over the n / ep ranks holding the same experts, the rest over n; the
    row's "expert_traffic_elements" is then the experts' share of its traffic (what the
    expert-data-parallel group sends: the engine's "edp" dimension)."""
    rows = []
    groups = [(psi - psi_experts, n), *expert_groups(psi_experts, n, ep)]
    for stage in stages:
        traffic = [comm_volume_elements(p, r, stage) for p, r in groups]
        row = {"stage": stage, "traffic_elements": sum(traffic)}
        if psi_experts:
            row["expert_traffic_elements"] = traffic[1]
        try:
            places = [model_state_placement(p, r, stage, param_bytes, param_bytes,
                                            optimizer_bytes / 3, optimizer_bytes / 3,
                                            offload_optimizer, offload_param)
                      for p, r in groups]
        except ValueError as e:
            rows.append({**row, "error": str(e)})
            continue
        row.update({f"{where}_gb": sum(sum(place[where].values()) for place in places) / 1e9
                    for where in ("device", "host")})
        rows.append(row)
    return rows

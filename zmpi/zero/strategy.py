"""Partition strategies: the shared ZeRO mechanism, and the registry of policies over it.

A strategy decides what each rank keeps and which collective runs at each hook (README.md,
"The stages"). `Strategy` holds the mechanism every policy shares: buffers laid out by
`zero.flat`, binding parameter views, gathering and releasing a unit, reduce-scattering a
unit's gradients, writing updated master weights back. A policy (`stage0.py` ... `stage3.py`)
declares which model states it shards and overrides the hooks:

    hook                      called by the engine
    before_forward(u)         before unit u's forward
    after_forward(u)          after it
    before_backward(u)        before unit u's backward
    after_backward(u)         after it; `self.sync_gradients` is False on the micro-steps of
                              gradient accumulation that must not communicate
    before_step()             pending collectives are done; reduce what is still unreduced
    publish_params()          after Adam updated the master shard: refresh the params
    zero_grads()              end of step: clear gradients (and drop step-only buffers)

Buffers (1-D, model-wide; `P` = layout.full_numel, `S` = layout.shard_numel = P / N):

    params_full  (P, dtype)  unless shard_parameters                      device
    params_shard (S, dtype)  if shard_parameters                          device, host if
                                                                          offload_param
    grads_full   (P, dtype)  unless shard_gradients                       device
    grads_shard  (S, dtype)  the reduced gradient shard the optimizer     device, host if
                             reads: if shard_gradients or offload_optimizer  offload_optimizer
                             (stage 1 without offload makes one per step)
    master, adam_m, adam_v   (S if shard_optimizer, else P; fp32, or      device, host if
                             fp64 for an fp64 model)                      offload_optimizer

ZeRO-Offload (Ren et al., ATC'21) is this same mechanism with some buffers placed on the host:
`offload_optimizer` puts the master weights, Adam's moments and the reduced gradient shard
there (each unit's shard is copied device -> host as soon as its reduce-scatter completes, so
the copies overlap the rest of backward; the host Adam's result comes back as fp16/bf16
parameters), and `offload_param` keeps stage 3's parameter shards there (the allgather of a
unit reads the host shard and fills a device buffer). With `delay_update` a second host
gradient shard lets the host Adam of one step run while the next step's backward fills the
other (`swap_grad_buffers`).

Every buffer is allocated through the MemoryLedger and every collective goes through Comm, so
what a stage holds and moves is measured, not assumed; each policy declares what it should
hold and send (`expected_model_state`, `expected_traffic`) and the shared test suite checks
both. The model states are partitioned over `self.comm`: the world, or the shard group a
policy picks in `process_groups` (hybrid.py). A new strategy is one file: subclass, set the
flags, override hooks, declare the traffic, decorate with `@register("name")`
(docs/strategies.md).
"""
from __future__ import annotations

import atexit

import numpy as np

from zmpi import backend
from zmpi.backend import HostCopy, array_module
from zmpi.config import ConfigError
from zmpi.memory import DEVICES, MODEL_STATE, ring_bytes

_REGISTRY: dict[str, type[Strategy]] = {}
_ABANDONED: list = []  # requests in flight when an error stopped a step, and their buffers


@atexit.register
def _settle_abandoned() -> None:
    """At exit, complete the abandoned requests that have finished (MPI otherwise reports
    them as pending references); never blocks."""
    for entry in _ABANDONED:
        for item in entry if isinstance(entry, tuple) else (entry,):
            if hasattr(item, "test") and hasattr(item, "wait"):
                try:
                    item.test()
                except Exception:  # the job is ending anyway
                    pass


def register(name: str):
    """Class decorator: make a Strategy subclass available under `name`."""

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


ENTRY_POINT_GROUP = "zmpi.strategies"


def _register_builtins() -> None:
    from zmpi.zero import hybrid, stage0, stage1, stage2, stage3  # noqa: F401  (@register)


def get_strategy(name: str) -> type[Strategy]:
    """The Strategy class called `name`: a registered name (the built-in "stage0".."stage3",
    anything imported that used @register, or a package's entry point in the group
    "zmpi.strategies"), or "package.module:ClassName", imported here (on every rank).
    ValueError naming what is available otherwise."""
    _register_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _from_path(name)
    entry = _entry_points().get(name)
    if entry is not None:
        return _checked(entry.load(), f"entry point {name!r} ({entry.value})", name)
    raise ValueError(f"unknown partition strategy {name!r}; available: "
                     f"{', '.join(available_strategies())}, or 'package.module:ClassName'")


def available_strategies() -> list[str]:
    """Registered names and installed entry points (loaded on first use)."""
    _register_builtins()
    return sorted(set(_REGISTRY) | set(_entry_points()))


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {e.name: e for e in entry_points(group=ENTRY_POINT_GROUP)}


def _from_path(path: str) -> type[Strategy]:
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load partition strategy {path!r}: {e}") from e
    return _checked(obj, path, path)


def _checked(obj, what: str, name: str) -> type[Strategy]:
    """obj if it is a Strategy subclass (registered under `name` if it was not yet)."""
    if not (isinstance(obj, type) and issubclass(obj, Strategy)):
        raise ValueError(f"partition strategy {what} is {obj!r}, not a subclass of "
                         "zmpi.zero.strategy.Strategy")
    if obj not in _REGISTRY.values():
        register(name)(obj)
    return obj


def _add_(dst, src) -> None:
    """dst += src, quietly: an fp16 inf here is the loss scaler's overflow signal."""
    with np.errstate(over="ignore", invalid="ignore"):
        array_module(dst).add(dst, src, out=dst)


class Strategy:
    """The mechanism. Subclasses set the three flags and override hooks (all no-ops here)."""

    name = "base"
    shard_optimizer = False  # ZeRO P_os
    shard_gradients = False  # ZeRO P_g
    shard_parameters = False  # ZeRO P_p
    # Elements from which a unit is sent alone, never packed into a bucket with others. At
    # 16 Ki float32 elements per unit an allgather packed costs what one per unit costs; at
    # 64 Ki, 2.2x (N = 2 over shared memory; experiments/bandwidth.py, packing.md).
    solo_numel = 1 << 14

    def __init__(self, units, unit_params, layout, comm, ledger, dtype, master_dtype, xp,
                 zero_config, replica=None):
        """units: the model's unit Modules, in forward order. unit_params[u]: name -> Parameter
        of unit u (names as in layout.units[u]). layout: ModelLayout, built for comm.size.
        comm, replica: this rank's shard group and replica group (`process_groups`). dtype:
        storage dtype of parameters and gradients; master_dtype: of master weights and Adam
        moments (fp32, or fp64 for exactness runs). xp: array module of device buffers."""
        self.units, self.unit_params, self.layout = units, unit_params, layout
        self.comm, self.replica, self.ledger, self.xp = comm, replica, ledger, xp
        self.dtype, self.master_dtype = dtype, master_dtype
        self.config = zero_config
        self.overlap = zero_config.overlap_comm
        self.sync_gradients = True
        self.rank, self.world_size = comm.rank, comm.size
        offload, offload_param = zero_config.offload_optimizer, zero_config.offload_param
        self.offload_optimizer, self.offload_param = offload.enabled, offload_param.enabled
        self._check_offload()
        self._pending = []  # (request, callback) of collectives still in flight
        self._host_copies = []  # device -> host gradient copies in flight (optimizer offload)
        self._gathered = {}  # u -> [full param buffer, request or None]   (param sharding)
        self._unit_grads = {}  # u -> full grad buffer of one unit           (grad sharding)
        self._shared = [tuple(units.index(s) for s in getattr(m, "shared_units", ()))
                        for m in units]
        self._reduce_buckets = None  # first unit -> bucket, built on first use
        P, S = layout.full_numel, layout.shard_numel
        opt_dev = "host" if self.offload_optimizer else "device"
        self._pinned = offload.pin_memory
        alloc = self.alloc
        self.params_full = None if self.shard_parameters else alloc(P, dtype, "param", "params")
        self.params_shard = alloc(S, dtype, "param", "params", "host" if self.offload_param
                                  else "device", offload_param.pin_memory) \
            if self.shard_parameters else None
        self.grads_full = None if self.shard_gradients else alloc(P, dtype, "grad", "grads")
        self.grads_shard = alloc(S, dtype, "grad", "grads", opt_dev, self._pinned) \
            if self.shard_gradients or self.offload_optimizer else None
        self.grads_spare = alloc(S, dtype, "grad", "grads_spare", opt_dev, self._pinned) \
            if offload.delay_update else None
        n_opt = S if self.shard_optimizer else P
        self.master = alloc(n_opt, master_dtype, "master", "master", opt_dev)
        self.adam_m = alloc(n_opt, master_dtype, "adam_m", "adam_m", opt_dev)
        self.adam_v = alloc(n_opt, master_dtype, "adam_v", "adam_v", opt_dev)

    def _check_offload(self) -> None:
        if self.offload_optimizer and not self.shard_optimizer:
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              f"optimizer offload needs a strategy that shards the optimizer "
                              f"state (stages 1-3); {self.name!r} does not")
        if self.offload_param and not self.shard_parameters:
            raise ConfigError("zero_optimization.offload_param.device",
                              f"parameter offload needs a strategy that shards the parameters "
                              f"(stage 3); {self.name!r} does not")

    # ---- process groups, and what the policy declares it holds and sends ---------------
    @classmethod
    def process_groups(cls, comm, zero_config):
        """(shard group, replica group) of this rank, as Comms: the ranks the model states are
        partitioned over (the layout is built for its size), and the ranks that hold the same
        shard (None: no replication). Called by the engine, collectively, before the layout
        exists. Default: the whole world shards, nothing is replicated."""
        if zero_config.shard_group_size is not None:
            raise ConfigError("zero_optimization.shard_group_size",
                              f"strategy {cls.name!r} does not split the ranks into groups; "
                              "shard_group_size is for the hybrid strategies")
        return comm, None

    @classmethod
    def suite_configs(cls, world_size: int) -> list[dict]:
        """The `zero_optimization` settings (beyond "strategy") the shared test suite runs this
        policy with at `world_size` ranks (tests/test_zero.py): by default its defaults."""
        return [{}]

    def comms(self) -> dict:
        """{group kind: Comm} of every communicator this policy sends on (for its counters)."""
        if self.replica is None:
            return {"world": self.comm}
        return {"shard": self.comm, "replica": self.replica}

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this rank writes its shard to a checkpoint (one replica of each shard)."""
        return self.replica is None or self.replica.rank == 0

    def ring_bytes(self, numel: int, passes: int = 1, comm=None) -> int:
        """Bytes this rank sends for `passes` ring passes over `numel` storage-dtype elements
        on `comm` (default: the shard group): passes * B (n-1)/n, as Comm counts them."""
        return ring_bytes(numel * self.dtype.itemsize, (comm or self.comm).size, passes)

    def expected_traffic(self) -> dict[str, int]:
        """{group kind (as `comms`): bytes this rank sends} in one optimizer step without
        gradient accumulation, under the ring model Comm counts. Every policy declares it:
        the shared test suite checks it against the counters."""
        raise NotImplementedError(f"strategy {self.name!r} does not declare expected_traffic()")

    def expected_model_state(self) -> dict[str, dict[str, int]]:
        """{"device"|"host": {category: bytes}} of the model states (zmpi.memory.MODEL_STATE)
        this rank holds between steps: what the ledger must measure (the shared test suite
        checks). Derived from the flags and the offload settings; a policy that keeps more
        overrides it."""
        P, S = self.layout.full_numel, self.layout.shard_numel
        b, mb = self.dtype.itemsize, self.master_dtype.itemsize
        opt = "host" if self.offload_optimizer else "device"
        held = {d: dict.fromkeys(MODEL_STATE, 0) for d in DEVICES}
        held["host" if self.offload_param else "device"]["param"] = \
            (S if self.shard_parameters else P) * b
        held["device"]["grad"] = 0 if self.shard_gradients else P * b
        grad_shards = int(self.shard_gradients or self.offload_optimizer) \
            + int(self.grads_spare is not None)
        held[opt]["grad"] += grad_shards * S * b
        for category in ("master", "adam_m", "adam_v"):
            held[opt][category] = (S if self.shard_optimizer else P) * mb
        return held

    # ---- set-up -------------------------------------------------------------------------
    def initialize(self, initial) -> None:
        """Load initial values from `initial` (P, master dtype: the whole model in the full
        layout, identical on every rank, host) and bind every parameter view this policy
        keeps."""
        own = self.owned(initial)
        backend.copy_(self.master, initial if not self.shard_optimizer else own)
        if self.shard_parameters:
            backend.copy_(self.params_shard, own)
            for u in range(len(self.units)):  # released until a hook gathers the unit
                self._bind(u, "data", None)
        else:
            backend.copy_(self.params_full, initial)
            for u in range(len(self.units)):
                self._bind(u, "data", self.params_full[self.layout.full_slice(u)])
        for u in range(len(self.units)):  # sharded: bound only during the unit's backward
            full = None if self.shard_gradients else self.grads_full[self.layout.full_slice(u)]
            self._bind(u, "grad", full)

    def owned(self, full):
        """This rank's shards of every unit of a full-layout array, concatenated (S)."""
        return array_module(full).concatenate([full[self.layout.owned_slice(u, self.rank)]
                                               for u in range(len(self.units))])

    def optimizer_grads(self):
        """Reduced gradients in the master's layout and memory, valid after before_step()."""
        return self.grads_shard if self.shard_optimizer else self.grads_full

    def swap_grad_buffers(self):
        """Delayed update: hand the reduced gradients of this step to the optimizer and give
        backward the spare buffer (zeroed by zero_grads)."""
        if self.grads_spare is None:
            raise RuntimeError("swap_grad_buffers needs offload_optimizer.delay_update")
        self.grads_shard, self.grads_spare = self.grads_spare, self.grads_shard

    # ---- hooks (policies override) -----------------------------------------------------
    def before_forward(self, u: int) -> None: ...
    def after_forward(self, u: int) -> None: ...
    def before_backward(self, u: int) -> None: ...
    def after_backward(self, u: int) -> None: ...
    def before_step(self) -> None: ...
    def publish_params(self) -> None: ...

    def zero_grads(self) -> None:
        for g in (self.grads_full, self.grads_shard):
            if g is not None:
                g.fill(0)

    # ---- mechanism ----------------------------------------------------------------------
    def alloc(self, numel, dtype, category, name, device="device", pinned=False, zero=True):
        """A 1-D buffer registered with the ledger, zeroed unless `zero=False` (a buffer a
        collective or a copy overwrites entirely: no memset): on the device (the array module
        `xp`) or on the host (NumPy; page-locked if `pinned` and on a GPU). Release it with
        `self.ledger.release(buf)`."""
        if device == "host" and pinned:
            buf = backend.pinned_empty(numel, dtype)
            if zero:
                buf.fill(0)
            return self.ledger.register(buf, category, "host", name)
        return self.ledger.allocate((numel,), dtype, category, device, name, xp=self.xp,
                                    zero=zero)

    def _bind(self, u: int, attr: str, flat) -> None:
        """Point each parameter's .data or .grad of unit u at its view of `flat` (or None)."""
        views = self.layout.units[u].views(flat) if flat is not None else {}
        for name, p in self.unit_params[u].items():
            setattr(p, attr, views.get(name))

    def _launch(self, request, callback=None) -> None:
        """Run `callback` once `request` completes: now, or at wait_pending() when overlapping
        communication with computation (`overlap_comm`)."""
        if self.overlap:
            self._pending.append((request, callback))
            for pending, _ in self._pending:  # MPI progresses a collective only inside an
                if not pending.test():        # MPI call: each launch drives those in flight
                    break
        else:
            request.wait()
            if callback:
                callback()

    def abandon_in_flight(self) -> None:
        """After an error in a step: forget every collective and copy in flight without
        waiting for it (another rank may never join), but keep their buffers alive for the
        rest of the process, so that MPI never writes into freed memory; release the gathered
        units and unit gradients (the next step gathers afresh) and clear the gradients."""
        gathering = [request for _, request in self._gathered.values() if request is not None]
        for request in [request for request, _ in self._pending] + gathering:
            try:
                request.start()  # a queued one reaches MPI, as on the ranks that got this far
            except Exception:  # noqa: S110 (the step's own error is the one to report)
                pass
        _ABANDONED.extend(self._pending)
        _ABANDONED.extend(self._host_copies)
        self._pending, self._host_copies = [], []
        for u, (buf, request) in list(self._gathered.items()):
            if request is not None:
                _ABANDONED.append((buf, request))  # MPI may still write it: keep it alive
            else:
                self.ledger.release(buf)
            self._bind(u, "data", None)
        self._gathered.clear()
        for u, buf in list(self._unit_grads.items()):
            self._bind(u, "grad", None)
            self.ledger.release(buf)
        self._unit_grads.clear()
        self.zero_grads()

    def wait_pending(self) -> None:
        """Complete every collective in flight (running its callback) and every device ->
        host gradient copy."""
        pending, self._pending = self._pending, []
        for i, (request, callback) in enumerate(pending):
            try:
                request.wait()
                if callback:
                    callback()
            except BaseException:
                self._pending = pending[i + 1:] + self._pending  # still in flight: not lost
                raise
        self._land_host_copies(block=True)

    def needs(self, u: int) -> tuple[int, ...]:
        """Units whose parameters unit u reads: itself and the units it shares weights with."""
        return (u,) + self._shared[u]

    def gather(self, u: int, wait: bool = True) -> None:
        """Allgather unit u's parameters from the shards into a full buffer (param sharding).
        With wait=False the allgather is only started (prefetch); a later gather() finishes it."""
        if u not in self._gathered:
            numel = self.layout.units[u].padded_numel
            buf = self.alloc(numel, self.dtype, "param", f"gathered{u}", zero=False)
            send = self.params_shard[self.layout.shard_slice(u)]
            self._gathered[u] = [buf, self.comm.iallgather(send, buf)]
        entry = self._gathered[u]
        if wait and entry[1] is not None:
            entry[1].wait()
            entry[1] = None
            self._bind(u, "data", entry[0])

    def release(self, u: int) -> None:
        """Free unit u's gathered parameters (param sharding)."""
        buf, request = self._gathered.pop(u)
        if request is not None:
            request.wait()
        self._bind(u, "data", None)
        self.ledger.release(buf)

    def ensure_unit_grads(self, u: int) -> None:
        """Give unit u (and the units it writes gradients into) a zeroed full grad buffer."""
        for w in self.needs(u):
            if w not in self._unit_grads:
                numel = self.layout.units[w].padded_numel
                buf = self.alloc(numel, self.dtype, "grad", f"grad{w}")
                self._unit_grads[w] = buf
                self._bind(w, "grad", buf)

    def reduce_scatter_unit_grads(self, u: int) -> None:
        """Reduce-scatter unit u's full gradient, add this rank's shard into grads_shard and
        free the full buffer (gradient sharding: non-owned gradient memory is released)."""
        full = self._unit_grads.pop(u)
        self._bind(u, "grad", None)
        self.reduce_scatter_to_shard(range(u, u + 1), full, accumulate=True, free=(full,))

    def buckets(self, limit: int) -> list[range]:
        """The units in order, grouped into runs of consecutive units of at most `limit`
        elements together (DeepSpeed's bucket sizes; a larger unit is a bucket of its own).
        A unit of `solo_numel` elements or more is always a bucket of its own: it is sent in
        place, where packing it with its neighbours would cost a copy of it (two for an
        allgather) to save one collective's latency."""
        out, start, size = [], 0, 0
        for u, unit in enumerate(self.layout.units):
            solo = unit.padded_numel >= self.solo_numel
            if u > start and (solo or size + unit.padded_numel > limit):
                out.append(range(start, u))
                start, size = u, 0
            size += unit.padded_numel
            if solo:
                out.append(range(u, u + 1))
                start, size = u + 1, 0
        return out + [range(start, len(self.layout.units))] \
            if start < len(self.layout.units) else out

    def reduce_bucket_from(self, u: int) -> range | None:
        """The gradient bucket (`reduce_bucket_size`) whose first unit is u, else None: its
        gradients are complete once u's backward ends (backward runs the units in reverse)."""
        if self._reduce_buckets is None:
            self._reduce_buckets = {b.start: b for b in self.buckets(
                self.config.reduce_bucket_size)}
        return self._reduce_buckets.get(u)

    def _bucket_full(self, units: range) -> slice:
        return slice(self.layout.full_offsets[units.start], self.layout.full_offsets[units.stop])

    def _bucket_shard(self, units: range) -> slice:
        return slice(self.layout.shard_offsets[units.start], self.layout.shard_offsets[units.stop])

    def _bucket_pieces(self, units: range):
        """(rank, slice of the full layout, slice of the packed bucket) of every owned piece:
        a packed bucket holds rank 0's shards of its units, then rank 1's, ... (what
        reduce-scatter splits and allgather concatenates)."""
        n = self.layout.shard_offsets[units.stop] - self.layout.shard_offsets[units.start]
        for r in range(self.world_size):
            at = r * n
            for u in units:
                piece = self.layout.owned_slice(u, r)
                yield r, piece, slice(at, at + piece.stop - piece.start)
                at += piece.stop - piece.start

    def bucket_buffer(self, units: range, full):
        """Where the bucket of `full` (P) travels in a collective: unit u's own slice when it
        is alone (it is already rank-major), else a new, unfilled comm_buffer in the packed
        order of `_bucket_pieces` (the caller releases it)."""
        if len(units) == 1:
            return full[self._bucket_full(units)]
        mine = self._bucket_shard(units)
        return self.alloc((mine.stop - mine.start) * self.world_size, full.dtype,
                          "comm_buffer", "bucket", zero=False)

    def pack(self, units: range, full):
        """The bucket of `full` (P) for a collective, filled from `full` (`bucket_buffer`)."""
        packed = self.bucket_buffer(units, full)
        if len(units) > 1:
            for _, piece, at in self._bucket_pieces(units):
                packed[at] = full[piece]
        return packed

    def reduce_scatter_to_shard(self, units: range, full, accumulate: bool, free=()) -> None:
        """Reduce-scatter `full` (the packed whole gradient of a bucket of units, device) so
        that this rank's summed shard is added into its part of grads_shard (or written, if
        not `accumulate`). If grads_shard is on the host (optimizer offload) the shard is
        copied device -> host as soon as the reduction completes. Buffers in `free` are
        released when done."""
        dst = self.grads_shard[self._bucket_shard(units)]
        direct = not accumulate and not self.offload_optimizer
        part = dst if direct else self.alloc(dst.shape[0], self.dtype, "comm_buffer", "rs",
                                             zero=False)
        request = self.comm.ireduce_scatter(full, part)

        def done():
            if self.offload_optimizer:  # to dst, or to a host buffer added on landing
                landing = self.alloc(dst.shape[0], self.dtype, "comm_buffer", "d2h", "host",
                                     self._pinned, zero=False) if accumulate else dst
                self._host_copies.append((HostCopy(part, landing), dst, part))
                self._land_host_copies(block=False)
            elif not direct:
                _add_(dst, part)
                self.ledger.release(part)
            for buf in free:
                self.ledger.release(buf)

        self._launch(request, done)

    def _land_host_copies(self, block: bool) -> None:
        """Finish device -> host gradient copies in order: add each landed shard into its
        destination and free the buffers. Without `block`, stop at the first still in flight."""
        while self._host_copies:
            copy, dst, part = self._host_copies[0]
            if not (block or copy.ready()):
                return
            self._host_copies.pop(0)
            landed = copy.wait()
            if landed is not dst:
                _add_(dst, landed)
                self.ledger.release(landed)
            self.ledger.release(part)

    def publish_sharded_params(self) -> None:
        """Write each unit's updated master shard into params_full and allgather in place."""
        self.allgather_shard_into(self.params_full, self.master)

    def allgather_shard_into(self, full, shard) -> None:
        """Fill `full` (P) on every rank from each rank's `shard` (S), in buckets of
        `allgather_bucket_size` elements: a lone unit is allgathered in place in `full`; the
        units of a larger bucket are gathered packed into a comm_buffer and copied out."""
        for units in self.buckets(self.config.allgather_bucket_size):
            mine = self._bucket_shard(units)
            n = mine.stop - mine.start
            packed = self.bucket_buffer(units, full)  # only this rank's part is written here
            backend.copy_(packed[self.rank * n:(self.rank + 1) * n], shard[mine])

            def unpack(units=units, packed=packed):
                if len(units) > 1:
                    for _, piece, at in self._bucket_pieces(units):
                        full[piece] = packed[at]
                    self.ledger.release(packed)

            self._launch(self.comm.iallgather_inplace(packed), unpack)
        self.wait_pending()

    # ---- checkpoints: every state as this rank's owned shard, whatever the policy -----
    def state_buffer(self, state: str):
        """(buffer, whether it holds only the owned shard) of 'params', 'master', 'adam_m'
        or 'adam_v'."""
        if state == "params":
            return ((self.params_shard, True) if self.shard_parameters
                    else (self.params_full, False))
        if state not in ("master", "adam_m", "adam_v"):
            raise ValueError(f"unknown model state {state!r}")
        return getattr(self, state), self.shard_optimizer

    def state_shard(self, state: str):
        """This rank's owned shard (S,) of a model state: the buffer itself when the policy
        shards that state, else the owned slices of the full buffer (a copy)."""
        buf, sharded = self.state_buffer(state)
        return buf if sharded else self.owned(buf)

    def set_state_shard(self, state: str, shard) -> None:
        """Inverse of `state_shard`: write `shard` (S, host or device) into the state's buffer.
        A collective when the policy replicates the state (each unit is allgathered in place
        from every rank's owned part): every rank calls it with the same `state`."""
        buf, sharded = self.state_buffer(state)
        if sharded:
            backend.copy_(buf, shard)
        else:
            self.allgather_shard_into(buf, shard)

    def full_master(self):
        """The master weights of the whole model in the full layout (P), on every rank, in
        host memory: the shard is copied to the host once and gathered there, so the device
        never holds the whole fp32 model."""
        if not self.shard_optimizer:
            return backend.to_host(self.master)
        shard = backend.to_host(self.master)
        full = np.empty(self.layout.full_numel, self.master_dtype)
        for u in range(len(self.units)):
            self.comm.allgather(shard[self.layout.shard_slice(u)], full[self.layout.full_slice(u)])
        return full

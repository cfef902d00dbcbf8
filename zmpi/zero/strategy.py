"""Partition strategies: the shared ZeRO mechanism every policy runs on.

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
    publish_targets()         where Adam may write the params as it updates the master (host
                              arrays), or None; publish_params() then skips those copies
    publish_params()          after Adam updated the master shard: refresh the params
    zero_grads()              end of step: clear gradients (and drop step-only buffers); the
                              reduced shard is not cleared but marked stale (`_stale`): the
                              first reduction of a unit in the next step writes its part

Buffers (1-D, model-wide; `P` = layout.full_numel, `S` = layout.shard_numel = P / N):

    params_full  (P, dtype)  unless shard_parameters                      device
    params_shard (S, dtype)  if shard_parameters                          device, host if
                                                                          offload_param
                             with offload_param.device "nvme": a handle on a file
                             (`self.param_store`, zmpi.offload.nvme_param), gathered through it
    grads_full   (P, dtype)  unless shard_gradients                       device
    grads_shard  (S, dtype)  the reduced gradient shard the optimizer     device, host if
                             reads: if shard_gradients or offload_optimizer  offload_optimizer
                             (stage 1 without offload makes one per step)
    master, adam_m, adam_v   (S if shard_optimizer, else P; fp32, or      device, host if
                             fp64 for an fp64 model)                      offload_optimizer
                             with offload_optimizer.device "nvme": SwappedState handles on a
                             file (`self.nvme`, zmpi.offload.nvme), Adam via optimizer_step

ZeRO-Offload (Ren et al., ATC'21) is this same mechanism with some buffers placed on the host:
`offload_optimizer` puts the master weights, Adam's moments and the reduced gradient shard
there (each unit's shard is copied device -> host as soon as its reduce-scatter completes, so
the copies overlap the rest of backward; the host Adam's result comes back as fp16/bf16
parameters), and `offload_param` keeps stage 3's parameter shards there (the allgather of a
unit reads the host shard and fills a device buffer). With `delay_update` a second host
gradient shard lets the host Adam of one step run while the next step's backward fills the
other (`swap_grad_buffers`). Under CuPy the host buffers the device copies read or write
(the host gradient shards, the landing buffers of the gradient copies, stage 3's host
parameter shards) are page-locked (`backend.pinned_empty`) unless `pin_memory` is false (zmpi's
default is true, DeepSpeed's false): a copy to or from pageable memory cannot run
asynchronously, and these are 2 bytes an element of the shard (the fp32 master and moments
stay pageable).

Every buffer is allocated through the MemoryLedger and every collective goes through Comm, so
what a stage holds and moves is measured, not assumed; each policy declares what it should
hold and send (`expected_model_state`, `expected_traffic`) and the shared test suite checks
both. The model states are partitioned over `self.comm`: the world, or the shard group a
policy picks in `process_groups` (hybrid.py). A new strategy is one file: subclass, set the
flags, override hooks, declare the traffic, decorate with `@register("name")`
(docs/strategies.md).

Besides the buffers and the hooks here, a Strategy is: `Declarations` (declarations.py:
process groups and what it holds and sends), `BucketPlanning` (buckets.py: which units travel
together), `UnitCollectives` (collectives.py: gathering a unit, reduce-scattering its
gradients, publishing updated shards) and `StateShards` (states.py: the states as owned
shards, for checkpoints). It is built from one
`StrategyContext` (context.py). The registry of names is registry.py.
"""
from __future__ import annotations

import atexit

import numpy as np

from zmpi import backend
from zmpi.backend import array_module
from zmpi.config import ConfigError
from zmpi.nn.parameter import mark_grads_zeroed
from zmpi.offload.nvme import NvmeOptimizerState
from zmpi.offload.nvme_param import NvmeParamShard
from zmpi.zero.buckets import BucketPlanning
from zmpi.zero.collectives import UnitCollectives
from zmpi.zero.context import StrategyContext
from zmpi.zero.declarations import Declarations
from zmpi.zero.registry import strategy_base
from zmpi.zero.states import StateShards

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


@strategy_base
class Strategy(Declarations, BucketPlanning, UnitCollectives, StateShards):
    """The mechanism. Subclasses set the three flags and override hooks (all no-ops here)."""

    name = "base"
    shard_optimizer = False  # ZeRO P_os
    shard_gradients = False  # ZeRO P_g
    shard_parameters = False  # ZeRO P_p
    zeropp = False  # acts on ZeRO++'s keys (zeropp.py)

    def __init__(self, ctx: StrategyContext):
        """ctx: what the strategy is built from (StrategyContext says what each field is).
        self.comm (and self.rank, self.world_size) is ctx.shard_group, self.replica is
        ctx.replica_group; the other fields keep their names (self.layout, self.config, ...)."""
        self.ctx = ctx
        units, layout, zero_config = ctx.units, ctx.layout, ctx.config
        dtype, master_dtype = ctx.dtype, ctx.master_dtype
        self.units, self.unit_params, self.layout = units, ctx.unit_params, layout
        self.comm, self.replica, self.ledger, self.xp = (ctx.shard_group, ctx.replica_group,
                                                         ctx.ledger, ctx.xp)
        self.dtype, self.master_dtype, self.mesh = dtype, master_dtype, ctx.mesh
        self.config = zero_config
        self.overlap = zero_config.overlap_comm
        self.sync_gradients = True
        self._params_written = False  # publish_targets() handed out, Adam wrote them
        self._stale = set(range(len(units)))  # units whose part of grads_shard holds no
                                              # gradient of this step (zero_grads)
        self.rank, self.world_size = self.comm.rank, self.comm.size
        offload, offload_param = zero_config.offload_optimizer, zero_config.offload_param
        self.offload_optimizer, self.offload_param = offload.enabled, offload_param.enabled
        self._check_offload()
        if zero_config.zeropp_keys and not self.zeropp:
            raise ConfigError(f"zero_optimization.{zero_config.zeropp_keys[0]}",
                              f"strategy {self.name!r} does not act on ZeRO++'s keys; they "
                              'act with "stage": 3 and no "strategy" (or "zeropp")')
        self._pending = []  # (request, callback, bytes it holds) of collectives in flight
        # Constant-size buffers (ZeRO-R's CB): what the collectives in flight hold stays under
        # two buckets' worth, whatever the model's size (the oldest are finished first).
        self.in_flight_limit = 2 * max(zero_config.reduce_bucket_size,
                                       zero_config.allgather_bucket_size) * dtype.itemsize
        self._host_copies = []  # device -> host gradient copies in flight (optimizer offload)
        self._gathered = {}  # u -> [full param buffer, request or None]   (param sharding)
        self._unit_grads = {}  # u -> full grad buffer of one unit           (grad sharding)
        self._shared = [tuple(units.index(s) for s in getattr(m, "shared_units", ()))
                        for m in units]
        self._reduce_buckets = None  # first unit -> bucket, built on first use (buckets.py)
        P, S = layout.full_numel, layout.shard_numel
        opt_dev = "host" if self.offload_optimizer else "device"
        alloc = self.alloc  # pinned: page-locked when on the host under CuPy
        pinned = self._pinned = offload.pin_memory
        self.params_full = None if self.shard_parameters else alloc(P, dtype, "param", "params")
        # offload_param "nvme": a handle on a file, units read and gathered through a pool
        # agreed over the world, whose node-local ranks share the drive
        world = self.mesh.comm if self.mesh is not None else self.comm
        self.param_store = NvmeParamShard.open(
            world, [(s.start, s.stop) for s in map(layout.shard_slice, range(len(units)))],
            dtype, offload_param, ctx.aio, self.ledger) if offload_param.nvme else None
        self.params_shard = self.param_store.handle if self.param_store else alloc(
            S, dtype, "param", "params", "host" if self.offload_param else "device",
            offload_param.pin_memory) if self.shard_parameters else None
        self.grads_full = None if self.shard_gradients else alloc(P, dtype, "grad", "grads")
        self.grads_shard = alloc(S, dtype, "grad", "grads", opt_dev, pinned) \
            if self.shard_gradients or self.offload_optimizer else None
        self.grads_spare = alloc(S, dtype, "grad", "grads_spare", opt_dev, pinned) \
            if offload.delay_update else None
        n_opt = S if self.shard_optimizer else P
        self.nvme = None
        try:
            self.nvme = NvmeOptimizerState.open(world, n_opt, master_dtype, offload,
                                                ctx.aio, self.ledger) if offload.nvme else None
        except BaseException:
            self.close_storage()  # the parameters' file, if any: none is left behind
            raise
        # on NVMe, handles that read and write block by block (zmpi.offload.nvme)
        self.master, self.adam_m, self.adam_v = self.nvme.states if self.nvme else (
            alloc(n_opt, master_dtype, c, c, opt_dev) for c in ("master", "adam_m", "adam_v"))

    def _check_offload(self) -> None:
        if self.offload_optimizer and not self.shard_optimizer:
            raise ConfigError("zero_optimization.offload_optimizer.device",
                              f"optimizer offload needs a strategy that shards the optimizer "
                              f"state (stages 1-3); {self.name!r} does not")
        if self.offload_param and not self.shard_parameters:
            raise ConfigError("zero_optimization.offload_param.device",
                              f"parameter offload needs a strategy that shards the parameters "
                              f"(stage 3); {self.name!r} does not")

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
            self._bind(u, "grad", full, zeroed=True)

    def owned(self, full):
        """This rank's shards of every unit of a full-layout array, concatenated (S)."""
        return array_module(full).concatenate([full[self.layout.owned_slice(u, self.rank)]
                                               for u in range(len(self.units))])

    def optimizer_grads(self):
        """Reduced gradients in the master's layout and memory, valid after before_step()."""
        return self.grads_shard if self.shard_optimizer else self.grads_full

    def swap_grad_buffers(self):
        """Delayed update: hand the reduced gradients of this step to the optimizer and give
        backward the spare buffer (stale after zero_grads: written afresh)."""
        if self.grads_spare is None:
            raise RuntimeError("swap_grad_buffers needs offload_optimizer.delay_update")
        self.grads_shard, self.grads_spare = self.grads_spare, self.grads_shard

    # ---- hooks (policies override) -----------------------------------------------------
    def before_forward(self, u: int) -> None: ...
    def after_forward(self, u: int) -> None: ...
    def before_recompute(self, u: int) -> None: ...  # a unit's forward again, in backward
    def after_recompute(self, u: int) -> None: ...
    def before_backward(self, u: int) -> None: ...
    def after_backward(self, u: int) -> None: ...
    def before_step(self) -> None: ...
    def publish_params(self) -> None: ...

    def publish_targets(self):
        """None, or where the optimizer is to write the updated master, cast to the storage
        dtype, chunk by chunk as it updates it (Adam.step_'s `publish`): then the next
        publish_params() skips those copies. A policy hands out host arrays only (a CPU run,
        or offloaded ones): the chunk is still in cache, where a copy after the step reads the
        whole master again. None by default: publish_params() copies."""
        return None

    def _hand_out(self, pairs):
        """publish_targets' answer for (start in master, dst) pairs: None unless the master
        and every dst are host arrays; else the pairs, and publish_params() will skip them."""
        pairs = list(pairs)
        self._params_written = self.nvme is not None or all(  # NVMe: written block by block
            isinstance(a, np.ndarray) for a in (self.master, *(dst for _, dst in pairs)))
        return pairs if self._params_written else None

    def _take_written(self) -> bool:
        """Whether the optimizer wrote what publish_targets() handed out (once)."""
        written, self._params_written = self._params_written, False
        return written

    def zero_grads(self) -> None:
        self._params_written = False  # a step that raised: what was handed out is stale
        if self.grads_full is not None:
            self.grads_full.fill(0)
            mark_grads_zeroed(p for params in self.unit_params for p in params.values())
        # grads_shard is not zeroed (a pass over it): the next step's first reduction of each
        # unit writes its part instead of adding (reduce_scatter_to_shard), and wait_pending
        # zeroes the parts that none wrote
        self._stale = set(range(len(self.units))) if self.grads_shard is not None else set()

    def _zero_stale(self, units=None) -> None:
        """Zero the parts of grads_shard of the stale units (of `units`, default all): they
        then hold this step's (empty) sum."""
        if self.grads_shard is None:  # a step-time buffer, released (stage 1)
            self._stale.clear()
            return
        for u in sorted(self._stale if units is None else self._stale.intersection(units)):
            self.grads_shard[self.layout.shard_slice(u)].fill(0)
            self._stale.discard(u)

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

    def _bind(self, u: int, attr: str, flat, zeroed: bool = False) -> None:
        """Point each parameter's .data or .grad of unit u at its view of `flat` (or None);
        zeroed: `flat` holds zeros (the first gradient is then written, not added)."""
        views = self.layout.units[u].views(flat) if flat is not None else {}
        for name, p in self.unit_params[u].items():
            setattr(p, attr, views.get(name))
        if zeroed:
            mark_grads_zeroed(self.unit_params[u].values())

    def _launch(self, request, callback=None, holds=0) -> None:
        """Run `callback` once `request` completes: now, or when overlapping communication
        with computation (`overlap_comm`), at wait_pending() or once the buffers the
        collectives in flight hold (`holds` bytes for this one, released by its callback)
        pass `in_flight_limit`, oldest first."""
        if self.overlap:
            self._pending.append((request, callback, holds))
            while len(self._pending) > 1 and \
                    sum(h for _, _, h in self._pending) > self.in_flight_limit:
                self._finish(self._pending.pop(0))
            for pending, _, _ in self._pending:  # MPI progresses a collective only inside an
                if not pending.test():           # MPI call: each launch drives those in flight
                    break
        else:
            self._finish((request, callback, holds))

    def abandon_in_flight(self) -> None:
        """After an error in a step: forget every collective and copy in flight without
        waiting for it (another rank may never join), but keep their buffers alive for the
        rest of the process, so that MPI never writes into freed memory; release the gathered
        units and unit gradients (the next step gathers afresh) and clear the gradients."""
        gathering = [request for _, request in self._gathered.values() if request is not None]
        for request in [request for request, _, _ in self._pending] + gathering:
            try:
                request.start()  # a queued one reaches MPI, as on the ranks that got this far
            except Exception:  # noqa: S110 (the step's own error is the one to report)
                pass
        _ABANDONED.extend(self._pending)
        _ABANDONED.extend(self._host_copies)
        if self.param_store is not None:  # the pool's buffers MPI may still send from
            _ABANDONED.extend(self.param_store.abandon())
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
        for i, entry in enumerate(pending):
            try:
                self._finish(entry)
            except BaseException:
                self._pending = pending[i + 1:] + self._pending  # still in flight: not lost
                raise
        self._land_host_copies(block=True)
        self._zero_stale()  # what no reduction wrote this step (none, in stages 1-3)

    @staticmethod
    def _finish(entry) -> None:
        request, callback, _ = entry
        request.wait()
        if callback:
            callback()

"""Engine: trains a unit model with a ZeRO partition strategy over MPI.

    from zmpi.engine import Engine
    engine = Engine(model, {"train_micro_batch_size_per_gpu": 4,
                            "zero_optimization": {"stage": 3}, "fp16": {"enabled": True}})
    loss = engine.train_step(x, y)      # x, y: this rank's rows of the step's global batch

Run under `mpiexec -n N python -m mpi4py script.py` (or plain `python` for one rank).

The engine owns every buffer (through the strategy, accounted in `engine.memory`), runs the
model's units with the strategy's hooks, and does what is the same for every stage: loss
scaling, the overflow check, averaging over the global batch, global-norm gradient clipping
across shards, and Adam on the rank's master shard. The strategy decides what is kept and
which collectives run (zero/strategy.py).

ZeRO-Offload (`zero_optimization.offload_optimizer = {"device": "cpu"}`) puts the master
shard, Adam's moments and the reduced gradient shard on the host, where `HostAdam` updates
them. With `"delay_update": true` (DPU, Ren et al., ATC'21 Sec. 5.2), after
`delay_update_warmup` synchronous steps the host Adam of step t runs in a background thread
while forward and backward of step t+1 run with the parameters of step t-1: the update of step
t lands (and its parameters are published) at the end of step t+1's backward. `flush()` lands
an update in flight; `eval_loss`, `gather_parameters` and `close` call it.

`save_checkpoint` / `load_checkpoint` write and read the whole training state as sharded HDF5
(zmpi/checkpoint): loadable at any world size and by any strategy, offload on or off.
"""
from __future__ import annotations

import json
import math
import threading
import time
import warnings
import weakref
from pathlib import Path

import numpy as np

from zmpi import backend
from zmpi.backend import array_module
from zmpi.checkpoint import sharded as checkpoint
from zmpi.config import Config
from zmpi.memory import ARRAY_OPS, MemoryLedger
from zmpi.nn.module import Module, UnitHooks, UnitModel, activations_counted_in
from zmpi.optim import lr_schedules
from zmpi.optim.adam import Adam, HostAdam, host_threads
from zmpi.optim.loss_scaler import LossScaler
from zmpi.runinfo import git_revision
from zmpi.zero.flat import ModelLayout, UnitLayout
from zmpi.zero.strategy import get_strategy


class PhaseProfile:
    """Seconds per phase of train_step, summed over steps: forward, backward (compute plus the
    strategy's hooks), step (reductions, optimizer, publishing), and within them the time
    blocked in MPI (`waited`; on the critical rank, exposed communication, see
    `critical_path`) and in the optimizer; and per unit, the seconds of its forward and
    backward (hooks included: a stage-3 gather shows in its unit) and the MPI waits within
    them. Host time: on a GPU nothing is synchronised for it, so
    device work shows in the phase that next waits for it; a delayed (DPU) update counts only
    where the step waits for it. The first step (compiling the host loops, first touch of
    every buffer) is left out of the figures once there are others."""

    PHASES = ("forward", "backward", "step", "optimizer", "waited")
    UNIT_PHASES = ("forward", "backward", "waited")

    def __init__(self, unit_names=()):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.unit_names = list(unit_names)
        self.units = [dict.fromkeys(self.UNIT_PHASES, 0.0) for _ in self.unit_names]
        self.steps = 0
        self._first = None  # (seconds, units) at the end of the first step
        self._unit_start = (0.0, 0.0)

    def clock(self):
        return _Clock(self)

    def unit_begins(self) -> None:
        from zmpi.comm import waited_seconds

        self._unit_start = (time.perf_counter(), waited_seconds())

    def unit_ends(self, u: int, phase: str) -> None:
        from zmpi.comm import waited_seconds

        start, waited = self._unit_start
        self.units[u][phase] += time.perf_counter() - start
        self.units[u]["waited"] += waited_seconds() - waited

    def critical_path(self, comm) -> tuple[int, float, float]:
        """(rank, exposed, imbalance), seconds per step (a collective). The critical rank is
        the one busy longest (forward + backward + step less its MPI waits): it never waits
        for a slower rank, so its waits are the communication the step did not hide. What
        other ranks wait beyond that, up to `imbalance`, is waiting for the critical rank's
        compute (load imbalance, or a busy core), not for the network."""
        return self._critical(self._gather(comm))

    def step_ends(self) -> None:
        self.steps += 1
        if self.steps == 1:
            self._first = (dict(self.seconds), [dict(unit) for unit in self.units])

    def counted(self) -> tuple[int, dict, list]:
        """(steps, seconds, units) of the steps counted: all but the first when there were
        more."""
        if self.steps < 2:
            return self.steps, dict(self.seconds), self.units
        seconds, units = self._first
        return (self.steps - 1, {p: self.seconds[p] - seconds[p] for p in self.PHASES},
                [{p: now[p] - then[p] for p in self.UNIT_PHASES}
                 for now, then in zip(self.units, units, strict=True)])

    def _gather(self, comm) -> list:
        return comm.allgather_object((comm.rank, *self.counted()))

    @staticmethod
    def _critical(rows) -> tuple[int, float, float]:
        per = [(rank, (s["forward"] + s["backward"] + s["step"] - s["waited"]) / max(steps, 1),
                s["waited"] / max(steps, 1)) for rank, steps, s, _ in rows]
        rank, _, exposed = max(per, key=lambda r: r[1])
        return rank, exposed, max(w for _, _, w in per) - exposed

    def table(self, comm) -> str:
        """Every rank's milliseconds per step per phase, the critical path, then per unit the
        slowest rank's (a collective)."""
        rows = self._gather(comm)
        lines = [f"{'rank':>4} " + " ".join(f"{p + ' ms':>13}" for p in self.PHASES)
                 + f" {'waited share':>13}"]
        for rank, steps, s, _ in rows:
            per = {p: 1e3 * s[p] / max(steps, 1) for p in self.PHASES}
            total = per["forward"] + per["backward"] + per["step"]
            lines.append(f"{rank:>4} " + " ".join(f"{per[p]:>13.1f}" for p in self.PHASES)
                         + f" {100 * per['waited'] / max(total, 1e-9):>12.1f}%")
        rank, exposed, imbalance = self._critical(rows)
        lines.append(f"critical path: rank {rank} (busy longest); its waits, "
                     f"{1e3 * exposed:.1f} ms/step, are exposed communication; other ranks "
                     f"wait up to {1e3 * imbalance:.1f} ms/step more for its compute")
        if self.unit_names:
            w = max(map(len, self.unit_names))
            lines.append(f"{'unit':>4} {'':<{w}}" + " ".join(f"{p + ' ms':>13}"
                                                          for p in self.UNIT_PHASES))
            for u, name in enumerate(self.unit_names):
                worst = {p: max(1e3 * units[u][p] / max(steps, 1) for _, steps, _, units in rows)
                         for p in self.UNIT_PHASES}
                lines.append(f"{u:>4} {name:<{w}}"
                             + " ".join(f"{worst[p]:>13.1f}" for p in self.UNIT_PHASES))
        return "\n".join(lines)


class _Clock:
    def __init__(self, profile):
        from zmpi.comm import waited_seconds

        self.profile, self.waited_seconds = profile, waited_seconds
        self.last, self.waited = time.perf_counter(), waited_seconds()

    def lap(self, phase, optimizer=0.0):
        now, waited = time.perf_counter(), self.waited_seconds()
        s = self.profile.seconds
        s[phase] += now - self.last
        s["waited"] += waited - self.waited
        s["optimizer"] += optimizer
        self.last, self.waited = now, waited
        if phase == "step":
            self.profile.step_ends()


class _EngineHooks(UnitHooks):
    """The model's way to its engine's hooks: a weak reference, so that an engine and its model
    form no cycle and dropping the engine frees its buffers at once."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def _live(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the Engine this model was given to is gone; its parameters "
                               "lived in that engine's buffers: build a new model")
        return engine

    def before_forward(self, unit):
        self._live().before_forward(unit)

    def after_forward(self, unit):
        self._live().after_forward(unit)

    def before_backward(self, unit):
        self._live().before_backward(unit)

    def after_backward(self, unit):
        self._live().after_backward(unit)


def as_config(config) -> Config:
    """A Config from a Config, a DeepSpeed-style dict, a JSON path, or None (defaults)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    return Config.from_json(Path(config).read_text())


class Engine:
    """ZeRO data-parallel training of `model` (a zmpi.nn UnitModel built in fp32, identically
    seeded on every rank). After construction the model's Parameters are views into buffers the
    engine owns; in ZeRO-3 they are None while their unit is released."""

    def __init__(self, model, config=None, comm=None):
        if comm is None:
            from zmpi.comm import Comm

            comm = Comm()
        self.comm = comm
        backend.keep_freed_host_memory()  # a step re-allocates what the last one freed
        if backend.is_gpu and backend.device_source is None:  # no launcher variable: fall back
            backend.select_device(comm.local_rank)
        if backend.is_gpu and comm.local_size > backend.device_count() and comm.local_rank == 0:
            warnings.warn(f"{comm.local_size} ranks share {backend.device_count()} GPUs on this "
                          "node: run one rank per GPU", stacklevel=2)
        self.config = as_config(config).resolve_batch(comm.size)
        self.micro_batch = self.config.train_micro_batch_size_per_gpu
        self.accumulation = self.config.gradient_accumulation_steps
        self.xp = backend.xp
        budget = self.config.memory_budget
        self.memory = MemoryLedger(backend.device_memory_in_use if backend.is_gpu else None,
                                   {"device": budget.device, "host": budget.host})
        from zmpi.comm import account_staging_in

        account_staging_in(self.memory)  # pinned staging buffers in the ledger's host column

        if not isinstance(model, UnitModel):
            model = self._as_one_unit(model, comm)
        self.model = model
        units = list(model.units)
        names = {id(p): name for name, p in model.named_parameters()}  # model-wide names
        unit_params = [{names[id(p)]: p for _, p in unit.named_parameters()} for unit in units]
        self._check_units(units, unit_params)
        self.dtype = self._storage_dtype(unit_params)
        # fp32 master weights and Adam state; fp64 when the model itself is fp64 (exactness tests).
        self.master_dtype = np.dtype(np.float64 if self.dtype == np.float64 else np.float32)
        cls = get_strategy(self.config.strategy_name)
        # The strategy's groups: the ranks that partition the model states (the layout's
        # world size) and the ranks that replicate them (hybrid sharding).
        shard_group, replica_group = cls.process_groups(comm, self.config.zero_optimization)
        self.layout = ModelLayout([UnitLayout.build({n: p.data.shape for n, p in ps.items()},
                                                    shard_group.size) for ps in unit_params])
        initial = np.zeros(self.layout.full_numel, self.master_dtype)
        for u, params in enumerate(unit_params):
            views = self.layout.units[u].views(initial[self.layout.full_slice(u)])
            for name, p in params.items():
                views[name][...] = backend.to_host(p.data)
        self._check_same_on_all_ranks(initial)

        self.strategy = cls(units, unit_params, self.layout, shard_group, self.memory,
                            self.dtype, self.master_dtype, self.xp,
                            self.config.zero_optimization, replica_group)
        self.strategy.initialize(initial)
        self._unit_index = {id(unit): u for u, unit in enumerate(units)}
        model.hooks = _EngineHooks(self)

        opt = self.config.optimizer
        hyper = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                     weight_decay=opt.weight_decay, decoupled=opt.decoupled_weight_decay)
        if isinstance(self.strategy.master, np.ndarray):  # host memory: offload, or a CPU run
            self.optimizer = HostAdam(**hyper, threads=host_threads(comm.local_size))
        else:
            self.optimizer = Adam(**hyper)
        sched = self.config.scheduler
        self.schedule = None if sched.type is None else lr_schedules.build(
            sched.type, sched.params, opt.lr, opt.betas)
        offload = self.config.zero_optimization.offload_optimizer
        self.delay_update, self.delay_update_warmup = (offload.delay_update,
                                                       offload.delay_update_warmup)
        self._update = None  # the delayed update in flight: (thread, outcome dict)
        self._unpublished = False  # a finished delayed update whose params are not published
        self.pending_save = None  # an asynchronous checkpoint save in flight
        self.update_timing = {"optimizer_s": 0.0, "waited_s": 0.0, "delayed_steps": 0}
        # per-phase and per-unit time of every train_step
        self.phases = PhaseProfile(type(u).__name__ for u in self.model.units)
        fp16 = self.config.fp16
        self.scaler = LossScaler.from_config(fp16) if fp16.enabled else LossScaler.disabled()
        self.global_steps = 0
        if self.config.debug.check_collectives:
            for c in (self.comm, *self.strategy.comms().values()):
                c.enable_collective_checks()
        self.reset_counters()
        notes = self.config.notes()
        if notes and comm.rank == 0:
            warnings.warn("zmpi config: " + "; ".join(notes), stacklevel=2)

    # ---- model hooks: unit object -> strategy hook on its index --------------------------
    def before_forward(self, unit):
        self.phases.unit_begins()
        self.strategy.before_forward(self._unit_index[id(unit)])

    def after_forward(self, unit):
        u = self._unit_index[id(unit)]
        self.strategy.after_forward(u)
        self.phases.unit_ends(u, "forward")

    def before_backward(self, unit):
        self.phases.unit_begins()
        self.strategy.before_backward(self._unit_index[id(unit)])

    def after_backward(self, unit):
        u = self._unit_index[id(unit)]
        self.strategy.after_backward(u)
        self.phases.unit_ends(u, "backward")

    # ---- training -------------------------------------------------------------------------
    def train_step(self, inputs, targets) -> float:
        """One optimizer step on this rank's rows of the global batch.

        inputs, targets: (micro_batch * gradient_accumulation_steps, ...) — this rank's share;
        they are split into micro-batches. Gradients are averaged over the global batch
        (all ranks, all micro-batches; over the counted targets of all of them when the
        model's loss ignores some, see zmpi.nn.losses). Returns the global mean loss (same on
        every rank).
        """
        rows = self.micro_batch * self.accumulation
        if len(inputs) != rows or len(targets) != rows:
            raise ValueError(
                f"train_step got {len(inputs)} input and {len(targets)} target rows; the config "
                f"asks for train_micro_batch_size_per_gpu ({self.micro_batch}) x "
                f"gradient_accumulation_steps ({self.accumulation}) = {rows} rows per rank")
        self.model.check_batch(inputs, targets)  # before any collective: bad data, clear error
        if self.pending_save is not None:
            checkpoint.poll(self)  # an asynchronous save completes once every rank wrote
        try:
            with activations_counted_in(self.memory):  # the layers' caches, as "activation"
                return self._train_step(inputs, targets)
        except BaseException:
            self.strategy.abandon_in_flight()  # no freed buffer may still be MPI's
            raise

    def _train_step(self, inputs, targets) -> float:
        total, normalizer = 0.0, self._normalizer(targets, self.accumulation)
        clock = self.phases.clock()
        for i in range(self.accumulation):
            rows_i = slice(i * self.micro_batch, (i + 1) * self.micro_batch)
            self.strategy.sync_gradients = i == self.accumulation - 1
            total = total + self.model.forward_loss(self.xp.asarray(inputs[rows_i]),
                                                    self.xp.asarray(targets[rows_i]), normalizer)
            clock.lap("forward")
            self.model.backward_loss(scale=self.scaler.scale)
            clock.lap("backward")
        optimizer_before = self.update_timing["optimizer_s"]
        self._step()
        clock.lap("step", optimizer=self.update_timing["optimizer_s"] - optimizer_before)
        every = self.config.debug.check_replicas_every
        if every and self.global_steps % every == 0:
            self.check_replicas()
        loss = self.comm.allreduce_scalar(float(total) / self.accumulation) / self.comm.size
        if not math.isfinite(loss) and not self.config.fp16.enabled:
            raise FloatingPointError(f"the loss is {loss} at step {self.global_steps - 1} "
                                     f"({self.dtype.name})")
        return loss

    def eval_loss(self, inputs, targets) -> float:
        """Mean loss of a forward pass over every rank's `inputs` (no gradients, no update).
        A collective: every rank must call it (stage 3 gathers parameters, and the mean is
        an allreduce). A delayed update in flight lands first."""
        self.model.check_batch(inputs, targets)
        self.flush()
        with activations_counted_in(self.memory):
            loss = self.model.loss(self.xp.asarray(inputs), self.xp.asarray(targets),
                                   self._normalizer(targets, 1))
            self.model.clear_cache()  # no backward follows
        return self.comm.allreduce_scalar(loss) / self.comm.size

    def _normalizer(self, targets, micro_batches):
        """None when every target counts; else the global count of counted targets over
        (ranks x micro_batches), so that the mean of the micro-batch losses is the loss over
        every rank's counted targets (one scalar allreduce)."""
        local = self.model.loss_fn.count(targets)
        if local is None:
            return None
        return max(self.comm.allreduce_scalar(local), 1.0) / (self.comm.size * micro_batches)

    def flush(self) -> None:
        """Land the delayed update in flight, if any: wait for the host Adam thread, raise
        its error, publish the parameters it produced. A collective in stages 1-2 (the
        updated shards are allgathered): every rank calls it."""
        self.wait_update()
        if self._unpublished:
            self._unpublished = False
            self.strategy.publish_params()

    def wait_update(self) -> None:
        """Wait for the delayed update in flight, if any, and raise its error; the parameters
        it produced stay unpublished until `flush` (a checkpoint saves them that way)."""
        if self._update is None:
            return
        thread, outcome = self._update
        start = time.perf_counter()
        thread.join()
        self.update_timing["waited_s"] += time.perf_counter() - start
        self._update = None
        if "error" in outcome:
            raise RuntimeError(f"the delayed optimizer step {outcome['step']} failed in its "
                               "background thread") from outcome["error"]
        self._unpublished = True

    def close(self) -> None:
        """Finish an asynchronous checkpoint save, land any delayed update and stop the
        optimizer's threads. A collective."""
        checkpoint.finish_pending(self)
        self.flush()
        self.optimizer.close()

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, directory, tag=None, keep_last=None, async_=False,
                        client_state=None):
        """Save the whole training state under directory/tag (default tag `step<N>`, N the
        global step) and point directory/latest at it. A collective: every rank calls it with
        the same arguments and writes its shard; returns the checkpoint's directory.

        keep_last=K deletes all but the K newest complete checkpoints in `directory`, after
        the new one is complete. async_=True copies this rank's state to host buffers and
        writes it in a background thread; the checkpoint is completed (manifest, `latest`)
        at the first train_step after every rank finished writing, or at the next save, load
        or close, where an error in the writer is raised. client_state: a JSON-serialisable
        dict stored with the checkpoint (rank 0's), e.g. the data position; load returns it.
        A CheckpointError is raised on every rank if any rank fails."""
        return checkpoint.save(self, directory, tag, keep_last, async_, client_state)

    def load_checkpoint(self, directory, tag=None, verify=True):
        """Restore the whole training state from directory/tag (default: the tag `latest`
        names), saved at any world size and by any strategy. A collective. Every file read is
        checked against the manifest (size, and CRC-32 unless verify=False) and HDF5's
        Fletcher-32; any problem raises a CheckpointError on every rank that names the file,
        and the engine is left as it was. Returns a `Loaded` (tag, step, client_state and
        notes on what differs from this engine's config)."""
        return checkpoint.load(self, directory, tag, verify)

    def checkpoint_state(self, client_state=None) -> dict:
        """Everything but the four model states that a checkpoint records (its manifest)."""
        opt = self.optimizer
        body = {
            "world_size": self.layout.world_size, "strategy": self.strategy.name,
            "dtype": self.dtype.name, "master_dtype": self.master_dtype.name,
            "num_params": self.num_params, "layout": self.layout.to_dict(),
            "tied": self.model.tied_parameters(), "global_steps": self.global_steps,
            "optimizer": {**opt.state_dict(), "lr": self.config.optimizer.lr,
                          "betas": list(self.config.optimizer.betas), "eps": opt.eps,
                          "weight_decay": opt.weight_decay, "decoupled": opt.decoupled},
            "scheduler": self.config.scheduler.to_dict(), "last_lr": opt.lr,
            "loss_scaler": self.scaler.state_dict() if self.config.fp16.enabled else None,
            "unpublished_update": self._unpublished, "config": self.config.to_dict(),
            "client_state": client_state or {}, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "git_revision": git_revision() if self.comm.rank == 0 else None,
        }
        json.dumps(body["client_state"])  # TypeError now, not when the manifest is written
        return body

    def restore_checkpoint_state(self, manifest: dict, states: dict) -> list[str]:
        """Install a checkpoint read by zmpi.checkpoint (a collective). `states`: this rank's
        owned shard of each model state, in this engine's layout; without "params" (the
        storage dtype changed) the parameters are the master weights cast. Returns notes on
        what the checkpoint had that this engine's config overrides."""
        notes = []
        try:
            self.wait_update()  # an update in flight is superseded by the checkpoint
        except RuntimeError as e:
            notes.append(f"discarded a failed delayed update: {e}")
        for state, shard in states.items():
            self.strategy.set_state_shard(state, shard)
        self.global_steps = manifest["global_steps"]
        saved = manifest["optimizer"]
        self.optimizer.load_state_dict(saved)
        opt, base = self.optimizer, self.config.optimizer
        for key, ours in (("lr", base.lr), ("betas", list(base.betas)), ("eps", opt.eps),
                          ("weight_decay", opt.weight_decay), ("decoupled", opt.decoupled)):
            if saved[key] != ours:
                notes.append(f"optimizer {key} is {ours!r} (the checkpoint had {saved[key]!r})")
        if "scheduler" in manifest and manifest["scheduler"] != self.config.scheduler.to_dict():
            notes.append(f"the scheduler is {self.config.scheduler.to_dict()} (the checkpoint "
                         f"had {manifest.get('scheduler')}); it goes on from step "
                         f"{self.global_steps}")
        opt.lr = manifest.get("last_lr", opt.lr) if self.schedule else opt.lr
        if manifest["dtype"] != self.dtype.name:
            notes.append(f"parameters are stored as {self.dtype.name} (the checkpoint had "
                         f"{manifest['dtype']}): they are the master weights cast")
        if manifest["loss_scaler"] is not None and self.config.fp16.enabled:
            self.scaler.load_state_dict(manifest["loss_scaler"])
        elif manifest["loss_scaler"] is not None or self.config.fp16.enabled:
            notes.append("the loss scaler starts afresh (fp16 is "
                         f"{'on' if self.config.fp16.enabled else 'off'} here, "
                         f"{'off' if self.config.fp16.enabled else 'on'} in the checkpoint)")
        # A delayed update saved before its publication lands at the next step, as it would
        # have without the checkpoint; otherwise publish now.
        self._unpublished = manifest["unpublished_update"] or "params" not in states
        delayed = (self.delay_update and self.global_steps >= self.delay_update_warmup
                   and "params" in states)
        if self._unpublished and not delayed:
            self.flush()
        return notes

    def _step(self) -> None:
        try:
            self._reduce_and_update()
        finally:
            self.strategy.zero_grads()  # also after an error, so the next step starts clean

    def _reduce_and_update(self) -> None:
        strategy = self.strategy
        strategy.wait_pending()
        strategy.before_step()
        # Reduced gradients (this rank's shard, storage dtype): the optimizer reads them as
        # grads * grad_scale (the global-batch mean) * clip_coef, converted chunk by chunk.
        grads = strategy.optimizer_grads()
        self._check_grads_contract(grads)
        grad_scale = 1.0 / (self.scaler.scale * self.comm.size * self.accumulation)
        finite, sumsq = self.optimizer.grad_stats(grads, grad_scale, self.master_dtype)
        self.flush()  # the previous step's delayed update lands (its compute overlapped ours)
        self._apply_schedule()  # a skipped step keeps the rate it would have run at
        if self._any_rank(not finite):
            scaler = self.scaler
            at_minimum = scaler.scale <= scaler.min_scale and scaler.hysteresis_left <= 1
            if not self.config.fp16.enabled or at_minimum:
                where = self._first_nonfinite_unit(grads)
                raise FloatingPointError(
                    f"non-finite gradients at optimizer step {self.global_steps} "
                    f"({self.scaler.skipped_steps} skipped before; {self.dtype.name}"
                    + (f", loss scale already at its minimum {scaler.min_scale:g}"
                       if self.config.fp16.enabled else "")
                    + f"); the first in backward order is in {where}")
            scaler.update(overflow=True)  # skip the step on every rank
            return
        update = (strategy.master, grads, strategy.adam_m, strategy.adam_v, grad_scale,
                  self._clip_coef(sumsq))
        if self.delay_update and self.global_steps >= self.delay_update_warmup:
            strategy.swap_grad_buffers()  # backward of the next step fills the other buffer
            self._start_delayed_update(update)
        else:
            start = time.perf_counter()
            self.optimizer.step_(*update)
            self.update_timing["optimizer_s"] += time.perf_counter() - start
            strategy.publish_params()
        self.scaler.update(overflow=False)
        self.global_steps += 1

    def check_replicas(self) -> None:
        """Compare, by CRC-32, every copy of the state that ranks should hold identically: the
        step, loss scale and optimizer step on every rank; each unit of each replicated model
        state (parameters in stages 0-2, everything in stage 0) on every rank; each unit of
        each sharded state across the replicas of a shard (hybrid sharding). A collective;
        RuntimeError on every rank, naming the first differing state and unit and which ranks
        hold which copy. `debug.check_replicas_every` runs it every K steps."""
        import zlib

        self.wait_update()  # the delayed update writes the master weights
        strategy, layout = self.strategy, self.layout
        scalars = (self.global_steps, self.scaler.scale, self.optimizer.step_count)
        checks = [("world", self.comm, "step, loss scale and optimizer step", [scalars])]
        for state in ("params", "master", "adam_m", "adam_v"):
            buf, sharded = strategy.state_buffer(state)
            if sharded and strategy.replica is None:
                continue
            host = backend.to_host(buf)
            slices = [layout.shard_slice(u) if sharded else layout.full_slice(u)
                      for u in range(len(layout.units))]
            checks.append(("replica" if sharded else "world",
                           strategy.replica if sharded else self.comm, state,
                           [zlib.crc32(np.ascontiguousarray(host[s]).view(np.uint8))
                            for s in slices]))
        for kind, comm, what, digests in checks:
            everyone = comm.allgather_object((self.comm.rank, digests))  # world ranks
            ranks = [r for r, _ in everyone]
            for u, copies in enumerate(zip(*(d for _, d in everyone), strict=True)):
                if len(set(copies)) > 1:
                    holders = {}
                    for r, d in zip(ranks, copies, strict=True):
                        holders.setdefault(d, []).append(r)
                    unit = "" if what.startswith("step") else (
                        f" of unit {u} ({type(self.model.units[u]).__name__})")
                    raise RuntimeError(
                        f"replicas diverged after step {self.global_steps}: {what}{unit} "
                        f"differs between the ranks of the {kind} group: "
                        + "; ".join(f"ranks {rs} hold copy {i}"
                                    for i, rs in enumerate(holders.values())))

    def _first_nonfinite_unit(self, grads) -> str:
        """The last unit (the first in backward order) whose reduced gradient holds a NaN or
        inf on any rank, described by index, type and parameter names (a collective)."""
        xp, layout = array_module(grads), self.layout
        local = -1
        for u in reversed(range(len(layout.units))):
            part = layout.shard_slice(u) if self.strategy.shard_optimizer else layout.full_slice(u)
            if not bool(xp.isfinite(grads[part]).all()):
                local = u
                break
        u = int(self.comm.allreduce_scalar(local, op="max"))
        names = [s.name for s in layout.units[u].slots]
        return (f"unit {u} ({type(self.model.units[u]).__name__}: "
                f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")

    def _apply_schedule(self) -> None:
        """Set the optimizer's lr (and betas, for OneCycle) for the step about to be applied:
        the schedule at DeepSpeed's last_batch_iteration = applied steps - 1."""
        if self.schedule is None:
            return
        it = self.global_steps - 1
        self.optimizer.lr = self.schedule.lr(it)
        betas = self.schedule.betas(it)
        if betas is not None:
            self.optimizer.betas = betas

    @property
    def lr(self) -> float:
        """The learning rate of the last step (for a step skipped on overflow, the rate it
        would have run at; the configured lr before the first step)."""
        return self.optimizer.lr

    def _start_delayed_update(self, update) -> None:
        outcome = {"step": self.global_steps}

        def run():
            start = time.perf_counter()
            try:
                self.optimizer.step_(*update)
            except BaseException as e:  # handed to the training thread by flush()
                outcome["error"] = e
            self.update_timing["optimizer_s"] += time.perf_counter() - start

        thread = threading.Thread(target=run, name="zmpi-delayed-update")
        thread.start()
        self._update = (thread, outcome)
        self.update_timing["delayed_steps"] += 1

    def _clip_coef(self, sumsq: float) -> float:
        """Factor that brings the global L2 norm over all ranks' shards to gradient_clipping
        (1.0 when it is below, or clipping is off)."""
        max_norm = self.config.gradient_clipping
        if max_norm <= 0:
            return 1.0
        if self.strategy.shard_optimizer:  # each shard group holds the whole model once
            sumsq = self.strategy.comm.allreduce_scalar(sumsq)
        coef = max_norm / (math.sqrt(sumsq) + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        return min(coef, 1.0)

    def _storage_dtype(self, unit_params) -> np.dtype:
        """fp16/bf16 when the config enables them, else the model's own float32 or float64."""
        if self.config.dtype_name != "float32":
            return backend.dtype_from_name(self.config.dtype_name)
        dtypes = {np.dtype(p.data.dtype) for params in unit_params for p in params.values()}
        if len(dtypes) != 1 or not dtypes <= {np.dtype(np.float32), np.dtype(np.float64)}:
            raise ValueError(f"build the model in float32 (or float64), not "
                             f"{sorted(map(str, dtypes))}; select fp16/bf16 storage with the "
                             "config's fp16/bf16 sections")
        return dtypes.pop()

    def _any_rank(self, flag: bool) -> bool:
        return self.comm.allreduce_scalar(float(flag), op="max") > 0

    # ---- inspection -------------------------------------------------------------------------
    def gather_parameters(self) -> dict[str, np.ndarray]:
        """Full master value (fp32; fp64 for fp64 models) of every parameter, on every rank.
        A collective: every rank must call it. A delayed update in flight lands first."""
        self.flush()
        full = backend.to_host(self.strategy.full_master())
        out = {}
        for u, unit_layout in enumerate(self.layout.units):
            for name, view in unit_layout.views(full[self.layout.full_slice(u)]).items():
                out[name] = view.copy()
        return out

    def reset_counters(self) -> None:
        """Zero the counters of the world Comm and of every group the strategy sends on."""
        for comm in {id(c): c for c in (self.comm, *self.strategy.comms().values())}.values():
            comm.reset_counters()

    def traffic(self) -> dict[str, dict]:
        """{group kind: {op: {calls, bytes, sent}}} counted since the last reset, for every
        communicator the strategy sends on ("world"; "shard" and "replica" for hybrid)."""
        return {kind: comm.counters_snapshot() for kind, comm in self.strategy.comms().items()}

    def sent_bytes(self) -> dict[str, int]:
        """{group kind: bytes this rank sent in array collectives} since the last reset (ring
        model): what the strategy's `expected_traffic` declares per step."""
        return {kind: sum(c.sent for op, c in comm.counters.items() if op in ARRAY_OPS)
                for kind, comm in self.strategy.comms().items()}

    @property
    def num_params(self) -> int:
        return self.layout.num_params

    def describe(self) -> dict:
        """What this run is: config, world size, strategy, layout sizes (for run outputs)."""
        return {"config": self.config.to_dict(), "world_size": self.comm.size,
                "strategy": self.strategy.name, "shard_group_size": self.layout.world_size,
                "num_params": self.num_params,
                "padding": self.layout.padding, "dtype": self.dtype.name,
                "backend": backend.name}

    # ---- checks -----------------------------------------------------------------------------
    @staticmethod
    def _as_one_unit(model, comm) -> UnitModel:
        """A plain zmpi.nn Module runs as a one-unit UnitModel (softmax cross-entropy loss;
        wrap it yourself, UnitModel([module], loss=...), for another)."""
        if not isinstance(model, Module):
            raise TypeError(f"Engine needs a zmpi.nn UnitModel or Module, got "
                            f"{type(model).__name__}")
        if comm.rank == 0:
            warnings.warn(f"{type(model).__name__} is not a UnitModel: it runs as one unit. "
                          "ZeRO-3 then gathers all its parameters at once, so the peak "
                          "parameter memory is the whole model; split it into units "
                          "(zmpi.nn.UnitModel([...], loss=...)) to gather one at a time",
                          stacklevel=3)
        return UnitModel([model])

    def _check_grads_contract(self, grads) -> None:
        """The cheap invariant every strategy must keep: after before_step() the optimizer's
        gradient buffer exists and is laid out like the master weights."""
        master = self.strategy.master
        if grads is None or grads.shape != master.shape or grads.dtype != self.dtype:
            got = None if grads is None else f"{grads.shape} {grads.dtype}"
            raise RuntimeError(
                f"strategy {self.strategy.name!r} broke its contract: after before_step(), "
                f"optimizer_grads() must be a {master.shape} {self.dtype} buffer (the "
                f"master's layout), got {got}")

    @staticmethod
    def _check_units(units, unit_params) -> None:
        seen = {}
        for u, params in enumerate(unit_params):
            if not params:
                raise ValueError(f"unit {u} ({type(units[u]).__name__}) has no parameters")
            for name, p in params.items():
                if id(p) in seen:
                    raise ValueError(f"parameter {name} belongs to units {seen[id(p)]} and {u}")
                seen[id(p)] = u
        for u, unit in enumerate(units):
            for shared in getattr(unit, "shared_units", ()):
                if shared not in units or units.index(shared) >= u:
                    raise ValueError(f"unit {u} shares weights with a unit that is not an "
                                     "earlier unit of the model")

    def _check_same_on_all_ranks(self, initial) -> None:
        checksum = float(np.abs(initial).sum(dtype=np.float64))
        if not math.isfinite(checksum):
            raise ValueError("the model's initial parameters contain NaN or inf")
        low = self.comm.allreduce_scalar(checksum, op="min")
        high = self.comm.allreduce_scalar(checksum, op="max")
        if low != high:
            raise ValueError("ranks built different initial models: seed the model identically "
                             "on every rank")

    def __repr__(self) -> str:
        return f"Engine({json.dumps(self.describe(), default=str)})"

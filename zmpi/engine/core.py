"""Engine: trains a unit model with a ZeRO partition strategy over MPI.

    from zmpi.engine import Engine
    engine = Engine(model, {"train_micro_batch_size_per_gpu": 4,
                            "zero_optimization": {"stage": 3}, "fp16": {"enabled": True}})
    loss = engine.train_step(x, y)      # x, y: this rank's rows of the step's global batch

Run under `mpiexec -n N python -m mpi4py script.py` (or plain `python` for one rank).

The engine owns every buffer (through the strategy, accounted in `engine.memory`), runs the
model's units with the strategy's hooks, and does what is the same for every stage: loss
scaling, the overflow check, averaging over the global batch, global-norm gradient clipping
across shards, and Adam on the rank's master shard (step.py). The strategy decides what is
kept and which collectives run (zero/strategy.py), over the mesh's data-parallel group.
With pipeline stages (pipeline.stages > 1) the engine keeps this rank's stage of the model and
runs the configured schedule over the micro-batches (pipeline.py); with tensor parallelism
the model is split as it is built (tensor.py); with expert parallelism (moe.ep_size > 1) each
rank keeps its share of the MoE layers' experts, whose states a second instance of the
strategy holds over the expert-data-parallel group (moe.py).

ZeRO-Offload puts the master shard, Adam's moments and the reduced gradient shard on the host,
where `HostAdam` updates them; with `delay_update` (DPU, delayed.py) that update runs while
the next step computes. `flush()` lands an update in flight.

`save_checkpoint` / `load_checkpoint` write and read the whole training state as sharded HDF5
(zmpi/checkpoint): loadable at any world size, mesh and strategy, offload on or off.
"""
from __future__ import annotations

import contextlib
import json
import math
import uuid
import warnings

import numpy as np

from zmpi import backend, kernels
from zmpi.checkpoint.sharded import Checkpointer
from zmpi.checkpoint.tensor import TensorSplits
from zmpi.comm import make_progress
from zmpi.engine.build import build_strategy
from zmpi.engine.checkpoints import EngineCheckpoints
from zmpi.engine.checks import (
    agreed_across_stages,
    as_one_unit,
    check_input_slots,
    check_mesh,
    check_model_shape,
    check_replicas,
    check_sparse_attention,
    check_units,
    storage_dtype,
)
from zmpi.engine.delayed import DelayedUpdate
from zmpi.engine.hooks import EngineHooks, as_config
from zmpi.engine.moe import ExpertStates, MoERouting, check_moe, make_expert_parallel, split_experts
from zmpi.engine.optimizer import build_optimizer
from zmpi.engine.pipeline import PipelineRun
from zmpi.engine.profile import PhaseProfile
from zmpi.engine.step import reduce_and_update
from zmpi.engine.tensor import gather_tensor_slices, replicated_ranges, sequence_ranges
from zmpi.engine.traffic import EngineTraffic
from zmpi.kernels import flash_attention
from zmpi.memory import MemoryLedger
from zmpi.nn import functional as F
from zmpi.nn.checkpointing import InputStore
from zmpi.nn.module import UnitModel, activations_counted_in
from zmpi.optim import lr_schedules
from zmpi.optim.loss_scaler import LossScaler
from zmpi.parallel.mesh import Mesh
from zmpi.parallel.pipeline.stage import PipelineStage
from zmpi.zero import get_strategy


class Engine(EngineTraffic, EngineCheckpoints):
    """ZeRO data-parallel training of `model` (a zmpi.nn UnitModel built in fp32, identically
    seeded on every rank). After construction the model's Parameters are views into buffers the
    engine owns; in ZeRO-3 they are None while their unit is released."""

    def __init__(self, model, config=None, comm=None, mesh=None):
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
        config = as_config(config)
        if not isinstance(model, UnitModel):  # a plain Module: one unit
            model = as_one_unit(model, comm)
        # data x pipeline x tensor; the ZeRO strategies see only the data-parallel group
        self.mesh = mesh if mesh is not None else Mesh(
            comm, tp=config.tensor_parallel.autotp_size, pp=config.pipeline.stages,
            ep=config.moe.ep_size)
        check_mesh(self.mesh, config, model)
        check_model_shape(config, model)
        check_sparse_attention(config, model)
        self.moe = MoERouting(model)  # the MoE layers' routing and losses (engine/moe.py)
        check_moe(config, self.mesh, model)
        if self.mesh.experts is not None:  # each rank keeps its E / ep experts of each layer
            make_expert_parallel(self.moe, self.mesh.experts)
        self.config = config.resolve_batch(self.mesh.dp)
        self.micro_batch = self.config.train_micro_batch_size_per_gpu
        self.accumulation = self.config.gradient_accumulation_steps
        self.xp = backend.xp
        budget = self.config.memory_budget
        self.memory = MemoryLedger(backend.device_memory_in_use if backend.is_gpu else None,
                                   {"device": budget.device, "host": budget.host})
        from zmpi.comm import account_staging_in

        account_staging_in(self.memory)  # pinned staging buffers in the ledger's host column

        whole_units = len(model.units)
        if self.mesh.pp > 1:  # this rank keeps and trains its stage's units
            model = PipelineStage(model, self.mesh.pp_rank, self.mesh.pp,
                                  self.config.pipeline.partition)
            self.moe = MoERouting(model)  # the stage's MoE layers: it routes and sums those
        kernels.set_mode(self.config.kernels)
        flash_attention.set_kernel(self.config.attention_kernel)  # ConfigError for flash on NumPy
        if self.config.tf32:
            backend.use_tf32()
        ac = self.config.activation_checkpointing
        model.set_recompute(ac.recompute, self.config.pipeline.activation_checkpoint_interval,
                            InputStore(self.mesh.tp_comm if ac.partition_activations else None,
                                       ac.cpu_checkpointing, ac.number_checkpoints,
                                       ac.synchronize_checkpoint_boundary, ac.profile))
        check_input_slots(model, self.config, self.mesh, whole_units)
        self.model = model
        units = list(model.units)
        names = {id(p): name for name, p in model.named_parameters()}  # model-wide names
        unit_params = [{names[id(p)]: p for _, p in unit.named_parameters()} for unit in units]
        check_units(units, unit_params)
        # at ep > 1 the expert parameters have a strategy of their own (engine/moe.py)
        unit_params, expert_params = split_experts(unit_params)
        self.dtype = storage_dtype(self.config, unit_params)
        # fp32 master weights and Adam state; fp64 when the model itself is fp64 (exactness tests).
        self.master_dtype = np.dtype(np.float64 if self.dtype == np.float64 else np.float32)
        cls = get_strategy(self.config.strategy_name)
        # The strategy over the data-parallel group: its groups are the ranks that partition
        # the model states (the layout's world size) and the ranks that replicate them
        # (hybrid sharding).
        context = dict(ledger=self.memory, dtype=self.dtype, master_dtype=self.master_dtype,
                       xp=self.xp, config=self.config.zero_optimization, mesh=self.mesh,
                       aio=self.config.aio)
        self.strategy, self.layout = build_strategy(
            cls, self.mesh.dp_comm, units, unit_params, context,
            agree=lambda build: agreed_across_stages(self.mesh, build))
        # agreed across the stages: a stage without MoE blocks builds none, and would wait
        # for ever in the next collective across stages after a refusal on one that has some
        self.experts = agreed_across_stages(self.mesh, lambda: ExpertStates(
            cls, units, expert_params, self.mesh.experts, context) if expert_params else None)
        # the strategies every step runs: the engine's, and the experts' at ep > 1
        self.strategies = (self.strategy,) + ((self.experts.strategy,) if self.experts else ())
        self.tensor_splits = TensorSplits.of_model(unit_params, self.mesh.tp_comm)  # checkpoints
        # the schedule, and the weights tied across stages (engine/pipeline.py)
        self.pipeline = PipelineRun(self, model, unit_params) if self.mesh.pp > 1 else None
        held = self.pipeline.held_params if self.pipeline else frozenset()
        # where the tensor-replicated parameters sit in the optimizer's gradients (clipping)
        self.tp_replicated = replicated_ranges(self.layout, unit_params, self.strategy,
                                               held) if self.mesh.tp > 1 else []
        # those of them whose gradients are partial under sequence parallelism (summed over tp)
        self.tp_sequence = sequence_ranges(self.layout, unit_params,
                                           self.strategy) if self.mesh.tp > 1 else []
        self._unit_index = {id(unit): u for u, unit in enumerate(units)}
        model.hooks = EngineHooks(self)

        self.optimizer = build_optimizer(self)  # Adam, HostAdam or OneBitAdam (optimizer.py)
        opt, sched = self.config.optimizer, self.config.scheduler
        self.schedule = None if sched.type is None else lr_schedules.build(
            sched.type, sched.params, opt.lr, opt.betas)
        offload = self.config.zero_optimization.offload_optimizer
        self.delay_update, self.delay_update_warmup = (offload.delay_update,
                                                       offload.delay_update_warmup)
        self.update_timing = {"optimizer_s": 0.0, "waited_s": 0.0, "delayed_steps": 0}
        self.delayed = DelayedUpdate(self.update_timing)
        # this run's id is in every checkpoint it saves; loading a checkpoint continues its run
        self.checkpoints = Checkpointer(comm, comm.bcast_object(uuid.uuid4().hex))
        # per-phase and per-unit time of every train_step
        self.phases = PhaseProfile((type(u).__name__ for u in self.model.units),
                                   self.model.saved_inputs.recompute_seconds)
        fp16 = self.config.fp16
        self.scaler = LossScaler.from_config(fp16) if fp16.enabled else LossScaler.disabled()
        self.global_steps = 0
        if self.config.debug.check_collectives:
            experts = self.mesh.experts.comms().values() if self.mesh.experts else ()
            for c in (self.comm, *experts,
                      *(c for strategy in self.strategies for c in strategy.comms().values())):
                c.enable_collective_checks()
        self.reset_counters()
        notes = self.config.notes()
        if notes and comm.rank == 0:
            warnings.warn("zmpi config: " + "; ".join(notes), stacklevel=2)

    # ---- model hooks: unit object -> strategy hook on its index --------------------------
    def before_forward(self, unit):
        make_progress()  # messages in flight move between units (zmpi.comm.make_progress)
        self.phases.unit_begins()
        self.strategy.before_forward(self._unit_index[id(unit)])
        self._expert_hook("before_forward", unit)

    def after_forward(self, unit):
        u = self._unit_index[id(unit)]
        self.strategy.after_forward(u)
        self._expert_hook("after_forward", unit)
        self.phases.unit_ends(u, "forward")

    def before_backward(self, unit):
        make_progress()
        self.phases.unit_begins()
        self.strategy.before_backward(self._unit_index[id(unit)])
        self._expert_hook("before_backward", unit)

    def after_backward(self, unit):
        u = self._unit_index[id(unit)]
        self.strategy.after_backward(u)
        self._expert_hook("after_backward", unit)
        self.phases.unit_ends(u, "backward")

    def before_recompute(self, unit):
        make_progress()
        self.strategy.before_recompute(self._unit_index[id(unit)])
        self._expert_hook("before_recompute", unit)

    def after_recompute(self, unit):
        self.strategy.after_recompute(self._unit_index[id(unit)])
        self._expert_hook("after_recompute", unit)

    def _expert_hook(self, name, unit):
        """At ep > 1, the expert strategy's hook `name` on `unit` (after the engine's)."""
        if self.experts is not None:
            self.experts.hook(name, unit)

    # ---- training -------------------------------------------------------------------------
    def train_step(self, inputs, targets) -> float:
        """One optimizer step on this rank's rows of the global batch.

        inputs, targets: (micro_batch * gradient_accumulation_steps, ...) — this rank's share;
        they are split into micro-batches. Gradients are averaged over the global batch
        (all ranks, all micro-batches; over the counted targets of all of them when the
        model's loss ignores some, see zmpi.nn.losses). Returns the global mean loss (same on
        every rank), the MoE layers' auxiliary and z losses included. Data-parallel rank d's
        rows are rows [d b, (d + 1) b) of the global batch (zmpi.data's samplers): MoE layers
        route each sequence by its global row (engine/moe.py).
        """
        rows = self.micro_batch * self.accumulation
        if len(inputs) != rows or len(targets) != rows:
            raise ValueError(
                f"train_step got {len(inputs)} input and {len(targets)} target rows; the config "
                f"asks for train_micro_batch_size_per_gpu ({self.micro_batch}) x "
                f"gradient_accumulation_steps ({self.accumulation}) = {rows} rows per rank")
        checked = self.model.check_batch(inputs, targets)  # before any collective
        if self.checkpoints.pending is not None:
            self.checkpoints.poll()  # an asynchronous save completes once every rank wrote
        try:
            with activations_counted_in(self.memory), _ids_checked(checked):
                return self._train_step(inputs, targets)
        except BaseException:
            for strategy in self.strategies:
                strategy.abandon_in_flight()  # no freed buffer may still be MPI's
            raise

    def _train_step(self, inputs, targets) -> float:
        total, normalizer = 0.0, self._normalizer(targets, self.accumulation)
        clock = self.phases.clock()
        if self.pipeline is not None:  # the stage's share of every micro-batch, scheduled
            total = self.pipeline.train(self, inputs, targets, normalizer, clock)
        else:
            first = self.mesh.dp_rank * len(inputs)  # this rank's rows of the global batch
            for i in range(self.accumulation):
                rows_i = slice(i * self.micro_batch, (i + 1) * self.micro_batch)
                for strategy in self.strategies:
                    strategy.sync_gradients = (i == self.accumulation - 1
                                               and self.optimizer.reduces_gradients)
                self.moe.before(self.global_steps, first + rows_i.start, self.scaler.scale,
                                inputs[rows_i])
                loss = self.model.forward_loss(self.xp.asarray(inputs[rows_i]),
                                               self.xp.asarray(targets[rows_i]), normalizer)
                total = total + self.moe.with_losses(loss)
                self.moe.tally()
                clock.lap("forward")
                self.model.backward_loss(scale=self.scaler.scale)
                clock.lap("backward")
        optimizer_before = self.update_timing["optimizer_s"]
        total = self._step(total)  # read back with the gradients' norm, in one transfer
        clock.lap("step", optimizer=self.update_timing["optimizer_s"] - optimizer_before)
        every = self.config.debug.check_replicas_every
        if every and self.global_steps % every == 0:
            self.check_replicas()
        loss = self._mean_over_replicas(total / self.accumulation)
        if not math.isfinite(loss) and not self.config.fp16.enabled:
            raise FloatingPointError(f"the loss is {loss} at step {self.global_steps - 1} "
                                     f"({self.dtype.name})")
        return loss

    def eval_loss(self, inputs, targets) -> float:
        """Mean loss of a forward pass over every rank's `inputs` (no gradients, no update).
        A collective: every rank must call it (stage 3 gathers parameters, and the mean is
        an allreduce). A delayed update in flight lands first."""
        checked = self.model.check_batch(inputs, targets)
        self.flush()
        normalizer = self._normalizer(targets, 1)
        with activations_counted_in(self.memory), self.model.inference(), _ids_checked(checked):
            if self.pipeline is not None:
                loss = self.pipeline.evaluate(self, inputs, targets, normalizer)
            else:
                loss = self.model.loss(self.xp.asarray(inputs), self.xp.asarray(targets),
                                       normalizer)
                self.model.clear_cache()  # no backward follows
        return self._mean_over_replicas(loss)

    def _mean_over_replicas(self, loss: float) -> float:
        """The mean over the data-parallel replicas of a loss that the last pipeline stage
        computed (the only stage at pp = 1; the others pass 0.0): the same on every rank."""
        if self.pipeline is not None:
            loss = self.mesh.pp_comm.allreduce_scalar(loss)
        return self.mesh.dp_comm.allreduce_scalar(loss) / self.mesh.dp

    def _normalizer(self, targets, micro_batches):
        """None when every target counts; else the global count of counted targets over
        (ranks x micro_batches), so that the mean of the micro-batch losses is the loss over
        every rank's counted targets (one scalar allreduce)."""
        local = self.model.loss_fn.count(targets)
        if local is None:
            return None
        return max(self.mesh.dp_comm.allreduce_scalar(local), 1.0) / (self.mesh.dp
                                                                       * micro_batches)

    def flush(self) -> None:
        """Land the delayed update in flight, if any: wait for the host Adam thread, raise
        its error, publish the parameters it produced. A collective in stages 1-2 (the
        updated shards are allgathered): every rank calls it."""
        self.wait_update()
        if self.delayed.unpublished:
            self.delayed.unpublished = False
            for strategy in self.strategies:  # the experts' too at ep > 1
                strategy.publish_params()

    def wait_update(self) -> None:
        """Wait for the delayed update in flight, if any, and raise its error; the parameters
        it produced stay unpublished until `flush` (a checkpoint saves them that way)."""
        self.delayed.wait()

    def close(self) -> None:
        """Finish an asynchronous checkpoint save, land any delayed update, stop the
        optimizer's threads, remove the NVMe tier's files and free the sub-communicators
        (the mesh's and the strategy's).
        A collective; the engine cannot train after it."""
        self.checkpoints.finish()
        self.flush()
        self.optimizer.close()
        for strategy in self.strategies:
            strategy.close_storage()  # the NVMe tier's files
        self.checkpoints.release()
        for strategy in self.strategies:  # the policies' own groups (hybrid, ZeRO++)
            for group in strategy.comms().values():
                if group not in self.mesh.comms().values():
                    group.free()
        if self.pipeline is not None:
            self.pipeline.free()
        self.mesh.free()

    def _step(self, loss) -> float:
        try:
            return reduce_and_update(self, loss)
        finally:
            for strategy in self.strategies:
                strategy.zero_grads()  # also after an error, so the next step starts clean

    def check_replicas(self) -> None:
        """Compare, by CRC-32, every copy of the state that ranks should hold identically: the
        step, loss scale and optimizer step on every data-parallel rank; each unit of each
        replicated model state (parameters in stages 0-2, everything in stage 0) on every
        data-parallel rank; each unit of each sharded state across the replicas of a shard
        (hybrid sharding); under tensor parallelism, the optimizer states of the parameters
        every tensor rank holds whole; at ep > 1, the expert states likewise over the ranks
        holding the same experts (expert data parallel). A collective;
        RuntimeError on every rank, naming the first differing state and unit and which ranks
        hold which copy. `debug.check_replicas_every` runs it every K steps."""
        check_replicas(self)

    @property
    def lr(self) -> float:
        """The learning rate of the last step (for a step skipped on overflow, the rate it
        would have run at; the configured lr before the first step)."""
        return self.optimizer.lr

    # ---- inspection -------------------------------------------------------------------------
    def gather_parameters(self) -> dict[str, np.ndarray]:
        """Full master value (fp32; fp64 for fp64 models) of every parameter, on every rank,
        by its unsharded name and shape (tensor-parallel slices gathered). A collective:
        every rank must call it. A delayed update in flight lands first."""
        self.flush()
        full = backend.to_host(self.strategy.full_master())
        params = dict(self.model.named_parameters())
        held = self.pipeline.held_params if self.pipeline else frozenset()
        out = self.experts.gather() if self.experts else {}  # whole (E, ...) at ep > 1
        for u, unit_layout in enumerate(self.layout.units):
            for name, view in unit_layout.views(full[self.layout.full_slice(u)]).items():
                value = gather_tensor_slices(view, params[name], self.mesh.tp_comm)
                if id(params[name]) not in held:  # the owning stage gives a tied weight
                    out[name] = value
        return out if self.pipeline is None else self.pipeline.gather(out)

    @property
    def num_params(self) -> int:
        return self.layout.num_params + (self.experts.num_params if self.experts else 0)

    def describe(self) -> dict:
        """What this run is: config, world size, mesh, strategy, layout sizes (run outputs)."""
        return {"config": self.config.to_dict(), "world_size": self.comm.size,
                "mesh": self.mesh.describe(),
                "strategy": self.strategy.name, "shard_group_size": self.layout.world_size,
                "num_params": self.num_params,
                "padding": self.layout.padding, "dtype": self.dtype.name,
                "backend": backend.name}

    def __repr__(self) -> str:
        return f"Engine({json.dumps(self.describe(), default=str)})"


def _ids_checked(checked: bool):
    """F.ids_checked() when the model's check_batch range-checked every id, else nothing."""
    return F.ids_checked() if checked else contextlib.nullcontext()

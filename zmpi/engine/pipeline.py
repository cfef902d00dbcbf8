"""What the engine does differently under pipeline parallelism (the mesh's pp > 1).

Each rank trains its stage (zmpi.parallel.pipeline.PipelineStage) as a whole model: ZeRO
partitions the stage's units over the data-parallel group, the strategy's hooks run around
every unit. What spans the stages is here:

    PipelineRun(engine, stage, unit_params)   the stage's runner and its tied-weight groups
    run.train(engine, inputs, targets, normalizer, clock)   the schedule over m micro-batches
    run.sum_tied_grads(grads)     a tied unit's gradients summed over the stages holding it
    run.held_sumsq(grads, ...)    the held copies' share of this rank's squared gradients,
                                  which the global norm leaves out (the owner counts them)
    run.gather(params)            every stage's parameters, merged (a collective over pp)
    run.whole_layout, run.whole_splits   the whole model's layout and tensor splits, which a
                                  checkpoint's manifest records (each stage writes its units)

Every stage of a data-parallel replica gets the same rows: stage 0 reads the inputs, the last
stage the targets; the loss (summed on the last stage) is summed over pp to reach every rank.
MoE layers (docs/moe.md, Pipelines): each stage routes its own layers before every op of a
micro-batch, as the plain engine does before its forward, and adds their auxiliary and z
losses to its share of the loss, so the sum over pp is the cross-entropy plus every layer's
(not summed over tp: every tensor rank of a stage computes the same losses).
"""
from __future__ import annotations

from zmpi.checkpoint.tensor import TensorSplits
from zmpi.engine.tensor import allreduce_ranges, param_ranges, ranges_sumsq
from zmpi.parallel.pipeline.executor import StageRunner
from zmpi.zero.flat import ModelLayout


class PipelineRun:
    """The engine's pipeline state: its stage, the runner of the configured schedule, and one
    tied group (a Comm over the stages holding a copy of one unit, at this rank's dp and tp
    coordinates; None where this stage holds none) per entry of `stage.tied_groups`.
    Constructing it is a collective over the world (the groups are split from it)."""

    def __init__(self, engine, stage, unit_params):
        from zmpi.comm import MPI

        mesh = engine.mesh
        self.stage, self.mesh = stage, mesh
        self.runner = StageRunner(stage, mesh.pp_comm, engine.config.pipeline.schedule)
        self.tied = []  # (Comm, the unit's slices of the optimizer's gradients)
        for unit_id, holders in stage.tied_groups:
            color = mesh.dp_rank * mesh.tp + mesh.tp_rank if mesh.pp_rank in holders \
                else MPI.UNDEFINED
            comm = mesh.comm.split(color)
            if comm is not None:
                unit = unit_params[stage.unit_ids.index(unit_id)].values()
                self.tied.append((comm, param_ranges(engine.layout, unit_params,
                                                     engine.strategy,
                                                     lambda p, unit=unit: p in unit)))
        self.held_params = frozenset(id(p) for u in stage.held for p in unit_params[u].values())
        self.held_names = frozenset(name for u in stage.held for name in unit_params[u])
        self.held_ranges = param_ranges(engine.layout, unit_params, engine.strategy,
                                        lambda p: id(p) in self.held_params)
        self.whole_layout, self.whole_splits = self._whole(engine)
        self.whole_experts = self._whole_experts(engine) if mesh.experts is not None else None

    def _whole(self, engine):
        """(the layout of every stage's units in the model's order, held copies left out;
        every stage's tensor splits): what a checkpoint's manifest describes."""
        units = engine.layout.to_dict()["units"]
        mine = [(g, units[u]) for u, g in enumerate(self.stage.unit_ids)
                if u not in self.stage.held]
        layout, splits, _ = self._merged(mine, engine.layout.world_size, engine.tensor_splits)
        return layout, splits

    def _whole_experts(self, engine):
        """At ep > 1, the expert section of the whole model (zmpi.engine.moe.ExpertStates of
        every stage put together, a checkpoint's `experts`): (its layout, every expert unit
        in the model's order over the expert-data-parallel shards; its split over the ep
        ranks (an ExpertSplits over ep x tp under tensor parallelism); the split points of
        its units between the stages, [0, ..., units], equal neighbours where a stage holds
        no MoE layer). A collective over pp."""
        ex, mine = engine.experts, []
        if ex is not None:
            whole_id = {id(u): g for u, g in zip(self.stage.units, self.stage.unit_ids,
                                                  strict=True)}
            units = ex.layout.to_dict()["units"]
            mine = [(whole_id[id(unit)], units[i]) for i, unit in enumerate(ex.units)]
        shards = max(self.mesh.pp_comm.allgather_object(ex.layout.world_size if ex else 0))
        layout, splits, counts = self._merged(mine, shards, ex.splits if ex else None,
                                              self.mesh.ep * self.mesh.tp)
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        return layout, splits, bounds

    def _merged(self, mine, world_size: int, splits, size: int | None = None):
        """Every stage's `mine` ([(a unit's index in the whole model, its layout entry)]) and
        `splits` (a TensorSplits, an ExpertSplits (split over ep and tp), or None for none)
        put together: (the layout of those units in the model's order over `world_size`
        shards, the splits over `size` ranks (splits' own by default) of the stages' kind,
        how many units each stage gave). A collective over pp."""
        every, parts, counts = [], [], []
        for part, part_splits in self.mesh.pp_comm.allgather_object(
                (mine, splits.to_dict() if splits is not None else None)):
            every += part
            parts += [part_splits] if part_splits is not None else []
            counts.append(len(part))
        layout = ModelLayout.from_dict({"world_size": world_size,
                                        "units": [unit for _, unit in sorted(every)]})
        size = splits.size if size is None else size
        return layout, TensorSplits.from_dict(_merged_splits(parts, size)), counts

    def train(self, engine, inputs, targets, normalizer, clock):
        """The stage's forwards and backwards of the step's micro-batches (rows of `inputs`
        and `targets`, host arrays, this data-parallel rank's rows of the step's batch: every
        stage is given them); the last stage's loss sum (0.0 on other stages) plus the
        auxiliary and z losses of this stage's MoE layers over the micro-batches.

        MoE layers (engine/moe.py): before each op of micro-batch i, forward or backward, the
        stage's layers are told its routing (the step, the global row of its first sequence,
        the loss scale), as the plain engine tells them before each micro-batch: the
        schedule runs other micro-batches' forwards between i's forward and backward, and a
        backward under full recompute runs i's forward again, which must route as the first.
        What a layer saves for its backward (choices, drops, dispatch indices) is in its
        cache, set aside per micro-batch with every other layer's (StageRunner)."""
        mb, xp = engine.micro_batch, engine.xp
        stage = self.stage
        micro_batches = [(xp.asarray(inputs[i * mb:(i + 1) * mb]) if stage.is_first else None,
                          xp.asarray(targets[i * mb:(i + 1) * mb]) if stage.is_last else None)
                         for i in range(engine.accumulation)]
        first = engine.mesh.dp_rank * len(inputs)  # this rank's rows of the global batch
        moe_losses = []

        def before_op(op, i):
            for strategy in engine.strategies:  # the experts' too at ep > 1
                strategy.sync_gradients = (i == engine.accumulation - 1
                                           and engine.optimizer.reduces_gradients)
            engine.moe.before(engine.global_steps, first + i * mb, engine.scaler.scale,
                              inputs[i * mb:(i + 1) * mb])

        def after_op(op, i):  # the op's time, its wait for its input included
            if op == "F":  # micro-batch i's losses and routing counts, this stage's layers
                moe_losses.append(engine.moe.losses())
                engine.moe.tally()
            clock.lap("forward" if op == "F" else "backward")

        total = self.runner.train(micro_batches, normalizer, engine.scaler.scale, before_op,
                                  after_op)
        return sum(moe_losses, total)

    def evaluate(self, engine, inputs, targets, normalizer) -> float:
        """The forward of `inputs` through the stages; the last stage's loss (0.0 on other
        stages). Called inside the model's inference() (Engine.eval_loss), under which the
        stage's MoE layers route as in evaluation (eval_capacity_factor, no random draw)."""
        stage, xp = self.stage, engine.xp
        return self.runner.evaluate(xp.asarray(inputs) if stage.is_first else None,
                                    xp.asarray(targets) if stage.is_last else None,
                                    normalizer)

    def sum_tied_grads(self, grads) -> None:
        """Sum each tied unit's gradients (after the data-parallel reduction) over the stages
        holding it, so every copy takes the same update."""
        for comm, ranges in self.tied:
            allreduce_ranges(grads, ranges, comm)

    def held_sumsq(self, grads, grad_scale: float, dtype) -> float:
        """Sum of squares of the held copies' (scaled) gradients in this rank's `grads`."""
        return ranges_sumsq(grads, self.held_ranges, dtype) * grad_scale**2

    def gather(self, params: dict) -> dict:
        """{name: value} of every stage, from this stage's `params` (without its held
        copies: their owner's stage gives them). A collective over the pipeline group."""
        merged = {}
        for part in self.mesh.pp_comm.allgather_object(params):
            merged.update(part)
        return merged

    def comms(self) -> list:
        return [comm for comm, _ in self.tied]

    def free(self) -> None:
        for comm, _ in self.tied:
            comm.free()
        self.tied = []


def _merged_splits(parts: list[dict], size: int) -> dict:
    """One manifest entry of the stages' split entries `parts` (TensorSplits.to_dict's
    {size, splits}, or ExpertSplits.to_dict's {size, ep, tp} with each of ep and tp such a
    TensorSplits entry; each stage's names its own): the names of all, split over `size`
    ranks. No part (no stage holds a split parameter): {size, splits} without any."""
    if parts and "ep" in parts[0]:  # experts under tensor parallelism: each way merged
        return {"size": size, **{way: _merged_splits([p[way] for p in parts],
                                                     parts[0][way]["size"])
                                 for way in ("ep", "tp")}}
    merged = {}
    for part in parts:
        merged.update(part["splits"])
    return {"size": size, "splits": merged}

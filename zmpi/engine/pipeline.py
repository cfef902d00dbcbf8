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

    def _whole(self, engine):
        """(the layout of every stage's units in the model's order, held copies left out;
        every stage's tensor splits): what a checkpoint's manifest describes."""
        units = engine.layout.to_dict()["units"]
        mine = [(g, units[u]) for u, g in enumerate(self.stage.unit_ids)
                if u not in self.stage.held]
        every, splits = [], {}
        for part, part_splits in self.mesh.pp_comm.allgather_object(
                (mine, engine.tensor_splits.to_dict()["splits"])):
            every += part
            splits.update(part_splits)
        layout = ModelLayout.from_dict({"world_size": engine.layout.world_size,
                                        "units": [unit for _, unit in sorted(every)]})
        return layout, TensorSplits.from_dict({"size": engine.tensor_splits.size,
                                               "splits": splits})

    def train(self, engine, inputs, targets, normalizer, clock):
        """The stage's forwards and backwards of the step's micro-batches (rows of `inputs`
        and `targets`, host arrays); the last stage's loss sum (0.0 on other stages)."""
        mb, xp = engine.micro_batch, engine.xp
        stage = self.stage
        micro_batches = [(xp.asarray(inputs[i * mb:(i + 1) * mb]) if stage.is_first else None,
                          xp.asarray(targets[i * mb:(i + 1) * mb]) if stage.is_last else None)
                         for i in range(engine.accumulation)]

        def before_op(op, i):
            engine.strategy.sync_gradients = i == engine.accumulation - 1

        def after_op(op, i):  # the op's time, its wait for its input included
            clock.lap("forward" if op == "F" else "backward")

        return self.runner.train(micro_batches, normalizer, engine.scaler.scale, before_op,
                                 after_op)

    def evaluate(self, engine, inputs, targets, normalizer) -> float:
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

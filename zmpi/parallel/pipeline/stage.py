"""One pipeline stage of a UnitModel: the units a stage runs, as a UnitModel that the engine
trains like any other.

    stage = PipelineStage(model, stage=mesh.pp_rank, stages=mesh.pp, method="parameters")
    stage.units           # this stage's units (a held copy first, see below)
    stage.unit_ids        # each one's index in the whole model

Units keep their model-wide names (`units.{i}.<name>`, i the index in the whole model), so
checkpoints and gathered parameters are named as without pipelining. The whole model is built
on every rank (identically seeded) and cut: `model.units` becomes this stage's units, so the
other stages' units are freed once nothing else holds them.

Tied weights across stages (GPT-2's LM head reads the token embedding: the last stage reads a
unit of the first). A unit that reads (`shared_units`) a unit of another stage reads a *held
copy* of it instead: a clone of that unit with its own parameters, placed first in this stage,
whose forward and backward pass their input through unchanged. The ZeRO strategy gathers,
reduces and updates it like any unit; the engine sums the gradients of every copy of the
unit over the stages that hold one (`tied_groups`), once a step, so all copies take the same
update and stay equal (DeepSpeed's TiedLayerSpec).
"""
from __future__ import annotations

import copy

from zmpi.nn.base import Module
from zmpi.nn.module import UnitModel
from zmpi.nn.parameter import Parameter
from zmpi.parallel.pipeline.partition import partition, unit_weights


class HeldCopy:
    """Mixed into a held copy's class: the unit's parameters without its computation (a unit
    of this stage reads them). Forward and backward are the identity."""

    def forward(self, x):
        return x

    def backward(self, dy):
        return dy


def held_copy(unit: Module) -> Module:
    """A clone of `unit` that computes nothing: a class named Held<Unit> with the same
    attributes, its Parameters copied (values and marks such as `tp_split`), its submodules
    cloned, nothing saved for backward."""
    cls = type(f"Held{type(unit).__name__}", (HeldCopy, type(unit)), {})
    return _clone(unit, cls)


def _clone(module: Module, cls=None) -> Module:
    new = object.__new__(cls or type(module))
    new.__dict__.update(module.__dict__)
    new.__dict__.pop("_cache", None)
    for name, value in vars(module).items():
        if name == "shared_units" or name.startswith("_"):
            continue
        if isinstance(value, Parameter):
            param = copy.copy(value)  # the marks (tp_split, sequence_parallel, ...) with it
            param.data, param.grad = value.data.copy(), value.grad.copy()
            setattr(new, name, param)
        elif isinstance(value, Module):
            setattr(new, name, _clone(value))
        elif isinstance(value, (list, tuple)) and value and all(
                isinstance(v, Module) for v in value):
            setattr(new, name, type(value)(_clone(v) for v in value))
    return new


class PipelineStage(UnitModel):
    """Stage `stage` of `stages` of `model` (a UnitModel), its units chosen by `method`
    (zmpi.parallel.pipeline.partition). Takes over `model`'s units (see the module
    docstring) and its loss; `check_batch` and `tied_parameters` answer for the whole model.

    bounds: the partition's split points (stage s runs units bounds[s]:bounds[s + 1]);
    unit_ids: each unit's index in the whole model; held: the local indices of held copies;
    tied_groups: [(unit index in the whole model, the stages holding it or a copy)], the
    same on every rank, one entry per unit read across stages;
    is_first / is_last: whether the stage takes the inputs / computes the loss."""

    def __init__(self, model: UnitModel, stage: int, stages: int, method: str = "parameters"):
        units = list(model.units)
        self.bounds = partition(unit_weights(units, method), stages)
        self.stage, self.stages = stage, stages
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.computes_loss = self.is_last  # full recompute keeps no unit of an earlier stage
        index = {id(u): i for i, u in enumerate(units)}
        stage_of = [s for s in range(stages) for _ in range(self.bounds[s], self.bounds[s + 1])]
        readers = {}  # unit read across stages -> the stages holding it or a copy
        for i, unit in enumerate(units):
            for shared in getattr(unit, "shared_units", ()):
                owner = index[id(shared)]
                if stage_of[owner] != stage_of[i]:
                    readers.setdefault(owner, {stage_of[owner]}).add(stage_of[i])
        self.tied_groups = [(g, tuple(sorted(held))) for g, held in sorted(readers.items())]
        self._tied_names = model.tied_parameters()
        self._whole = model

        run = list(range(self.bounds[stage], self.bounds[stage + 1]))
        copies = {}  # whole-model index -> this stage's held copy
        for i in run:
            for shared in getattr(units[i], "shared_units", ()):
                g = index[id(shared)]
                if stage_of[g] != stage and g not in copies:
                    copies[g] = held_copy(shared)
        for i in run:
            units[i].shared_units = tuple(copies.get(index[id(s)], s)
                                          for s in getattr(units[i], "shared_units", ()))
        self.unit_ids = [*sorted(copies), *run]
        self.held = list(range(len(copies)))
        model.units = [units[i] for i in run]  # the other stages' units are not kept here
        super().__init__([copies[g] for g in sorted(copies)] + model.units, loss=model.loss_fn)

    def _named_parameters(self, prefix):
        for g, unit in zip(self.unit_ids, self.units, strict=True):
            yield from unit._named_parameters(f"{prefix}units.{g}.")

    def check_batch(self, inputs, targets) -> bool:
        return self._whole.check_batch(inputs, targets)

    def tied_parameters(self) -> dict[str, str]:
        return self._tied_names

    def __repr__(self) -> str:
        names = ", ".join(f"{g}:{type(u).__name__}"
                          for g, u in zip(self.unit_ids, self.units, strict=True))
        return f"PipelineStage({self.stage} of {self.stages}: {names})"

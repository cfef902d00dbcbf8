"""The collectives one rank makes under a Layout, counted as the engine makes them: the calls
the time model charges (zmpi.plan.time) and the Engine's counters count
(`Engine.traffic_by_dimension`; experiments/validate_plan.py compares the two per step).

Tensor parallelism (zmpi.parallel.tensor), per micro-batch on a pipeline stage of `blocks`
transformer blocks (`first`: it holds the embedding, `last`: the LM head):
- a block's forward allreduces its b s h activations twice and its backward twice (full
  recompute runs its forward again: 2 more); the embedding's forward once (full recompute:
  again), the head's backward once. An allreduce is two ring passes; under sequence
  parallelism they are two calls, a reduce-scatter and an allgather (the embedding's forward a
  reduce-scatter alone, its backward an allgather);
- the vocabulary-parallel cross-entropy: LOSS_ALLREDUCES allreduces of b s values (last stage);
- per step, under sequence parallelism, one allreduce of the sequence-parallel parameters'
  gradients (the LayerNorms' and row-parallel biases: SP_PARAMS_PER_BLOCK h per block, 2 h for
  the final LayerNorm).
Data parallelism (zmpi.zero), per step, a stage of `n_units` units: stage 0 allreduces each
unit's gradients once; stage 1 reduce-scatters them once and allgathers the updated
parameters; stage 2 reduce-scatters every micro-step; stage 3 reduce-scatters every micro-step
and allgathers each unit before its forward and its backward, and the embedding twice more
for the LM head that reads it (on the stage holding the head).
Pipeline (zmpi.parallel.pipeline), per micro-batch: a stage sends its output (not the last)
and its input's gradient (not the first); per step a header to the next stage (not the
last), and the first and last stages allreduce the tied embedding's gradient.
Not counted: the engine's scalar allreduces (the loss, the gradient norm, the overflow check:
one to three a step, 8 bytes each).
"""
from __future__ import annotations

from zmpi.plan.layout import Job, Layout
from zmpi.plan.memory import stage_blocks, stage_units

COUNTED_OPS = ("allreduce", "reduce_scatter", "allgather", "send")  # the counters' op names
LOSS_ALLREDUCES = 3  # the cross-entropy's max, sum of exponentials and target logit
SP_PARAMS_PER_BLOCK = 6  # h each: two LayerNorms' weight and bias, two row-parallel biases


def tensor_calls(layout: Layout, blocks: int, first: bool, last: bool,
                 per_block: int = 4) -> tuple[int, int]:
    """(ring passes of the b s h activations, calls) per micro-batch, the loss's allreduces
    not included (see the module docstring); per_block: a block's collectives (the GPT's 4,
    `Job.tensor_reductions_per_block`), 2 of them forward."""
    full = layout.recompute == "full"
    allreduces = blocks * (per_block + 2 * full) + first * (1 + full) + last
    if not layout.sequence_parallel:
        return 2 * allreduces, allreduces
    passes = 2 * allreduces - first * full  # the embedding's recomputed forward: one pass
    return passes, passes


def data_rounds(layout: Layout) -> dict[str, int]:
    """Per step: {"allreduce", "reduce_scatter", "allgather": passes over every unit of the
    stage} of ZeRO's stage (see the module docstring); at stage 3 each allgather pass also
    gathers the embedding again on the stage holding the LM head (`data_calls`)."""
    m, stage = layout.micro_batches, layout.stage
    return {"allreduce": int(stage == 0), "reduce_scatter": {0: 0, 1: 1}.get(stage, m),
            "allgather": {0: 0, 1: 1, 2: 1}.get(stage, 2 * m)}


def data_calls(layout: Layout, n_units: int, holds_head: bool) -> int:
    """Per step, the data-parallel collectives of a stage of `n_units` units."""
    rounds = data_rounds(layout)
    tied = rounds["allgather"] * holds_head if layout.stage == 3 else 0
    return sum(rounds.values()) * n_units + tied


def pipeline_calls(layout: Layout, first: bool, last: bool,
                   tied: bool = True) -> tuple[int, int, int]:
    """(sends per micro-batch, header sends per step, tied allreduces per step: none for an
    untied model) of a stage."""
    if layout.pp == 1:
        return 0, 0, 0
    return 2 - first - last, int(not last), int((first or last) and tied)


def stage_calls(job: Job, layout: Layout, stage: int) -> dict[str, int]:
    """Per step, one rank of pipeline stage `stage`: {"tp", "dp", "pp": calls} of the
    collectives and sends on each dimension of more than one rank (the Engine's counters of
    COUNTED_OPS: `counted_calls`)."""
    units = stage_units(job, layout.pp, layout.tp)[stage]
    first, last = stage == 0, stage == layout.pp - 1
    blocks = stage_blocks(len(units), first, last, layout.pp, job.tied)
    m, out = layout.micro_batches, {}
    if layout.tp > 1:
        out["tp"] = m * (tensor_calls(layout, blocks, first, last,
                                      job.tensor_reductions_per_block)[1]
                         + LOSS_ALLREDUCES * last) + layout.sequence_parallel
    if layout.dp > 1:
        out["dp"] = data_calls(layout, len(units), last and job.tied)
    if layout.pp > 1:
        sends, headers, tied = pipeline_calls(layout, first, last, job.tied)
        out["pp"] = m * sends + headers + tied
    return out


def counted_calls(by_dimension: dict) -> dict[str, int]:
    """{"tp", "dp", "pp": calls} of COUNTED_OPS in counters {dim: {op: calls}} (those of
    `Engine.traffic_by_dimension`), the dimensions with any: what `stage_calls` predicts."""
    out = {dim: sum(ops.get(op, 0) for op in COUNTED_OPS) for dim, ops in by_dimension.items()}
    return {dim: n for dim, n in out.items() if n}

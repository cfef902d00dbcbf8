"""The memory one rank needs for a Layout of a Job: the formulas the ledger is checked against.

Per pipeline stage (the units `zmpi.parallel.pipeline.partition` gives it, and on the last
stage of a pipeline the held copy of the tied embedding), on the device and on the host:

- model states, exactly as the strategy holds them (`zmpi.memory.held_model_state` over the
  stage's units, each padded to a multiple of dp, as zmpi.zero.flat lays them out);
- the transients of the ZeRO stage: stage 3's gathered units (a unit, the units it reads and
  the next one, prefetched), stages 2-3's full gradients of the units in flight, stage 1's
  reduced gradient shard (a comm_buffer);
- activations: one micro-batch's (`zmpi.models.gpt.gpt_activation_bytes`, over the stage's
  units) times the micro-batches in flight (GPipe m, 1F1B min(p - s, m)); with full
  recompute the kept inputs times that, plus one unit's working set.

The rank's need is the stage needing the most device memory; peaks of the parts are added
(they need not coincide, so the sum is an upper bound of the ledger's peak).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from zmpi.memory import held_model_state
from zmpi.models.gpt import gpt_activation_bytes, gpt_unit_numels
from zmpi.nn.attention import attention_block
from zmpi.parallel.pipeline.partition import partition
from zmpi.plan.layout import BUCKET_NUMEL, Job, Layout

SOLO_NUMEL = 16 * 1024  # units this large are reduced and gathered alone, in place


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline stage `stage` holds at its peak: `model_state` {"device",
    "host"} (between steps), `transient` (ZeRO's gathered parameters, gradients in flight and
    buffers, device), `activation` {"device", "host"}; `device` and `host` the totals."""

    stage: int
    model_state: dict
    transient: int
    activation: dict

    @property
    def device(self) -> int:
        return self.model_state["device"] + self.transient + self.activation["device"]

    @property
    def host(self) -> int:
        return self.model_state["host"] + self.activation["host"]

    def to_dict(self) -> dict:
        return {"stage": self.stage, "model_state": self.model_state,
                "transient": self.transient, "activation": self.activation,
                "device": self.device, "host": self.host}


@functools.lru_cache(maxsize=256)
def stage_units(job: Job, pp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """Per pipeline stage, the parameter count of each unit it holds (one rank's share under
    tensor parallelism): the partition's run of [embedding, blocks, head], the last stage of a
    pipeline led by its held copy of the embedding (the head's tied weights)."""
    numels = gpt_unit_numels(job.n_layer, job.d_model, job.vocab_size, job.seq_len, tp)
    bounds = partition(numels, pp)
    stages = [tuple(numels[bounds[s]:bounds[s + 1]]) for s in range(pp)]
    if pp > 1:
        stages[-1] = (numels[0], *stages[-1])
    return tuple(stages)


def stage_blocks(n_units: int, first: bool, last: bool, pp: int) -> int:
    """Transformer blocks among a stage's `n_units` units: not the embedding (first stage),
    the head (last stage) or, in a pipeline, the last stage's held copy of the embedding."""
    return n_units - first - last - (1 if pp > 1 and last else 0)


def _padded(numel: int, dp: int) -> int:
    return -(-numel // dp) * dp


def stage_memory(job: Job, layout: Layout, stage: int, on_gpu: bool) -> StageMemory:
    """What one rank of pipeline stage `stage` needs under `layout` (see the module
    docstring); on_gpu: fp16 activations stay 2-byte, attention runs in one block."""
    model_state, transient = _states(job, layout.pp, layout.tp, layout.dp, layout.stage,
                                     layout.offload)[stage]
    return StageMemory(stage, model_state, transient, _activation(job, layout, stage, on_gpu))


@functools.lru_cache(maxsize=4096)
def _states(job: Job, pp: int, tp: int, dp: int, zero_stage: int, offload: str) -> tuple:
    """Per pipeline stage: ({"device", "host"} model-state bytes, transient device bytes)."""
    out = []
    for stage, units in enumerate(stage_units(job, pp, tp)):
        padded = [_padded(n, dp) for n in units]
        full = sum(padded)
        held = held_model_state(full, full // dp, job.param_bytes, 4, zero_stage >= 1,
                                zero_stage >= 2, zero_stage >= 3, offload != "none",
                                offload == "optimizer+param")
        out.append(({d: sum(held[d].values()) for d in held},
                    _transient(job.param_bytes, zero_stage, dp, padded, stage == pp - 1)))
    return tuple(out)


def _transient(pb: int, zero_stage: int, dp: int, padded: list[int], holds_head: bool) -> int:
    """ZeRO's buffers on the device at their peak (bytes), for a stage of units `padded`
    (elements, each padded for dp ranks) of `pb`-byte parameters."""
    head = len(padded) - 1 if holds_head else None
    # the units each unit reads: itself, and the head the embedding (or its held copy), the
    # stage's first unit
    needs = [{u, 0} if u == head else {u} for u in range(len(padded))]
    small = sum(p for p in padded if p < SOLO_NUMEL) * pb  # packed into one bucket
    if zero_stage == 0:
        return small
    if zero_stage == 1:
        return sum(padded) // dp * pb + small
    largest = max(sum(padded[w] for w in needs[u]) for u in range(len(padded)))
    in_flight = min(sum(padded), largest + 2 * BUCKET_NUMEL)  # overlap_comm's limit
    grads = in_flight * pb
    if zero_stage == 2:
        return grads
    gathered = max(sum(padded[w] for w in needs[u] | needs[v])
                   for u in range(len(padded)) for v in (u - 1, u + 1)
                   if 0 <= v < len(padded)) if len(padded) > 1 else padded[0]
    return grads + gathered * pb


def _activation(job: Job, layout: Layout, stage: int, on_gpu: bool) -> dict:
    """{"device", "host"}: the activations stage `stage` keeps at its peak (bytes)."""
    a = _micro_batch_activation(job, layout.tp, layout.sequence_parallel, layout.recompute,
                                layout.micro_batch, on_gpu)
    first, last = stage == 0, stage == layout.pp - 1
    blocks = stage_blocks(len(stage_units(job, layout.pp, layout.tp)[stage]), first, last,
                          layout.pp)
    in_flight = layout.micro_batches if layout.schedule == "gpipe" else \
        min(layout.pp - stage, layout.micro_batches)
    end = a["head"] + a["loss"] if last else 0
    if layout.recompute != "full":
        per = (a["embedding"] if first else 0) + blocks * a["layer"] + end
        return {"device": per * in_flight, "host": 0}
    ids = a["kept"] - job.n_layer * a["kept_per_layer"]
    kept = (ids if first else 0) + blocks * a["kept_per_layer"]
    work = max(a["layer"] if blocks else 0, end, a["embedding"] if first else 0)
    return {"device": kept * in_flight + work, "host": 0}


@functools.lru_cache(maxsize=4096)
def _micro_batch_activation(job: Job, tp: int, sequence_parallel: bool, recompute: str,
                            micro_batch: int, on_gpu: bool) -> dict:
    block = attention_block(job.seq_len, micro_batch * job.n_head // tp, on_gpu)
    return gpt_activation_bytes(job.n_layer, job.d_model, job.n_head, job.vocab_size,
                                job.seq_len, micro_batch, job.act_bytes(on_gpu), tp,
                                sequence_parallel, recompute, block=block)


def layout_memory(job: Job, layout: Layout, on_gpu: bool) -> list[StageMemory]:
    """Every pipeline stage's StageMemory (one rank of each; the dp and tp ranks of a stage
    hold the same bytes)."""
    return [stage_memory(job, layout, s, on_gpu) for s in range(layout.pp)]

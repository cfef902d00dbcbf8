"""The memory one rank needs for a Layout of a Job: the formulas the ledger is checked against.

Per pipeline stage (the units `zmpi.parallel.pipeline.partition` gives it, and on the last
stage of a pipeline the held copy of the tied embedding), in bytes. Notation: m micro-batches
a step, w of them in flight on this stage (GPipe m, 1F1B min(p - s, m)); G the stage's unit
gradients in full (its padded parameters x the parameter bytes), S = G / dp their shard;
d = 1 without optimizer offload (the step's first reduction of a unit writes the shard in
place), 0 with it (every reduced shard lands in a device buffer and is copied to the host).

- Model states, exactly as the strategy holds them (`zmpi.memory.held_model_state` over the
  stage's units, each padded to a multiple of dp, as zmpi.zero.flat lays them out).
- Activations: one micro-batch's (`zmpi.models.gpt_counts.gpt_activation_bytes` over the stage's
  units) times w; with full recompute the kept inputs times w, the LM head's caches of the
  w - 1 micro-batches whose backward waits (the last stage), and one unit's working set.
- The device peak is the larger of two moments, because the ZeRO buffers peak when the
  activations are mostly gone:
    stage 0   model states + activations (gradients are model state, reduced in place);
    stage 1   the reduced gradient shard (a step-time buffer) lives through the last
              micro-batch's backward: max(activations, S + one micro-batch - the head's);
              with optimizer offload it is on the host, and each reduced unit's part waits
              on the device until the step: the activations left before a block's backward
              in the last micro-batch plus the parts of the units after it, at the first
              or the last block (both terms are linear in the block);
    stage 2-3 with `overlap_comm` a unit's full gradient and its reduced part stay in flight
              until the step waits for them (at most the in-flight limit of two buckets):
              at the activation peak, after the k = m - w micro-batches whose backward ended,
              k G + (k - d) S, with the unit whose backward starts (its gradient; stage 3
              also its gathered parameters with the next one's, prefetched); at the end of
              backward m G + (m - d) S, with the last unit's gathered parameters (the
              recomputed unit's working set under full recompute).
  Units under 16 Ki elements travel packed with their neighbours in a bucket buffer; that
  buffer is not counted (such units make up toy models only).
- Host: model states, and with optimizer offload at stages 2-3 the landing buffer of the
  largest unit shard copied device -> host to be added into the shard (micro-steps after
  the first).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, fields

import numpy as np

from zmpi.memory import held_model_state
from zmpi.models.gpt_counts import gpt_activation_bytes, gpt_expert_numel, gpt_unit_numels
from zmpi.models.llama import llama_activation_bytes, llama_unit_numels
from zmpi.nn.attention import attention_block
from zmpi.parallel.pipeline.partition import partition
from zmpi.plan.layout import BUCKET_NUMEL, Job, Layout


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline stage `stage` holds: `model_state` {"device", "host"}
    (between steps), `activation` {"device", "host"} at their peak, `device` and `host` the
    peaks of the whole (the module docstring); `transient` the rest of the device peak (ZeRO's
    gradients in flight, gathered parameters and buffers, beyond the activations)."""

    stage: int
    model_state: dict
    activation: dict
    device: int
    host: int

    @property
    def transient(self) -> int:
        return self.device - self.model_state["device"] - self.activation["device"]

    def to_dict(self) -> dict:
        return {"stage": self.stage, "model_state": self.model_state,
                "transient": self.transient, "activation": self.activation,
                "device": self.device, "host": self.host}


@dataclass(frozen=True)
class _StageStates:
    """What a stage's units and ZeRO stage fix: model-state bytes {"device", "host"}; `grads`
    (G) and `shard` (S), its unit gradients in full and their shard; `unit` the largest unit's
    gradient (bytes); `gathered` stage 3's largest pair of neighbouring units gathered at
    once (with the units they read), else 0; `landing` the host landing buffer of offload
    (bytes); `after` the shards of the units after the stage's first and last block (bytes,
    the first if none); `limit` the bytes the collectives in flight hold at most (the
    strategy's in_flight_limit of two buckets, and one more: a unit's gradient and part).
    Built per stage, then held as _columns over the stages."""

    model_state: dict
    grads: int
    shard: int
    unit: int
    gathered: int
    landing: int
    after: tuple  # the shards of the units after the stage's (first, last) block, bytes
    limit: int  # the collectives in flight at most: two buckets and one more


@dataclass(frozen=True)
class _Activations:
    """A stage's activation bytes: `peak` (w micro-batches in flight), `one` (one
    micro-batch's), `end` (the LM head's and the loss's, the last stage), `layer` (one
    block's working set), `in_flight` (w) and `left`: what the step's last micro-batch still
    holds as its first and its last block's backward starts. Built per stage, then held as
    _columns over the stages."""

    peak: int
    one: int
    end: int
    layer: int
    in_flight: int
    left: tuple  # before the (first, last) block's backward in the step's last micro-batch


@functools.lru_cache(maxsize=256)
def stage_units(job: Job, pp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """Per pipeline stage, the parameter count of each unit it holds (one rank's share under
    tensor parallelism): the partition's run of [embedding, blocks, head], the last stage of a
    pipeline led by its held copy of the embedding (the head's tied weights; an untied
    Llama's head has its own)."""
    numels = gpt_unit_numels(job.n_layer, job.d_model, job.vocab_size, job.seq_len, tp,
                             job.vocab_multiple, job.moe_section) if job.llama is None else \
        llama_unit_numels(job.llama, tp, job.vocab_multiple)
    bounds = partition(numels, pp)
    stages = [tuple(numels[bounds[s]:bounds[s + 1]]) for s in range(pp)]
    if pp > 1 and job.tied:
        stages[-1] = (numels[0], *stages[-1])
    return tuple(stages)


def stage_blocks(n_units: int, first: bool, last: bool, pp: int, tied: bool = True) -> int:
    """Transformer blocks among a stage's `n_units` units: not the embedding (first stage),
    the head (last stage) or, in a pipeline of a `tied` model, the last stage's held copy of
    the embedding."""
    return n_units - first - last - (1 if pp > 1 and last and tied else 0)


def padded(numel: int, dp: int) -> int:
    """A unit of `numel` elements padded to a multiple of dp (zmpi.zero.flat)."""
    return -(-numel // dp) * dp


def stage_memory(job: Job, layout: Layout, stage: int, on_gpu: bool) -> StageMemory:
    """What one rank of pipeline stage `stage` needs under `layout` (see the module
    docstring); on_gpu: fp16 and bf16 activations stay 2-byte, attention runs in one block."""
    return layout_memory(job, layout, on_gpu)[stage]


def layout_memory(job: Job, layout: Layout, on_gpu: bool) -> list[StageMemory]:
    """Every pipeline stage's StageMemory (one rank of each; the dp and tp ranks of a stage
    hold the same bytes)."""
    st, act, device, host = _stage_peaks(job, layout, on_gpu)
    return [StageMemory(s, {where: int(n[s]) for where, n in st.model_state.items()},
                        {"device": int(act.peak[s]), "host": 0}, int(device[s]), int(host[s]))
            for s in range(layout.pp)]


def layout_peaks(job: Job, layout: Layout, on_gpu: bool) -> tuple[np.ndarray, np.ndarray]:
    """(device, host) peak bytes, each a float64 array over the pipeline stages (exact below
    2^53 bytes, 9 PB): layout_memory's, faster (what the search tries on every layout)."""
    _, _, device, host = _stage_peaks(job, layout, on_gpu)
    return device, host


def _stage_peaks(job: Job, layout: Layout, on_gpu: bool):
    """(_StageStates, _Activations, device peaks, host peaks), over the stages at once."""
    st = _states(job, layout.pp, layout.tp, layout.dp, layout.stage, layout.offload, layout.ep)
    act = _activations(job, layout.tp, layout.sequence_parallel, layout.recompute,
                       layout.micro_batch, layout.micro_batches, layout.schedule, layout.pp,
                       on_gpu, layout.ep)
    beyond = _peak_beyond_model_states(layout.stage, layout.offload != "none",
                                       layout.micro_batches, layout.recompute == "full", st, act)
    return st, act, st.model_state["device"] + beyond, st.model_state["host"] + st.landing


def _peak_beyond_model_states(zero_stage: int, offloaded: bool, m: int, full_recompute: bool,
                              st: _StageStates, act: _Activations) -> np.ndarray:
    """The device peak above the model states, per stage: the larger of the two moments."""
    if zero_stage == 0:
        return act.peak
    if zero_stage == 1:
        if not offloaded:
            return np.maximum(act.peak, st.shard + act.one - act.end)
        return np.maximum(act.peak, np.maximum(act.left[0] + st.after[0],
                                               act.left[1] + st.after[1]))
    d = 0 if offloaded else 1
    k = m - act.in_flight
    # the unit gradients and reduced parts of the micro-steps done, under the in-flight limit
    at_activation_peak = act.peak + np.minimum(k * st.grads + np.maximum(k - d, 0) * st.shard,
                                               st.limit) + st.unit + st.gathered
    at_end = np.minimum(m * st.grads + (m - d) * st.shard, st.limit) + \
        (act.layer if full_recompute else st.gathered)
    return np.maximum(at_activation_peak, at_end)


def _columns(records: list):
    """Per-stage records (one dataclass) as one record of the same class whose every field
    holds the stages' values as a read-only float64 array: a dict field as a dict of arrays, a
    tuple field as an array of shape (len, stages). The peaks are then one array expression
    over the stages. float64, not int64: byte counts and their products are exact below 2^53
    (9 PB), and beyond int64 they stay ordered (never fit) where int64 would wrap."""
    def column(values):
        if isinstance(values[0], dict):
            return {key: column([v[key] for v in values]) for key in values[0]}
        array = np.array(values, dtype=np.float64)
        array = array.T if array.ndim == 2 else array
        array.flags.writeable = False  # shared by every layout the cache serves
        return array
    cls = type(records[0])
    return cls(**{f.name: column([getattr(r, f.name) for r in records]) for f in fields(cls)})


@functools.lru_cache(maxsize=4096)
def _states(job: Job, pp: int, tp: int, dp: int, zero_stage: int, offload: str,
            ep: int = 1) -> _StageStates:
    """The _StageStates of the pipeline stages, as _columns. At expert-parallel degree ep > 1
    (MoE blocks, one stage, no offload: `layouts`) the engine runs two instances of the
    ZeRO stage: the dense parameters over the dp ranks, each rank's 1 / ep of the experts
    over the dp / ep ranks holding the same (docs/moe.md); their states add up, and so do
    their gradients, buffers and gathers in flight (a bound: the two need not peak at once)."""
    out = []
    for stage, units in enumerate(stage_units(job, pp, tp)):
        first, last = stage == 0, stage == pp - 1
        if ep == 1:
            out.append(_instance(job, units, dp, zero_stage, offload, first, last, pp))
            continue
        experts = moe_unit_experts(job, ep)
        dense = [n - e * ep for n, e in zip(units, experts, strict=True)]
        parts = (_instance(job, dense, dp, zero_stage, offload, first, last, pp),
                 _instance(job, [e for e in experts if e], dp // ep, zero_stage, offload,
                           False, False, 1))
        out.append(_StageStates(*(
            {d: x[d] + y[d] for d in x} if isinstance(x, dict) else
            tuple(i + j for i, j in zip(x, y, strict=True)) if isinstance(x, tuple) else x + y
            for x, y in ([getattr(p, f.name) for p in parts] for f in fields(_StageStates)))))
    return _columns(out)


def moe_unit_experts(job: Job, ep: int) -> list[int]:
    """Per unit of `job` (one stage: [embedding, blocks, head]) the expert parameters one
    rank holds at expert-parallel degree ep: E / ep experts of 8 d^2 + 5 d in each MoE block
    (models/gpt_counts.py's gpt_expert_numel), 0 elsewhere."""
    section = job.moe_section
    layers = section.layer_experts(job.n_layer)
    one = gpt_expert_numel(job.n_layer, job.d_model, section) // sum(layers.values())
    return [0, *(layers.get(i, 0) * one // ep for i in range(job.n_layer)), 0]


def _instance(job: Job, units, dp: int, zero_stage: int, offload: str, first: bool,
              last: bool, pp: int) -> _StageStates:
    """The _StageStates of one stage's `units` (parameter counts) under one instance of the
    ZeRO stage over dp ranks."""
    pb = job.param_bytes
    sizes = [padded(n, dp) for n in units]
    full = sum(sizes)
    held = held_model_state(full, full // dp, pb, 4, zero_stage >= 1, zero_stage >= 2,
                            zero_stage >= 3, offload != "none", offload == "optimizer+param")
    landing = max(sizes) // dp * pb if zero_stage >= 2 and offload != "none" else 0
    gathered = _gathered_pair(sizes, last and job.tied) * pb if zero_stage == 3 else 0
    blocks = stage_blocks(len(sizes), first, last, pp, job.tied)
    end = len(sizes) - last  # one past the last block
    after = tuple(sum(sizes[u + 1:]) // dp * pb for u in (end - blocks, end - 1))
    unit = max(sizes) * pb
    return _StageStates({d: sum(held[d].values()) for d in held}, full * pb, full // dp * pb,
                        unit, gathered, landing, after,
                        2 * BUCKET_NUMEL * pb + unit + unit // dp)


def _gathered_pair(sizes: list[int], holds_head: bool) -> int:
    """Stage 3's most parameter elements gathered at once: a unit, the units it reads (the
    head the embedding or its held copy, the stage's first unit) and its neighbour's
    (prefetched)."""
    if len(sizes) == 1:
        return sizes[0]
    head = len(sizes) - 1 if holds_head else None
    needs = [{u, 0} if u == head else {u} for u in range(len(sizes))]
    return max(sum(sizes[w] for w in needs[u] | needs[v])
               for u in range(len(sizes)) for v in (u - 1, u + 1) if 0 <= v < len(sizes))


@functools.lru_cache(maxsize=1 << 16)  # shared by the layouts that differ in dp and ZeRO only
def _activations(job: Job, tp: int, sequence_parallel: bool, recompute: str, micro_batch: int,
                 micro_batches: int, schedule: str, pp: int, on_gpu: bool,
                 ep: int = 1) -> _Activations:
    """The _Activations of the pipeline stages, as _columns."""
    return _columns([_activation(job, tp, sequence_parallel, recompute, micro_batch,
                                 micro_batches, schedule, pp, stage, on_gpu, ep)
                     for stage in range(pp)])


def _activation(job: Job, tp: int, sequence_parallel: bool, recompute: str, micro_batch: int,
                micro_batches: int, schedule: str, pp: int, stage: int, on_gpu: bool,
                ep: int = 1) -> _Activations:
    """The activations stage `stage` keeps (the module docstring); a block's are the
    largest block's (MoE blocks keep more than dense ones: a bound where they differ)."""
    a = dict(micro_batch_activation(job, tp, sequence_parallel, recompute, micro_batch, on_gpu,
                                    ep))
    a["layer"] = max(a["blocks"])
    first, last = stage == 0, stage == pp - 1
    blocks = stage_blocks(len(stage_units(job, pp, tp)[stage]), first, last, pp, job.tied)
    w = micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)
    end = a["head"] + a["loss"] if last else 0
    first_blocks = [0, max(blocks - 1, 0)]  # blocks below the stage's first and last one
    if recompute != "full":
        below = a["embedding"] if first else 0
        layers = sum(a["blocks"]) if blocks == job.n_layer else blocks * a["layer"]
        one = below + layers + end
        left = tuple(below + (j + 1) * a["layer"] for j in first_blocks)
        return _Activations(one * w, one, end, a["layer"], w, left)
    below = a["kept"] - job.n_layer * a["kept_per_layer"] if first else 0  # the token ids
    kept = below + blocks * a["kept_per_layer"]
    work = max(a["layer"] if blocks else 0, end, a["embedding"] if first else 0)
    left = tuple(below + j * a["kept_per_layer"] + a["layer"] for j in first_blocks)
    # the head's caches wait for the backward of each micro-batch but the one running
    return _Activations(kept * w + end * (w - 1) + work, kept + work, end, a["layer"], w, left)


@functools.lru_cache(maxsize=4096)
def micro_batch_activation(job: Job, tp: int, sequence_parallel: bool, recompute: str,
                           micro_batch: int, on_gpu: bool, ep: int = 1) -> dict:
    """`gpt_activation_bytes` (a Llama's `llama_activation_bytes`) of one micro-batch of
    `job` (attention in zmpi's blocks), its MoE blocks at expert-parallel degree ep (every
    capacity slot filled: models/moe_counts.py)."""
    block = attention_block(job.seq_len, micro_batch * job.n_head // tp, on_gpu)
    if job.llama is not None:
        return llama_activation_bytes(job.llama, micro_batch, job.act_bytes(on_gpu), tp,
                                      sequence_parallel=sequence_parallel,
                                      recompute=recompute, block=block, sparsity=job.sparsity,
                                      vocab_multiple=job.vocab_multiple)
    return gpt_activation_bytes(job.n_layer, job.d_model, job.n_head, job.vocab_size,
                                job.seq_len, micro_batch, job.act_bytes(on_gpu), tp,
                                sequence_parallel, recompute, block=block,
                                sparsity=job.sparsity, vocab_multiple=job.vocab_multiple,
                                moe=None if job.moe is None else dataclasses.replace(
                                    job.moe_section, ep_size=ep))

"""The rates of zmpi's own Engine on this machine, for `measure_this`: small GPTs trained on
this rank alone, their steps timed and fitted.

- `measure_layer(gemm_rate)`: a transformer block's time besides its matmuls, as a fixed
  `layer_overhead` per block and micro-batch plus its activation bytes at `elementwise_rate`
  (LAYER_SHAPES, fp32, ZeRO-0);
- `measure_engine()`: what ZeRO-2 and ZeRO-3 add per unit and micro-batch, and what fp16
  storage costs per parameter (ENGINE_SHAPE, ENGINE_MICRO_BATCHES micro-batches a step);
- `measure_crowd_efficiency(comm, cores)`: the share of its speed a rank's step keeps when
  more ranks than cores train at once (the same GPT, every rank its own).

The layer's and the engine's figures are the least of their steps after a warm-up (the
machine at its quietest, as zmpi.plan.measure.fastest_seconds); the crowd's is a ratio of
medians, alone and at once.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from zmpi.plan.layout import Job
from zmpi.plan.link_rates import in_turns

LAYER_SHAPES = ({"micro_batch": 2, "seq_len": 32, "d_model": 96, "n_head": 4},
                {"micro_batch": 4, "seq_len": 64, "d_model": 160, "n_head": 4},
                {"micro_batch": 4, "seq_len": 128, "d_model": 256, "n_head": 4})  # measure_layer
ENGINE_SHAPE = LAYER_SHAPES[1]  # measure_engine's GPT
ENGINE_MICRO_BATCHES = 4
ENGINE_BLOCKS, ENGINE_VOCAB = 2, 256  # measure_engine's GPT


def measure_layer(gemm_rate: float, steps: int = 9) -> dict:
    """A transformer block's forward and backward as the Engine runs them, on this rank alone,
    at each of LAYER_SHAPES (the module docstring), and the least-squares line through them:
    the seconds besides the matmuls (at `gemm_rate`) = `layer_overhead` + activation bytes /
    `elementwise_rate` (through the origin where the line would start below it). The shapes'
    engines take turns, a step each, so that the machine's drift touches every point of the
    line alike (measured one after another, a slower minute under one shape tilted the line).
    Each shape's seconds per block and micro-batch, matmul FLOPs and activation bytes are kept
    under "shapes"."""
    seconds = _blocks_seconds_interleaved(LAYER_SHAPES, steps)
    shapes = [_block_figures(shape, s, gemm_rate) for shape, s in zip(LAYER_SHAPES, seconds,
                                                                       strict=True)]
    x = np.array([s["layer_bytes"] for s in shapes], float)
    y = np.array([s["rest_seconds"] for s in shapes])
    slope = float(np.cov(x, y, bias=True)[0, 1] / np.var(x))
    overhead = float(y.mean() - slope * x.mean())
    if slope <= 0 or overhead < 0:  # noise: no fixed part
        slope, overhead = float(x @ y / (x @ x)), 0.0
    return {"shapes": shapes, "elementwise_rate": 1 / slope, "layer_overhead": overhead}


LAYER_VOCAB, LAYER_BLOCKS = 256, 2  # measure_layer's GPTs: fp32, ZeRO-0


def _blocks_seconds_interleaved(shapes, steps: int) -> list[float]:
    """Per shape, the least over `steps` steps (after a warm-up step) of its GPT's blocks'
    seconds per block and micro-batch (the Engine's profile), the shapes' engines stepping in
    turn."""
    from mpi4py import MPI

    from zmpi.comm import Comm
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    rng = np.random.default_rng(0)
    engines, batches = [], []
    try:
        for shape in shapes:
            b, s = shape["micro_batch"], shape["seq_len"]
            engines.append(Engine(GPT(GPTConfig(LAYER_VOCAB, s, LAYER_BLOCKS, shape["n_head"],
                                                shape["d_model"]), seed=0),
                                  {"train_micro_batch_size_per_gpu": b}, Comm(MPI.COMM_SELF)))
            tokens = rng.integers(0, LAYER_VOCAB, (b, s + 1))
            batches.append((tokens[:, :-1].copy(), tokens[:, 1:].copy()))
        return _least_in_turns(engines, batches, steps,
                               lambda engine: _blocks_seconds(engine.phases) / LAYER_BLOCKS)
    finally:
        for engine in engines:
            engine.close()


def _least_in_turns(engines: list, batches: list, steps: int, clock) -> list[float]:
    """Per engine, the least over `steps` train_steps on its batch (inputs, targets) of what
    `clock(engine)` (a running total of seconds) gains across one, after an untimed first
    step (it compiles and first-touches); the engines take turns, a step each, so that the
    machine's drift touches them alike."""
    times = [[] for _ in engines]
    for step in range(steps + 1):
        for engine, batch, spent in zip(engines, batches, times, strict=True):
            before = clock(engine)
            engine.train_step(*batch)
            if step:
                spent.append(clock(engine) - before)
    return [min(t) for t in times]


def _block_figures(shape: dict, seconds: float, gemm_rate: float) -> dict:
    """One shape of measure_layer: its block's `seconds`, matmul FLOPs and activation bytes,
    and the seconds besides the matmuls at `gemm_rate`."""
    from zmpi.models.gpt_counts import gpt_activation_bytes
    from zmpi.nn.attention import attention_block, causal_entries

    b, s, h, heads = shape["micro_batch"], shape["seq_len"], shape["d_model"], shape["n_head"]
    scores = b * heads * causal_entries(s, attention_block(s, b * heads, False))
    flops = 3 * (2 * b * s * 12 * h * h + 4 * scores * h // heads)
    nbytes = gpt_activation_bytes(LAYER_BLOCKS, h, heads, LAYER_VOCAB, s, b, 4)["layer"]
    rest = max(seconds - flops / gemm_rate, 0.1 * seconds)  # a floor against a noisy GEMM
    return {**shape, "block_seconds": seconds, "matmul_flops": flops, "layer_bytes": nbytes,
            "rest_seconds": rest}


def measure_engine(steps: int = 15) -> dict:
    """The engine's work that scales with its units and parameters rather than with the
    activations, on this rank alone: a 2-block GPT of ENGINE_SHAPE, ENGINE_MICRO_BATCHES
    micro-batches a step, trained at ZeRO-0, -2 and -3 in fp32 and at ZeRO-0 in fp16 (the
    least step of `steps` after a warm-up each). Against fp32 ZeRO-0: a stage's extra
    seconds per unit and micro-batch (`stage2_unit_overhead`, `stage3_unit_overhead`: a full
    gradient allocated, reduced into the shard and freed, ZeRO-3 also gathering and releasing
    the parameters), and the parameters per second that fp16 storage costs per micro-batch
    (`half_storage_rate`: the weights cast to float32 at each use and the gradients back);
    0 and None where noise hid the difference. The four engines take turns, a step each, so
    that the machine's drift touches them alike. The step seconds are kept under "steps"."""
    from zmpi.plan.memory import stage_units

    b, s, h, heads = (ENGINE_SHAPE[k] for k in ("micro_batch", "seq_len", "d_model", "n_head"))
    m = ENGINE_MICRO_BATCHES
    units = stage_units(Job(ENGINE_BLOCKS, h, heads, ENGINE_VOCAB, s, b * m, 1, 1, "fp32"),
                        1, 1)[0]
    engines = {}
    try:
        for name, precision, stage in (("fp32 stage 0", "fp32", 0), ("fp32 stage 2", "fp32", 2),
                                       ("fp32 stage 3", "fp32", 3), ("fp16 stage 0", "fp16", 0)):
            engines[name] = _engine_alone(precision, stage)
        least = _least_in_turns(list(engines.values()), [_engine_batch()] * len(engines),
                                steps, lambda engine: time.perf_counter())
    finally:
        for engine in engines.values():
            engine.close()
    seconds = dict(zip(engines, least, strict=True))
    base = seconds["fp32 stage 0"]
    per_unit = {k: max(seconds[f"fp32 stage {k}"] - base, 0.0) / (m * len(units))
                for k in (2, 3)}
    half = seconds["fp16 stage 0"] - base
    return {"shape": ENGINE_SHAPE, "micro_batches": m, "units": len(units),
            "params": sum(units), "steps": seconds,
            "stage2_unit_overhead": per_unit[2], "stage3_unit_overhead": per_unit[3],
            "half_storage_rate": m * sum(units) / half if half > 0 else None}


def measure_crowd_efficiency(comm, cores: int, repeats: int = 5, steps: int = 5) -> dict:
    """Collective, for the ranks of `comm` that outnumber the `cores`: the fraction of its
    core share (cores / ranks) of its own speed a rank's training step gets when every rank
    trains at once ("crowd_efficiency", what `oversubscribed_efficiency` is). Each rank
    trains measure_engine's fp32 ZeRO-0 GPT, one micro-batch a step (about 35 ms here; 4
    micro-batches gave the same ratios), on its own (no collective inside a step); each
    repeat, every rank in turn runs `steps` steps alone (the others asleep), then all run
    `steps` steps at once, a barrier before each (each step the slowest rank's); the ratio
    is the ranks' mean median step alone times ranks / cores over the median step at once,
    the median of `repeats` ("crowd_efficiencies" keeps them). A step, not a GEMM: at once
    the ranks also share caches and memory, and a rank done first waits spinning in MPI on
    a core its peer needs (GEMMs in windows of wall time reached 0.93-0.96 here, such steps
    0.72-0.87)."""
    engine, batch = _engine_alone("fp32", 0, micro_batches=1), _engine_batch(1)
    ratios, alone_steps, crowd_steps = [], [], []
    try:
        engine.train_step(*batch)  # compiles and first-touches
        for _ in range(repeats):
            mine = in_turns(comm, lambda: statistics.median(_step_seconds(engine, batch)
                                                            for _ in range(steps)))
            alone_steps.append(comm.allreduce_scalar(mine) / comm.size)
            at_once = []
            for _ in range(steps):
                comm.barrier()
                at_once.append(comm.allreduce_scalar(_step_seconds(engine, batch), op="max"))
            crowd_steps.append(statistics.median(at_once))
            ratios.append(alone_steps[-1] * comm.size / cores / crowd_steps[-1])
    finally:
        engine.close()
    return {"crowd_efficiency": statistics.median(ratios), "crowd_efficiencies": ratios,
            "alone_step_seconds": alone_steps, "crowd_step_seconds": crowd_steps}


def _engine_alone(precision: str, stage: int, micro_batches: int = ENGINE_MICRO_BATCHES):
    """An Engine on this rank alone (COMM_SELF) training a GPT of ENGINE_SHAPE,
    `micro_batches` a step, in `precision` at ZeRO `stage`."""
    from mpi4py import MPI

    from zmpi.comm import Comm
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig
    from zmpi.plan.layout import Layout, to_config

    b, s, h, heads = (ENGINE_SHAPE[k] for k in ("micro_batch", "seq_len", "d_model", "n_head"))
    m = micro_batches
    job = Job(ENGINE_BLOCKS, h, heads, ENGINE_VOCAB, s, b * m, 1, 1, precision)
    config = to_config(job, Layout(1, 1, 1, stage, "none", "none", False, b, m, "1f1b"))
    del config["model"]  # the model is built here
    return Engine(GPT(GPTConfig(ENGINE_VOCAB, s, ENGINE_BLOCKS, heads, h), seed=0), config,
                  Comm(MPI.COMM_SELF))


def _engine_batch(micro_batches: int = ENGINE_MICRO_BATCHES) -> tuple:
    """(inputs, targets) of one step of `_engine_alone`'s GPT, from a fixed seed."""
    b, s = ENGINE_SHAPE["micro_batch"] * micro_batches, ENGINE_SHAPE["seq_len"]
    tokens = np.random.default_rng(0).integers(0, ENGINE_VOCAB, (b, s + 1))
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def _step_seconds(engine, batch) -> float:
    start = time.perf_counter()
    engine.train_step(*batch)
    return time.perf_counter() - start


def _blocks_seconds(profile) -> float:
    """The forward and backward seconds of every Block a PhaseProfile has summed so far."""
    return sum(u["forward"] + u["backward"]
               for name, u in zip(profile.unit_names, profile.units, strict=True)
               if name == "Block")

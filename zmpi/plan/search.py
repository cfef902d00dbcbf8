"""`plan`: every Layout of a Job that fits the memory, ranked by predicted step time.

    job = Job(n_layer=24, d_model=2304, n_head=24, vocab_size=51200, seq_len=2048,
              global_batch=512, nodes=4, gpus_per_node=8)
    result = plan(job, load_hardware("a100"))
    result.best[0].layout.describe(), result.best[0].time.total
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zmpi.models.llama import llama_flops_per_token
from zmpi.models.moe_counts import moe_extra_flops
from zmpi.plan.hardware import Hardware
from zmpi.plan.layout import Job, Layout, layouts
from zmpi.plan.memory import StageMemory, layout_memory, layout_peaks
from zmpi.plan.time import StepTime, step_time

RESERVE = 0.9  # the share of a device's memory a plan may fill: the rest for the allocator's
#                fragmentation, the CUDA context and the temporaries the ledger does not count


@dataclass(frozen=True)
class Candidate:
    """A Layout that fits, with its memory (the stage needing the most device memory) and
    its predicted StepTime; `tokens_per_s` and `model_flops` (the job's FLOPs per step by
    Megatron-LM's formula, recompute not counted) follow."""

    layout: Layout
    memory: StageMemory
    time: StepTime
    tokens_per_s: float
    model_flops: float

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "describe": self.layout.describe(),
                "memory": self.memory.to_dict(), "time": self.time.to_dict(),
                "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops}


@dataclass
class Plan:
    """What `plan` found: the best candidates (fastest first), how many layouts were
    considered and how many fit, and per reason the count of those that did not."""

    best: list[Candidate]
    considered: int
    fitting: int
    rejected: dict = field(default_factory=dict)


def model_flops_per_step(job: Job, recompute: bool = False) -> float:
    """Megatron-LM 2021's FLOPs of one step (their eq. 3): 96 B s l h^2 (1 + s / (6 h) +
    V / (16 l h)) counting full recompute's second forward, 72 B s l h^2 (1 + s / (6 h) +
    V / (12 l h)) without it (the logit layer, 6 B s h V, is never recomputed); a Llama's
    from `llama_flops_per_token`, three forwards a token (the blocks' four recomputed); MoE
    blocks add their gates and each token's k experts beyond the dense MLPs
    (`moe_extra_flops(useful=True)`)."""
    B, s, L, h, V = job.global_batch, job.seq_len, job.n_layer, job.d_model, job.vocab_size
    if job.llama is not None:  # llama_flops_per_token's forward, three times (four recomputed)
        forward = llama_flops_per_token(job.llama, s)
        head = 2 * h * V
        return B * s * (3 * forward + (forward - head if recompute else 0))
    # MoE blocks: their gates and the k experts of every token beyond the dense MLPs
    moe = 0 if job.moe is None else (4 if recompute else 3) * moe_extra_flops(
        L, h, s, B, job.moe_section, useful=True)
    if recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) + moe
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)) + moe


def evaluate(job: Job, layout: Layout, hw: Hardware) -> Candidate:
    """The memory and predicted time of one layout (whether it fits is the caller's)."""
    stages = layout_memory(job, layout, hw.on_gpu)
    memory = max(stages, key=lambda m: (m.device, m.host))
    time = step_time(job, layout, hw)
    return Candidate(layout, memory, time, job.global_batch * job.seq_len / time.total,
                     model_flops_per_step(job))


def plan(job: Job, hw: Hardware, device_memory: float | None = None,
         host_memory: float | None = None, top: int = 5, progress=None) -> Plan:
    """The `top` fastest layouts of `job` on `hw` whose busiest rank needs at most RESERVE of
    `device_memory` (default the hardware's) and whose node's ranks together need at most
    `host_memory` (default the hardware's) on the host. On a CPU (hw.cores_per_node set) a
    node's ranks share one memory, device_memory: their device and host bytes together must
    fit RESERVE of it. A ValueError if a fitting layout's predicted time is not finite (a
    Hardware made without from_dict's ranges)."""
    device_memory = hw.device_memory if device_memory is None else device_memory
    host_memory = hw.host_memory if host_memory is None else host_memory
    ranks_per_node = min(job.gpus_per_node, job.world_size)
    on_gpu = hw.on_gpu
    fitting, considered, rejected = [], 0, {"device memory": 0, "host memory": 0}
    for layout in layouts(job):
        considered += 1
        if progress and considered % 20000 == 0:
            progress(f"{considered} layouts considered, {len(fitting)} fit")
        device, host = layout_peaks(job, layout, on_gpu)
        if (device.max() if on_gpu else (device + host).max() * ranks_per_node) > \
                RESERVE * device_memory:
            rejected["device memory"] += 1
            continue
        if on_gpu and host.max() * ranks_per_node > host_memory:
            rejected["host memory"] += 1
            continue
        seconds = step_time(job, layout, hw).total
        if not math.isfinite(seconds):  # never rank layouts on nan or inf
            raise ValueError(f"the predicted step time of {layout.describe()} on {hw.name} is "
                             f"{seconds}: a hardware figure is beyond what the model can price")
        fitting.append((seconds, layout))
    fitting.sort(key=lambda x: (x[0], x[1].describe()))
    best = [evaluate(job, layout, hw) for _, layout in fitting[:top]]
    return Plan(best, considered, len(fitting), rejected)

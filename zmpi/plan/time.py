"""The step time of a Layout of a Job on a Hardware: the model `zmpi plan` ranks layouts by.

Per micro-batch on each pipeline stage (one rank's share under tensor parallelism):

- matmuls: forward 2 b s (12 h^2) / t per block plus attention's q k^T and (p v), 4 b r h / t
  (r: the causal score entries the attention computes, its blocks' lower triangle), the LM
  head 2 b s h V / t; backward twice the forward; full recompute adds the blocks' forward
  again, selective the q k^T; at peak x gemm_efficiency of the compute dtype (fp16 and bf16
  on a GPU in their 16-bit type; fp32, and anything on a CPU, in fp32), a CPU rank getting
  cores / ranks of it (times the hardware's `oversubscribed_efficiency`) when oversubscribed,
  as of its other rates;
- elementwise work (LayerNorm, GELU, softmax, residuals, the loss): the micro-batch's
  activation bytes without recompute at the hardware's elementwise rate (a GPU's: the memory
  bandwidth over ELEMENTWISE_PASSES passes; a CPU's measured), plus the forward's third of
  what recompute runs again (full: every block's; selective: the attention scores'); the
  hardware's `layer_overhead` per block (a third more under full recompute); at ZeRO-2 / 3
  its `stage2_unit_overhead` / `stage3_unit_overhead` per unit of the stage; in fp16 on a
  CPU the stage's parameters at its `half_storage_rate` (a third more under full
  recompute);
- tensor parallelism: the calls zmpi.plan.collectives counts (4 allreduces of b s h
  activations per block, 6 with full recompute, the embedding's and the head's, the
  cross-entropy's 3 of b s values), ring cost 2 (t-1)/t n / B + 2 (t-1) alpha each on the
  node's link (sequence parallelism moves the same bytes in twice the calls, a reduce-scatter
  and an allgather of sequence-major copies: 2 (1 + 1/t) b s h elements read and written per
  pair, at the memory bandwidth; and once a step sums its parameters' gradients); each call
  also waits the hardware's `sync_skew` for the last rank to arrive (ranks with cores of
  their own);
- pipeline: the stage's output forward and its gradient backward, alpha + n / B each; once
  a step a header to the next stage and the tied embedding's gradient allreduced between the
  first and last stages;
- on a CPU whose ranks outnumber its cores every collective crosses the hardware's
  `oversubscribed` link, its latency once a call (not per ring message), or the node's link
  at cores / ranks of its bandwidth.

The pipeline runs (m + p - 1) micro-batch times of its slowest stage (the bubble is
(p - 1) / (m + p - 1) of it). Data parallelism: the ZeRO stage's ring passes over the stage's
padded parameters (stages 0-1 once a step; stage 2 reduce-scatters every micro-step, stage 3
also gathers twice, and the embedding twice more for the head that reads it), latency
2 (d-1) or (d-1) alpha per unit and pass; in fp16 each gradient
reduction also sums (d-1)/d of its bytes at the hardware's `half_reduction_rate` (a CPU rank
its core share of it); with overlap (a GPU, or
a CPU with a core to spare) the gradient passes hide behind backward (all micro-steps' for
stages 2-3, the last one's for 0-1) except the last unit's. The optimizer: Adam over the
rank's master elements at the memory bandwidth, or at the host Adam's rate with offload plus
the gradient shard down (every micro-step at stages 2-3, each added into the accumulated one
on the host at the hardware's host_add_rate) and the parameters up over the host link (stage
3 parameter offload: each gather's shard), hidden behind backward on a GPU except the last
unit's gradient and the update. The host Adam's rate is the node's share per device spread
over the node's ranks (a rank alone on a node uses every core's thread).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from zmpi.models.moe_counts import moe_alltoall, moe_extra_flops
from zmpi.nn.attention import attention_block, causal_entries
from zmpi.parallel.tensor.vocab import vocab_shard
from zmpi.plan.collectives import (
    LOSS_ALLREDUCES,
    SP_PARAMS_PER_BLOCK,
    data_rounds,
    pipeline_calls,
    tensor_calls,
)
from zmpi.plan.hardware import Hardware, Link
from zmpi.plan.layout import Job, Layout
from zmpi.plan.memory import (
    micro_batch_activation,
    moe_unit_experts,
    padded,
    stage_blocks,
    stage_units,
)

ELEMENTWISE_PASSES = 6  # activation bytes touched per micro-batch: written and read forward,
#                         read with their gradients written and read backward
FORWARD_SHARE = 2 / ELEMENTWISE_PASSES  # of those passes, the forward's (recompute repeats it)
BACKWARD_SHARE = 2 / 3  # of a micro-batch's compute, the backward's (twice the forward)
ADAM_BYTES = 24  # fp32 master, m, v read and written per element (+ gradient and parameter)
HOST_ADAM_BYTES = 28  # what host_adam_rate moves per parameter (hardware.py): its streaming rate


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step: `compute` (matmuls and elementwise work of the slowest
    stage's micro-batches, recompute included), `tensor` and `pipeline` (their
    communication on that stage), `bubble` (the pipeline's idle time), `data` (exposed
    data-parallel communication), `optimizer` (the update, host copies included), `alltoall`
    (MoE blocks' expert-parallel exchanges, not overlapped; 0 and left out of `to_dict`
    without them); `total`."""

    compute: float
    tensor: float
    pipeline: float
    bubble: float
    data: float
    optimizer: float
    alltoall: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.tensor + self.pipeline + self.bubble + self.data
                + self.optimizer + self.alltoall)

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.alltoall:
            del out["alltoall"]
        return {**out, "total": self.total}


def ring_sent(nbytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring allreduce of `nbytes` over `ranks` ranks."""
    return 2 * (ranks - 1) / ranks * nbytes


def ring_allreduce(link: Link, nbytes: float, ranks: int, calls: int = 1) -> float:
    """Seconds of `calls` ring allreduces of `nbytes` in all over `ranks`: 2 (n-1)/n of it
    sent per rank, the link's latency per message (2 (n-1) a call) or, for a `per_call` link,
    once a call."""
    if ranks == 1:
        return 0.0
    return link.seconds(ring_sent(nbytes, ranks), link.latencies(calls, 2 * (ranks - 1) * calls))


def ring_pass(link: Link, nbytes: float, ranks: int, calls: int = 1) -> float:
    """Seconds of `calls` ring reduce-scatters or allgathers of `nbytes` of buffers in all
    over `ranks`: (n-1)/n of them sent per rank, latency per message ((n-1) a call) or, for
    a `per_call` link, once a call."""
    if ranks == 1:
        return 0.0
    return link.seconds((ranks - 1) / ranks * nbytes, link.latencies(calls, (ranks - 1) * calls))


def _links(job: Job, layout: Layout, hw: Hardware) -> dict[str, Link]:
    """The link each dimension's collectives cross: tensor ranks are neighbours, then data,
    then pipeline (zmpi.parallel.mesh); a group inside one node uses intra_node. On a CPU
    whose ranks outnumber its cores: the hardware's `oversubscribed` link, whose latency is a
    call's (each waits for peers the OS has descheduled, whatever the group's size), else
    the link at cores / ranks of its bandwidth (MPI copies through shared memory on the cores
    that compute)."""
    g = job.gpus_per_node
    share = hw.core_share(min(g, job.world_size))

    def link(span):
        chosen = hw.intra_node if span <= g else hw.inter_node
        if share == 1:
            return chosen
        return hw.oversubscribed or Link(chosen.bandwidth * share, chosen.latency)
    return {"tp": link(layout.tp), "dp": link(layout.tp * layout.dp),
            "ep": link(layout.tp * layout.ep),
            "pp": link(layout.tp * layout.dp * layout.pp) if layout.pp > 1 else hw.intra_node}


def matmul_rate(job: Job, hw: Hardware, ranks_per_node: int) -> float:
    """FLOP/s one rank's matmuls reach."""
    dtype = job.precision if job.precision in ("fp16", "bf16") and hw.on_gpu else "fp32"
    return hw.peak_flops[dtype] * hw.gemm_efficiency * hw.core_share(ranks_per_node)


def elementwise_rate(hw: Hardware, ranks_per_node: int) -> float:
    """Activation bytes per second one rank's elementwise work goes through (forward and
    backward), a CPU rank getting cores / ranks of it when oversubscribed."""
    rate = hw.elementwise_rate or hw.memory_bandwidth / ELEMENTWISE_PASSES
    return rate * hw.core_share(ranks_per_node)


def can_overlap(hw: Hardware, ranks_per_node: int) -> bool:
    """Whether communication proceeds while a rank computes: on a GPU, or with a spare core."""
    return hw.on_gpu or ranks_per_node < hw.cores_per_node


def step_time(job: Job, layout: Layout, hw: Hardware) -> StepTime:
    """The predicted StepTime of `layout` (see the module docstring)."""
    on_gpu = hw.on_gpu
    ranks_per_node = min(job.gpus_per_node, job.world_size)
    rate = matmul_rate(job, hw, ranks_per_node)
    bandwidth = hw.memory_bandwidth * hw.core_share(ranks_per_node)
    links = _links(job, layout, hw)
    act = micro_batch_activation(job, layout.tp, layout.sequence_parallel, "none",
                                 layout.micro_batch, on_gpu, layout.ep)
    kept = micro_batch_activation(job, layout.tp, layout.sequence_parallel, layout.recompute,
                                  layout.micro_batch, on_gpu, layout.ep)
    act_layer, kept_layer = (sum(a["blocks"]) / job.n_layer for a in (act, kept))  # a mean
    again = {"none": 0, "selective": act_layer - kept_layer, "full": act_layer}
    layer_bytes = act_layer + FORWARD_SHARE * again[layout.recompute]
    elementwise_s = 1 / elementwise_rate(hw, ranks_per_node)
    again_share = 1 + FORWARD_SHARE if layout.recompute == "full" else 1
    block_overhead = hw.layer_overhead / hw.core_share(ranks_per_node) * again_share
    unit_overhead = {2: hw.stage2_unit_overhead, 3: hw.stage3_unit_overhead}.get(
        layout.stage, 0.0) / hw.core_share(ranks_per_node)
    half_storage = again_share / (hw.half_storage_rate * hw.core_share(ranks_per_node)) \
        if job.precision == "fp16" and hw.half_storage_rate and not on_gpu else 0.0
    b, s, h, t = layout.micro_batch, job.seq_len, job.d_model, layout.tp
    block = attention_block(s, b * job.n_head // t, on_gpu)
    scores = b * causal_entries(s, block)
    linear = 2 * b * s * job.block_matmul(t)
    attention = 4 * scores * h / t
    block_forward = linear + attention
    block_extra = {"none": 0.0, "selective": attention / 2, "full": block_forward}
    head_forward = 2 * b * s * h * vocab_shard(job.vocab_size, t, 0, job.vocab_multiple)[2]
    activation_bytes = b * s * h * job.act_bytes(on_gpu)
    loss_bytes = LOSS_ALLREDUCES * b * s * 4  # float32 values per position
    # each tensor-parallel call is synchronous: it also waits for the last rank to arrive
    # (oversubscribed ranks wait inside the `oversubscribed` link instead)
    skew = hw.sync_skew if t > 1 and hw.core_share(ranks_per_node) == 1 else 0.0
    # sequence parallelism: each allreduce is a reduce-scatter and an allgather of
    # sequence-major copies, made before and undone after each (parallel.tensor.regions):
    # 2 (1 + 1/t) b s h elements copied, each read and written
    sp_copy_s = 4 * (1 + 1 / t) * activation_bytes / bandwidth \
        if layout.sequence_parallel and t > 1 else 0.0
    stages = stage_units(job, layout.pp, layout.tp)
    section = None if job.moe is None else replace(job.moe_section, ep_size=layout.ep)
    # MoE blocks (one stage: `layouts`): their gates and experts beyond the dense MLPs, forward
    # and backward (and again under full recompute), and their all-to-alls over ep
    moe_flops = 0 if section is None else (3 + (layout.recompute == "full")) * moe_extra_flops(
        job.n_layer, h, s, b, section)
    a2a = None if section is None or layout.ep == 1 else moe_alltoall(
        job.n_layer, h, s, b, section, layout.recompute)
    # the sequence-parallel parameters (h each) per block and in the head: a Llama's RMSNorms
    sp_block, sp_head = (SP_PARAMS_PER_BLOCK, 2) if job.llama is None else (2, 1)
    micro, per_step = [], []
    kinds = {(st == 0, st == layout.pp - 1, len(units), sum(units), units[0])
             for st, units in enumerate(stages)}
    for first, last, n_units, params, leading in kinds:  # stages alike: alike times
        blocks = stage_blocks(n_units, first, last, layout.pp, job.tied)
        flops = blocks * (3 * block_forward + block_extra[layout.recompute]) \
            + (3 * head_forward if last else 0) + moe_flops
        elementwise = blocks * layer_bytes + (act["head"] + act["loss"] if last else 0)
        passes, calls = tensor_calls(layout, blocks, first, last,
                                     job.tensor_reductions_per_block)
        loss_calls = LOSS_ALLREDUCES * last
        tensor = 0.0 if t == 1 else links["tp"].seconds(
            (t - 1) / t * (passes * activation_bytes + 2 * last * loss_bytes),
            links["tp"].latencies(calls + loss_calls, (t - 1) * (passes + 2 * loss_calls))) \
            + skew * (calls + loss_calls)
        sends, headers, tied = pipeline_calls(layout, first, last, job.tied)
        pipe = links["pp"].seconds(sends * activation_bytes, sends)
        engine = blocks * block_overhead + n_units * unit_overhead + params * half_storage \
            + sp_copy_s * passes / 2
        micro.append((flops / rate + elementwise * elementwise_s + engine, tensor, pipe))
        sp_grads = (sp_block * blocks + sp_head * last) * h * job.param_bytes
        per_step.append((
            ring_allreduce(links["tp"], sp_grads, t) + skew
            if layout.sequence_parallel and t > 1 else 0.0,
            links["pp"].seconds(0, headers)
            + ring_allreduce(links["pp"], tied * leading * job.param_bytes, 2, tied)))
    m, p = layout.micro_batches, layout.pp
    slowest = max(range(len(micro)),
                  key=lambda k: (m + p - 1) * sum(micro[k]) + sum(per_step[k]))
    compute, tensor, pipe = (m * x for x in micro[slowest])
    tensor, pipe = tensor + per_step[slowest][0], pipe + per_step[slowest][1]
    bubble = (p - 1) * sum(micro[slowest])
    heaviest = max(range(p), key=lambda st: sum(stages[st]))
    units = stages[heaviest]
    alltoall = 0.0
    if a2a is not None:  # each rank sends (ep - 1) / ep of each buffer, to ep - 1 peers
        link = links["ep"]
        alltoall = m * link.seconds(a2a["sent_elements"] * job.act_bytes(on_gpu),
                                    link.latencies(a2a["calls"], (layout.ep - 1) * a2a["calls"]))
        experts = moe_unit_experts(job, layout.ep)  # a second ZeRO instance over dp / ep
        units = [n - e * layout.ep for n, e in zip(units, experts, strict=True)]
        expert_data, expert_optimizer = _data_and_optimizer(
            job, replace(layout, dp=layout.dp // layout.ep), hw,
            [e for e in experts if e], links["dp"], False, micro[slowest], bandwidth,
            ranks_per_node)
    data, optimizer = _data_and_optimizer(job, layout, hw, units, links["dp"],
                                          heaviest == p - 1 and job.tied, micro[slowest],
                                          bandwidth, ranks_per_node)
    if a2a is not None:
        data, optimizer = data + expert_data, optimizer + expert_optimizer
    return StepTime(compute, tensor, pipe, bubble, data, optimizer, alltoall)


def _data_and_optimizer(job, layout, hw, units, link, holds_head, slowest, bandwidth,
                        ranks_per_node):
    """(exposed data-parallel seconds, optimizer seconds) per step for the stage holding
    `units` (parameter counts; `holds_head`: the LM head reading the tied embedding too),
    its slowest micro-batch times `slowest`, its collectives crossing `link`."""
    d, m, pb = layout.dp, layout.micro_batches, job.param_bytes
    sizes = [padded(n, d) for n in units]
    full, shard = sum(sizes), sum(sizes) // d
    nbytes, count = full * pb, len(sizes)
    rounds = data_rounds(layout)
    grads = ring_allreduce(link, rounds["allreduce"] * nbytes, d,
                           rounds["allreduce"] * count) \
        + ring_pass(link, rounds["reduce_scatter"] * nbytes, d,
                    rounds["reduce_scatter"] * count)
    if layout.stage == 3:  # gathers for forward and backward, the embedding's for the head too
        tied = holds_head * sizes[0] * pb
        grads += ring_pass(link, rounds["allgather"] * (nbytes + tied), d,
                           rounds["allgather"] * (count + holds_head))
    if job.precision == "fp16" and hw.half_reduction_rate and d > 1:  # MPI's float16 sums
        reductions = 1 if layout.stage <= 1 else m
        grads += reductions * (d - 1) / d * nbytes / (hw.half_reduction_rate
                                                      * hw.core_share(ranks_per_node))
    params = ring_pass(link, rounds["allgather"] * nbytes, d, rounds["allgather"] * count) \
        if layout.stage in (1, 2) else 0.0
    if can_overlap(hw, ranks_per_node):
        hidden = sum(slowest) * (m if layout.stage >= 2 else 1) * BACKWARD_SHARE
        grads = max(grads - hidden, grads / count)
    owned = shard if layout.stage >= 1 else full
    if layout.offload == "none":
        optimizer = owned * (ADAM_BYTES + 2 * pb) / bandwidth
    else:
        host_adam = hw.host_adam_rate * hw.devices_per_node / ranks_per_node
        backward = m * sum(slowest) * BACKWARD_SHARE
        optimizer = owned / host_adam + _offload_copies(layout, hw, shard, pb, count, backward,
                                                        ranks_per_node)
    return grads + params, optimizer


def host_add_rate(hw: Hardware, ranks_per_node: int) -> float:
    """Gradient elements per second one rank's thread adds into its accumulated host shard:
    the hardware's `host_add_rate`, else the host Adam's streaming share at 6 bytes an
    element (float16 read twice, written once) against Adam's 28; a CPU rank gets its core
    share of it."""
    rate = hw.host_add_rate or hw.host_adam_rate * HOST_ADAM_BYTES / 6
    return rate * hw.core_share(ranks_per_node)


def offload_transfers(layout: Layout) -> tuple[int, int, int]:
    """Per step, in whole shards of a rank with optimizer offload: (gradient shards copied
    device -> host, parameter shards copied host -> device, gradient shards added on the
    host). Stage 1 reduces once a step and copies the shard down; stages 2-3 reduce and copy
    every micro-step, adding all but the step's first into the accumulated shard; the update
    goes up once, or with stage 3's parameter offload each of a micro-step's two gathers reads
    the host shard."""
    m = layout.micro_batches
    down = 1 if layout.stage == 1 else m
    return down, 2 * m if layout.offload == "optimizer+param" else 1, down - 1


def _offload_copies(layout, hw, shard, pb, units, backward, ranks_per_node) -> float:
    """Exposed seconds per step of offload's host traffic for a rank's `shard` elements of
    `pb` bytes in `units` units: the reduced gradient shard down once a step (stage 1) or
    every micro-step (stages 2-3; each but the step's first added on the host into the
    accumulated one, at `host_add_rate`), the parameter shard up once (the update) or at each
    of stage 3's two gathers per micro-step with parameter offload. On a GPU the copies and
    adds of a unit run while the device computes the units after it in backward, so all but
    the last unit's gradient and the update hide behind the `backward` seconds of the step; on
    a CPU the rank's thread does them all."""
    down, up, adds = offload_transfers(layout)
    copy = hw.host_device.seconds(shard * pb)
    add = shard / host_add_rate(hw, ranks_per_node)
    total = (down + up) * copy + adds * add
    if not hw.on_gpu:
        return total
    last = (copy + (add if adds else 0)) / units + (copy if up == 1 else 0)
    return last + max(0.0, total - last - backward)

"""The step of train_step: from the reduced gradients to updated parameters.

    reduce_and_update(engine, loss)
                                finish the strategy's reductions; read the loss and the
                                gradients' sum of squares back in one transfer; unscale (loss
                                scaling and the global-batch mean); skip on overflow or name
                                the first non-finite unit (an overflow at the least scale,
                                or `hysteresis` in a row at a static one; every gradient
                                zero at a static scale below 1); clip; Adam now, or in the
                                background (DPU)
    apply_schedule(engine)      the LR schedule's rate (and betas) for the step about to run
    clip_coef(engine, sumsq)    the factor that brings the global L2 norm to gradient_clipping

What is the same for every stage lives here; what a stage keeps and sends is its strategy's.
"""
from __future__ import annotations

import math
import time

from zmpi import backend
from zmpi.engine.checks import check_grads_contract, first_nonfinite_unit
from zmpi.engine.tensor import sum_sequence_parallel_grads, tensor_norm_sq


def reduce_and_update(engine, loss) -> float:
    """The optimizer step of train_step, after the last backward: finish the reductions,
    unscale, check for overflow (skip the step, or name the first non-finite unit), clip,
    and apply Adam now or, with DPU, in the background. `loss`: this rank's loss summed over
    the step's micro-batches, a 0-d array on the device or a number; returned as a float,
    read back together with the gradients' sum of squares (on a GPU: the step's one
    device -> host transfer)."""
    strategy, experts = engine.strategy, engine.experts
    for each in engine.strategies:  # the engine's, and at ep > 1 the experts' (engine/moe.py)
        each.wait_pending()
        each.before_step()
    # Reduced gradients (this rank's shard, storage dtype): the optimizer reads them as
    # grads * grad_scale (the global-batch mean) * clip_coef, converted chunk by chunk.
    grads = strategy.optimizer_grads()
    check_grads_contract(strategy, grads, engine.dtype)
    sum_sequence_parallel_grads(engine, grads)  # sequence parallelism: over the tensor ranks
    if engine.pipeline is not None:
        engine.pipeline.sum_tied_grads(grads)  # a weight two stages hold: over those stages
    # summed over the data-parallel ranks, or this rank's own (1-bit Adam after its warm-up)
    ranks = engine.mesh.dp if engine.optimizer.reduces_gradients else 1
    grad_scale = 1.0 / (engine.scaler.scale * ranks * engine.accumulation)
    sumsq = engine.optimizer.sum_of_squares(grads, grad_scale, engine.master_dtype)
    expert_grads = experts.strategy.optimizer_grads() if experts else None
    expert_sumsq = engine.optimizer.sum_of_squares(expert_grads, grad_scale,
                                                   engine.master_dtype) if experts else 0.0
    loss, sumsq, expert_sumsq = backend.read_scalars(loss, sumsq, expert_sumsq)
    # a sum that is not finite holds a NaN or inf, or overflowed from finite gradients
    finite = all(math.isfinite(s) or engine.optimizer.all_finite(g)
                 for s, g in ((sumsq, grads), (expert_sumsq, expert_grads)) if g is not None)
    engine.flush()  # the previous step's delayed update lands (its compute overlapped ours)
    apply_schedule(engine)  # a skipped step keeps the rate it would have run at
    scaler = engine.scaler
    if any_rank(engine.comm, not finite):
        if not engine.config.fp16.enabled or scaler.at_minimum:
            where = first_nonfinite_unit(engine, grads)
            raise FloatingPointError(
                f"non-finite gradients at optimizer step {engine.global_steps} "
                f"({engine.scaler.skipped_steps} skipped before; {engine.dtype.name}"
                + ("" if not engine.config.fp16.enabled else
                   f", loss scale already at its minimum {scaler.min_scale:g}"
                   if scaler.dynamic else
                   f", at the static fp16.loss_scale {scaler.scale:g}, which never changes: "
                   f"{scaler.hysteresis} overflows in a row; lower it, or give 0 for dynamic "
                   "scaling")
                + f"); the first in backward order is in {where}")
        scaler.update(overflow=True)  # skip the step on every rank
        return loss
    if engine.config.fp16.enabled and not scaler.dynamic and scaler.scale < 1 and \
            not any_rank(engine.comm, sumsq + expert_sumsq > 0):  # only a scale below 1
        raise FloatingPointError(
            f"every gradient is zero at optimizer step {engine.global_steps}: the static "
            f"fp16.loss_scale {scaler.scale:g} flushes the scaled gradients to zero in "
            f"{engine.dtype.name} (its least magnitude is 6e-08), and nothing trains; raise "
            "it, or give 0 for dynamic scaling")
    # Adam on the master shard and moments (host, device or NVMe: the strategy's)
    coef = clip_coef(engine, sumsq, grads, grad_scale, expert_sumsq)

    def update(publish: bool) -> None:  # the engine's states, then the experts' (ep > 1)
        for each, g in zip(engine.strategies, (grads, expert_grads), strict=False):
            # the same step of the same optimizer: the experts' does not count it again
            each.optimizer_step(engine.optimizer, g, grad_scale, coef,
                                each.publish_targets() if publish else None,
                                advance=each is strategy)

    if engine.delay_update and engine.global_steps >= engine.delay_update_warmup:
        for each in engine.strategies:  # backward of the next step fills the other buffers
            each.swap_grad_buffers()
        engine.delayed.start(lambda: update(publish=False), engine.global_steps)
    else:
        start = time.perf_counter()  # host params: written as Adam goes (publish_targets)
        update(publish=True)
        engine.update_timing["optimizer_s"] += time.perf_counter() - start
        for each in engine.strategies:
            each.publish_params()
    engine.scaler.update(overflow=False)
    engine.global_steps += 1
    return loss


def apply_schedule(engine) -> None:
    """Set the optimizer's lr (and betas, for OneCycle) for the step about to be applied:
    the schedule at DeepSpeed's last_batch_iteration = applied steps - 1."""
    if engine.schedule is None:
        return
    it = engine.global_steps - 1
    engine.optimizer.lr = engine.schedule.lr(it)
    betas = engine.schedule.betas(it)
    if betas is not None:
        engine.optimizer.betas = betas


def clip_coef(engine, sumsq: float, grads, grad_scale: float, expert_sumsq: float = 0.0) -> float:
    """Factor that brings the global L2 norm over all ranks' shards (all stages, all tensor
    slices, every expert) to gradient_clipping (1.0 when it is below, or clipping is off).
    `sumsq`: this rank's sum of squared scaled gradients (`grads` * `grad_scale`);
    `expert_sumsq`: the same of its expert strategy's gradients (ep > 1, engine/moe.py)."""
    max_norm = engine.config.gradient_clipping
    if max_norm <= 0:
        return 1.0
    if engine.pipeline is not None:  # a tied weight counts once, at its owner's stage
        sumsq -= engine.pipeline.held_sumsq(grads, grad_scale, engine.master_dtype)
    if engine.mesh.tp > 1:  # split parameters over the tensor ranks, replicated ones once
        sumsq = tensor_norm_sq(engine, sumsq, grads, grad_scale)
    elif engine.strategy.shard_optimizer:  # each shard group holds the stage's model once
        sumsq = engine.strategy.comm.allreduce_scalar(sumsq)
    if engine.experts is not None:  # each expert once: over edp's shards, then over ep
        sumsq += engine.experts.global_sumsq(expert_sumsq, grad_scale)
    if engine.pipeline is not None:  # every stage's share, its experts' included
        sumsq = engine.mesh.pp_comm.allreduce_scalar(sumsq)
    coef = max_norm / (math.sqrt(sumsq) + 1e-6)  # as torch.nn.utils.clip_grad_norm_
    return min(coef, 1.0)


def any_rank(comm, flag: bool) -> bool:
    return comm.allreduce_scalar(float(flag), op="max") > 0

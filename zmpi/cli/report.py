"""What `zmpi train` prints at the end of a run: every rank's model-state memory next to the
declaration and the closest ZeRO stage's formula (`memory_table`), and the traffic each rank
sent (`traffic_line`)."""
from __future__ import annotations

from zmpi.memory import ARRAY_OPS, DEVICES, MODEL_STATE, model_state_placement
from zmpi.words import count


def closest_zero_stage(strategy) -> int:
    """The ZeRO stage whose partitioning a strategy's flags match best: 3 if it shards the
    parameters, else 2 if the gradients, else 1 if the optimizer state, else 0."""
    return (3 if strategy.shard_parameters else 2 if strategy.shard_gradients
            else 1 if strategy.shard_optimizer else 0)


def stage_formula(strategy) -> dict[str, int] | None:
    """{"device"|"host": bytes} per rank by the SC'20 formula of the strategy's closest ZeRO
    stage over its shard group, with ZeRO-Offload's placement (zmpi.memory), for its padded
    model: a figure independent of the strategy's own `expected_model_state()`. None where
    that stage cannot have the strategy's offload settings (an offload a stage lacks)."""
    item, mbytes = strategy.dtype.itemsize, strategy.master_dtype.itemsize
    try:
        placed = model_state_placement(
            strategy.layout.full_numel, strategy.world_size, closest_zero_stage(strategy),
            item, item, mbytes, mbytes, strategy.offload_optimizer, strategy.offload_param,
            strategy.grads_spare is not None)
    except ValueError:
        return None
    return {d: round(sum(placed[d].values())) for d in DEVICES}


def memory_table(engine, comm) -> str:
    """Every rank's measured model-state bytes (ledger) on the device and on the host, next
    to what its strategy declares (`expected_model_state()`: the strategy's own account, which
    the test suite checks the ledger against) and, as an independent check, the SC'20 formula
    of the closest ZeRO stage (`stage_formula`; for stages 0-3 the two agree), and the
    parameters it holds (Psi: its pipeline stage's, its tensor-parallel share, + padding).
    At expert-parallel degree > 1 the declaration and the formula add the experts' strategy
    (the same stage over the expert-data-parallel group: zmpi.engine.moe.ExpertStates), whose
    states the ledger holds beside the dense ones."""
    s = engine.strategy
    mbytes = engine.master_dtype.itemsize
    stage = closest_zero_stage(s)
    declared = {d: sum(sum(t.expected_model_state()[d].values()) for t in engine.strategies)
                for d in DEVICES}
    papers = [stage_formula(t) for t in engine.strategies]
    paper = {d: sum(p[d] for p in papers) for d in DEVICES} if all(papers) else {}
    layouts = [engine.layout] + ([engine.experts.layout] if engine.experts else [])
    held = sum(layout.num_params for layout in layouts)  # this rank's E / ep experts alone
    padding = sum(layout.padding for layout in layouts)
    rows = comm.allgather_object((comm.rank, held, padding,
                                  *(engine.memory.model_state_bytes(d) for d in DEVICES),
                                  *(declared[d] for d in DEVICES),
                                  *(paper.get(d) for d in DEVICES),
                                  engine.memory.peak(MODEL_STATE, "device")))
    zero = f"ZeRO-{stage}"
    lines = [f"model-state memory per rank ({s.name}, {engine.dtype.name} params, "
             f"K = {3 * mbytes}, N = {comm.size}, sharded over {s.world_size}; offload: optimizer "
             f"{'on' if s.offload_optimizer else 'off'}, params "
             f"{'on' if s.offload_param else 'off'})",
             f"declared: the strategy's own expected_model_state(); {zero}: the SC'20 formula "
             f"of ZeRO stage {stage} over {count(s.world_size, 'rank')} (closest to its sharding)"
             + (f"; both with the experts' over {count(engine.experts.strategy.world_size, 'rank')}"
                if engine.experts else ""),
             f"{'rank':>4} {'Psi':>14} {'padding':>8} {'device MiB':>11} {'declared':>9} "
             f"{zero:>7} {'host MiB':>9} {'declared':>9} {zero:>7} {'device peak':>12}"]
    mib = 2**20

    def formula(value):
        return f"{'-':>7}" if value is None else f"{value / mib:>7.3f}"

    for (rank, psi, padding, device, host, want_device, want_host, zero_device, zero_host,
         peak) in rows:
        lines.append(f"{rank:>4} {psi:>14,} {padding:>8} {device / mib:>11.3f} "
                     f"{want_device / mib:>9.3f} {formula(zero_device)} {host / mib:>9.3f} "
                     f"{want_host / mib:>9.3f} {formula(zero_host)} {peak / mib:>12.3f}")
    return "\n".join(lines)


def traffic_line(engine, steps: int, skipped: int = 0) -> str:
    """This rank's bytes sent by array collectives per communicator since the engine started
    (ring model, Comm's counters), next to what the next step should send (the strategy's
    declaration, or 1-bit Adam's compressed allreduce after its warm-up). `skipped` of the
    `steps` were skipped on an fp16 overflow: the line says so, since a skipped step publishes
    no update and sends less than the declaration."""
    declared = engine.expected_traffic()
    parts = []
    for kind, sent in engine.sent_bytes().items():
        parts.append(f"{kind} {sent / 2**20:.2f} MiB ({sent / 2**20 / max(steps, 1):.3f} per "
                     f"step; declared {declared.get(kind, 0) / 2**20:.3f} without accumulation)")
    if engine.mesh.tp > 1:  # Megatron's 4 allreduces of B x T x C per layer and step, or
        # under sequence parallelism as many reduce-scatters and allgathers (the same bytes)
        sent = sum(c["sent"] for op, c in engine.traffic_by_dimension()["tp"].items()
                   if op in ARRAY_OPS)
        parts.append(f"tensor-parallel {sent / 2**20:.2f} MiB "
                     f"({sent / 2**20 / max(steps, 1):.3f} per step)")
    if skipped:
        parts.append(f"{skipped} of {count(steps, 'step')} skipped on an fp16 overflow, which "
                     "send less than declared (no update to publish)")
    return f"traffic sent by this rank over {count(steps, 'step')}: " + "; ".join(parts)

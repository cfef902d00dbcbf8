"""What `zmpi train` prints at the end of a run: every rank's model-state memory next to the
formula (`memory_table`) and the traffic each rank sent (`traffic_line`)."""
from __future__ import annotations

from zmpi.memory import ARRAY_OPS, DEVICES, MODEL_STATE
from zmpi.words import count


def memory_table(engine, comm) -> str:
    """Every rank's measured model-state bytes (ledger) on the device and on the host, next
    to what its strategy declares (for stages 0-3: the SC'20 formula extended with
    ZeRO-Offload's placement, zmpi.memory; the test suite checks they agree), and the
    parameters it holds (Psi: its pipeline stage's, its tensor-parallel share, + padding)."""
    s = engine.strategy
    mbytes = engine.master_dtype.itemsize
    formula = s.expected_model_state()
    rows = comm.allgather_object((comm.rank, engine.num_params, engine.layout.padding,
                                  *(engine.memory.model_state_bytes(d) for d in DEVICES),
                                  *(sum(formula[d].values()) for d in DEVICES),
                                  engine.memory.peak(MODEL_STATE, "device")))
    lines = [f"model-state memory per rank ({s.name}, {engine.dtype.name} params, "
             f"K = {3 * mbytes}, N = {comm.size}, sharded over {s.world_size}; offload: optimizer "
             f"{'on' if s.offload_optimizer else 'off'}, params "
             f"{'on' if s.offload_param else 'off'})",
             f"{'rank':>4} {'Psi':>14} {'padding':>8} {'device MiB':>11} {'formula':>9} "
             f"{'host MiB':>9} {'formula':>9} {'device peak':>12}"]
    mib = 2**20
    for rank, psi, padding, device, host, want_device, want_host, peak in rows:
        lines.append(f"{rank:>4} {psi:>14,} {padding:>8} {device / mib:>11.3f} "
                     f"{want_device / mib:>9.3f} {host / mib:>9.3f} {want_host / mib:>9.3f} "
                     f"{peak / mib:>12.3f}")
    return "\n".join(lines)


def traffic_line(engine, steps: int) -> str:
    """This rank's bytes sent by array collectives per communicator since the engine started
    (ring model, Comm's counters), next to what the next step should send (the strategy's
    declaration, or 1-bit Adam's compressed allreduce after its warm-up)."""
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
    return f"traffic sent by this rank over {count(steps, 'step')}: " + "; ".join(parts)

"""Measured model-state memory and traffic per rank of every partition strategy, next to what
each strategy declares, the ZeRO paper's formulas, and stage 3.

    mpiexec -n 4 python experiments/zero_tables.py --out results/zero_tables_n4

Builds the demo GPT (or --d-model/--n-layer), runs one fp16 training step with each of
stage0..stage3, hybrid and hybrid_zero2 (in shard groups of each --group-sizes that divides
N; default 2) and every registered plugin (an installed entry point, or a file given with
--strategy-module; its "paper formula" is the closest ZeRO stage's, the row says which), and
writes what the MemoryLedger and the Comm counters saw as CSV and Markdown,
plus run.json (config, git revision, environment). Traffic is what one rank sends under the
ring model, per communicator: "world" for stages 0-3, "shard" (inside a group) and "replica"
(across groups) for hybrid sharding.

A second table, lab.md/lab.csv, is the lab table of the CSCS ZeRO lecture for stages 0-3:
ranks, batch size, parameters, device memory at init (after the engine is built) and during
training (the peak of one step: model states, activations and communication buffers, each
counted by the ledger), per rank.
"""
import argparse
import sys

import numpy as np

from results import write_results
from zmpi import backend
from zmpi.cli.report import closest_zero_stage, stage_formula
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import MODEL_STATE, comm_volume_elements, model_state_bytes
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.zero import available_strategies, get_strategy, load_strategy_file

MIB = 2**20


def plugins() -> list[str]:
    """The registered strategies that zmpi does not ship: installed entry points of
    "zmpi.strategies" and those of the files given with --strategy-module."""
    return [name for name in available_strategies()
            if not get_strategy(name).__module__.startswith("zmpi.")]


def cases(world_size, group_sizes):
    """(label, zero_optimization) of every strategy measured: the stages, hybrid sharding in
    groups of each of `group_sizes` that divides the ranks, and every plugin with each of its
    `suite_configs` (the settings the shared test suite runs it with)."""
    out = [(f"stage{s}", {"stage": s}) for s in range(4)]
    for name in ("hybrid", "hybrid_zero2"):
        out += [(f"{name} G={g}", {"strategy": name, "shard_group_size": g})
                for g in group_sizes if world_size % g == 0]
    for name in plugins():
        out += [(name + "".join(f" {k}={v}" for k, v in extra.items()),
                 {"strategy": name, **extra})
                for extra in get_strategy(name).suite_configs(world_size)]
    return out


def measure(comm, model_cfg, label, zero, micro_batch):
    engine = Engine(GPT(model_cfg, seed=0), {
        "train_micro_batch_size_per_gpu": micro_batch, "fp16": {"enabled": True},
        "zero_optimization": zero}, comm)
    data = SyntheticSource(model_cfg.vocab_size, model_cfg.seq_len, micro_batch * comm.size,
                           comm.rank, comm.size)
    init_bytes = engine.memory.current(device="device")
    engine.memory.reset_peaks()
    engine.train_step(*data.sample(0))
    psi = engine.layout.full_numel
    sent = engine.sent_bytes()
    declared_memory = engine.strategy.expected_model_state()
    row = {
        "strategy": label, "psi": engine.num_params, "padding": engine.layout.padding,
        "measured_MiB": engine.memory.model_state_bytes() / MIB,
        "declared_MiB": sum(sum(d.values()) for d in declared_memory.values()) / MIB,
        "peak_MiB": engine.memory.peak(MODEL_STATE) / MIB,
        "sent_MiB": sum(sent.values()) / MIB,
        "declared_sent_MiB": sum(engine.strategy.expected_traffic().values()) / MIB,
        "shard_group_MiB": sent.get("world", sent.get("shard", 0)) / MIB,
        "replica_group_MiB": sent.get("replica", 0) / MIB,
        "sent": sent,
        "global_batch": micro_batch * comm.size,
        "init_MiB": init_bytes / MIB,
        "training_peak_MiB": engine.memory.peak(device="device") / MIB,
        "activation_peak_MiB": engine.memory.peak("activation", "device") / MIB,
        "comm_buffer_peak_MiB": engine.memory.peak("comm_buffer", "device") / MIB,
        # on a GPU, CuPy's pool after the step: live arrays, and what it holds (its cached
        # blocks keep the step's peak); zeros on a CPU
        **{f"pool_{k}_MiB": v / MIB for k, v in engine.memory.device_pool_bytes().items()},
    }
    if label.startswith("stage"):
        stage = int(label[-1])
        row["formula_MiB"] = model_state_bytes(psi, comm.size, stage, 2, 2, 12) / MIB
        row["formula_sent_MiB"] = 2 * comm_volume_elements(psi, comm.size, stage) / MIB
    elif "stage" not in zero and not label.startswith("hybrid"):  # a plugin: its closest stage's
        formula = stage_formula(engine.strategy)
        row["closest_stage"] = closest_zero_stage(engine.strategy)
        row["strategy"] = f"{label} (vs ZeRO-{row['closest_stage']})"
        if formula is not None:
            row["formula_MiB"] = sum(formula.values()) / MIB
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--strategy-module", action="append", default=[], metavar="FILE.py",
                        help="a strategy file whose registered strategies get rows too "
                        "(repeatable; installed entry points get theirs without it)")
    args = parser.parse_args()
    for path in args.strategy_module:
        try:
            load_strategy_file(path)
        except ValueError as e:
            parser.error(str(e))
    comm = Comm()
    model_cfg = GPTConfig(65, 64, args.n_layer, 4, args.d_model)
    rows = [measure(comm, model_cfg, label, zero, args.micro_batch)
            for label, zero in cases(comm.size, args.group_sizes)]
    if comm.rank != 0:
        return
    stage3 = next(r for r in rows if r["strategy"] == "stage3")
    header = (f"GPT {rows[0]['psi']:,} params (+{rows[0]['padding']} padding at N = "
              f"{comm.size}), fp16 + Adam (K = 12), N = {comm.size}; per rank, one step")
    md = [header, "", "| strategy | model states MiB (measured) | declared | paper formula | "
          "vs stage 3 | sent MiB (measured) | declared | paper formula | in shard group | "
          "in replica group | vs stage 3 |", "|---" * 11 + "|"]
    for r in rows:
        md.append(f"| {r['strategy']} | {r['measured_MiB']:.3f} | {r['declared_MiB']:.3f} | "
                  f"{r.get('formula_MiB', float('nan')):.3f} | "
                  f"{r['measured_MiB'] / stage3['measured_MiB']:.2f}x | {r['sent_MiB']:.3f} | "
                  f"{r['declared_sent_MiB']:.3f} | {r.get('formula_sent_MiB', float('nan')):.3f}"
                  f" | {r['shard_group_MiB']:.3f} | {r['replica_group_MiB']:.3f} | "
                  + (f"{r['sent_MiB'] / stage3['sent_MiB']:.2f}x |" if stage3["sent_MiB"]
                     else "- |"))
    print("\n".join(md).replace("| nan |", "| - |"))
    lab = [f"The lab table: GPT {rows[0]['psi']:,} params, fp16 + Adam, micro-batch "
           f"{args.micro_batch} x seq {model_cfg.seq_len} per rank; device memory per rank "
           "(MiB) counted by the ledger", "",
           "| ZeRO stage | ranks | batch size | parameters | memory at init | memory during "
           "training (peak) | of which activations | of which comm buffers |"
           + (" CuPy pool used | CuPy pool held |" if backend.is_gpu else ""),
           "|---" * (10 if backend.is_gpu else 8) + "|"]
    for r in rows[:4]:
        lab.append(f"| {r['strategy'][-1]} | {comm.size} | {r['global_batch']} | {r['psi']:,} | "
                   f"{r['init_MiB']:.2f} | {r['training_peak_MiB']:.2f} | "
                   f"{r['activation_peak_MiB']:.2f} | {r['comm_buffer_peak_MiB']:.2f} |"
                   + (f" {r['pool_used_MiB']:.2f} | {r['pool_held_MiB']:.2f} |"
                      if backend.is_gpu else ""))
    print("\n" + "\n".join(lab))
    if args.out:
        write_results(args.out, rows[:4], lab, comm, name="lab", argv=sys.argv,
                      model=vars(model_cfg))
        write_results(args.out, rows, [m.replace("| nan |", "| - |") for m in md], comm,
                      argv=sys.argv, model=vars(model_cfg))


if __name__ == "__main__":
    np.seterr(over="ignore")
    main()

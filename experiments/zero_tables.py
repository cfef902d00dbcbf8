"""Measured model-state memory and traffic per rank for ZeRO stages 0-3, next to the formulas.

    mpiexec -n 4 python experiments/zero_tables.py --out results/zero_tables_n4

Builds the demo GPT (or --d-model/--n-layer), runs one fp16 training step per stage, and
writes what the MemoryLedger and Comm counted next to the SC'20 formulas (Fig. 1 memory,
Sec. 7 traffic) as CSV and Markdown, plus run.json (config, git revision, environment).
"""
import argparse
import sys

import numpy as np

from results import write_results
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import MODEL_STATE, comm_volume_elements, model_state_bytes
from zmpi.models.gpt import GPT, GPTConfig

MIB = 2**20


def measure(comm, model_cfg, stage, micro_batch):
    engine = Engine(GPT(model_cfg, seed=0), {
        "train_micro_batch_size_per_gpu": micro_batch, "fp16": {"enabled": True},
        "zero_optimization": {"stage": stage}}, comm)
    data = SyntheticSource(model_cfg.vocab_size, model_cfg.seq_len, micro_batch * comm.size,
                           comm.rank, comm.size)
    engine.memory.reset_peaks()
    engine.train_step(*data.sample(0))
    c = engine.comm.counters
    psi = engine.layout.full_numel
    sent = c["allreduce"].sent + c["reduce_scatter"].sent + c["allgather"].sent
    tied = engine.layout.units[0].padded_numel  # GPT's LM head re-gathers the embedding
    return {
        "stage": stage, "psi": engine.num_params, "padding": engine.layout.padding,
        "measured_MiB": engine.memory.model_state_bytes() / MIB,
        "formula_MiB": model_state_bytes(psi, comm.size, stage, 2, 2, 12) / MIB,
        "peak_MiB": engine.memory.peak(MODEL_STATE) / MIB,
        "sent_MiB": sent / MIB,
        "formula_sent_MiB": 2 * comm_volume_elements(psi, comm.size, stage) / MIB,
        "tied_extra_MiB": (2 * 2 * tied * (comm.size - 1) / comm.size / MIB) if stage == 3 else 0.0,
        "calls": {op: c[op].calls for op in ("allreduce", "reduce_scatter", "allgather")},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    comm = Comm()
    model_cfg = GPTConfig(65, 64, args.n_layer, 4, args.d_model)
    rows = [measure(comm, model_cfg, stage, args.micro_batch) for stage in range(4)]
    if comm.rank != 0:
        return
    header = (f"GPT {rows[0]['psi']:,} params (+{rows[0]['padding']} padding), fp16 + Adam "
              f"(K = 12), N = {comm.size}; per rank, one step")
    md = [header, "", "| stage | model states MiB (measured) | formula | peak | sent MiB "
          "(measured) | formula | of which tied-weight re-gather |", "|---" * 7 + "|"]
    for r in rows:
        md.append(f"| {r['stage']} | {r['measured_MiB']:.3f} | {r['formula_MiB']:.3f} | "
                  f"{r['peak_MiB']:.3f} | {r['sent_MiB']:.3f} | {r['formula_sent_MiB']:.3f} | "
                  f"{r['tied_extra_MiB']:.3f} |")
    print("\n".join(md))
    if args.out:
        write_results(args.out, rows, md, comm, argv=sys.argv, model=vars(model_cfg))

if __name__ == "__main__":
    np.seterr(over="ignore")
    main()

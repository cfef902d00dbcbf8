"""The largest GPT that trains one step under a per-rank device-memory budget, per ZeRO stage,
with and without offload: ZeRO-Offload's headline (13 B parameters on one 32 GB V100, about
10x what data parallelism fits), scaled down to this machine.

    mpiexec -n 2 python experiments/largest_model.py --budget-mib 64 --out results/largest_n2

The family: GPTs of --d-model (default 256, one head per 64) with any number of layers,
vocabulary 256, context 64. For each setting a binary search over the layers finds the
largest model whose
engine builds and trains one step with every device buffer the MemoryLedger counts (model
states, gathered units, communication buffers, activations) within the budget
(`memory_budget.device`). Beside it: the largest Psi the model-state formula predicts
(zmpi.memory.model_state_placement: the budget over device bytes per parameter).
"""
import argparse
import sys

import numpy as np

from results import write_results
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import OutOfMemory, model_state_placement
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_num_params

SETTINGS = [  # (label, stage, offload_optimizer, offload_param)
    ("stage 0 (DP)", 0, False, False), ("stage 1", 1, False, False),
    ("stage 2", 2, False, False), ("stage 3", 3, False, False),
    ("stage 2 + offload", 2, True, False), ("stage 3 + offload", 3, True, False),
    ("stage 3 + offload + params", 3, True, True),
]


def trains(comm, n_layer, d_model, stage, offload_opt, offload_param, budget):
    """Whether the GPT builds and trains one step within `budget` device bytes per rank.
    Data parallel only, its shards padded equal: every rank meets the budget at the same
    allocation and raises OutOfMemory with the others, none left waiting in a collective."""
    cfg = GPTConfig(256, 64, n_layer, d_model // 64, d_model)
    zero = {"stage": stage}
    if offload_opt:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    engine = None
    try:
        engine = Engine(GPT(cfg, seed=0), {
            "train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
            "zero_optimization": zero, "memory_budget": {"device": budget}}, comm)
        data = SyntheticSource(256, 64, comm.size, comm.rank, comm.size)
        engine.train_step(*data.sample(0))
        return True
    except OutOfMemory:
        return False
    finally:  # on every rank alike: frees its communicators, which a long search would run out of
        if engine is not None:
            engine.close()


def largest(comm, args, stage, offload_opt, offload_param, budget):
    """The most layers that fit (0: not even one; --max-layers: the search's ceiling)."""
    lo, hi = 0, args.max_layers
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if trains(comm, mid, args.d_model, stage, offload_opt, offload_param, budget):
            lo = mid
        else:
            hi = mid - 1
    return lo


def ratio(params, base) -> str:
    return f"{params / base:.1f}x" if base else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-mib", type=float, default=64.0)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--max-layers", type=int, default=128)
    args = parser.parse_args()
    comm = Comm()
    budget = int(args.budget_mib * 2**20)
    rows = []
    for label, stage, offload_opt, offload_param in SETTINGS:
        layers = largest(comm, args, stage, offload_opt, offload_param, budget)
        psi = gpt_num_params(layers, args.d_model, 256, 64) if layers else 0
        place = model_state_placement(1, comm.size, stage, 2, 2, 4, 4, offload_opt,
                                      offload_param)
        per_param = sum(place["device"].values())
        rows.append({"setting": label, "layers": layers, "params": psi,
                     "at_ceiling": layers == args.max_layers,
                     "formula_params": budget / per_param if per_param else float("inf")})
        if comm.rank == 0:
            print(f"{label}: {layers} layers, {psi:,} params", flush=True)
    if comm.rank != 0:
        return
    base = rows[0]["params"]
    md = [f"Largest GPT (d_model {args.d_model}, any number of layers, vocab 256, context 64, "
          f"fp16 + Adam) that trains one step within {args.budget_mib:g} MiB of device memory "
          f"per rank (the ledger's count: model states, gathered units, communication buffers, "
          f"activations), N = {comm.size}",
          "", "| setting | layers | parameters | vs stage 0 | model-state formula's limit |",
          "|---|---|---|---|---|"]
    for r in rows:
        limit = ("no device model state" if r["formula_params"] == float("inf")
                 else f"{r['formula_params']:,.0f}")
        md.append(f"| {r['setting']} | {r['layers']}{'+' if r['at_ceiling'] else ''} | "
                  f"{r['params']:,}{'+' if r['at_ceiling'] else ''} | "
                  f"{ratio(r['params'], base)} | {limit} |")
    md += ["", "ZeRO-Offload (ATC'21) trains 13 B parameters on one 32 GB V100 where data "
           "parallelism fits about 1.4 B: about 10x. '+': the search's ceiling "
           f"(--max-layers {args.max_layers}), not a limit."]
    print("\n".join(md))
    if args.out:
        write_results(args.out, rows, md, comm, argv=sys.argv)


if __name__ == "__main__":
    np.seterr(over="ignore")
    main()

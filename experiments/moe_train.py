"""Mixture of experts trained on Tiny Shakespeare: a small MoE GPT against a dense GPT of equal
active parameters, the experts' load and dropped tokens over training with and without the
load-balancing loss, and the step time and traffic against the expert-parallel degree.

    mpiexec -n N python experiments/moe_train.py --scaling --out results/moe_train  # N 2, 4, 8
    python experiments/moe_train.py --out results/moe_train                         # then this
    make bench-moe                                                                  # all four

Loss (one rank): three GPTs of the same shape, seed, batches, optimizer and steps, trained
step by step in turn (so that machine noise falls on all alike): dense, and an MoE GPT (every
--moe-interval-th block a Switch layer of --experts experts, top---k) with the load-balancing
loss at --aux-coef and without it. Every MoE expert is the dense GPT's MLP, so a token meets
as many parameters in both (the gate's d x E aside): equal active parameters. Reported: the
training cross-entropy (mean of the last --window steps; train_step's loss less the
auxiliary loss it includes) and the validation loss at equal tokens (the end), and each run's
training cross-entropy at equal wall time (at the step where its own cumulative
step time reaches the fastest run's total).

Load and drops (the same MoE runs): per MoE layer and step, the assignments routed to each
expert before drops and those over capacity (engine.moe.statistics, what `zmpi train` writes
to metrics.csv), summarised at 10 %, 50 % and 100 % of the steps as max / mean expert load
and the dropped fraction, and drawn over the whole run (load.png).

Scaling (--scaling, under mpiexec -n N): the MoE GPT at ep = 1, 2, 4, 8 where ep divides N and
the expert count, data parallel over N ranks with a fixed micro-batch per rank, ZeRO stage 0:
the median step time and the bytes each rank sends per step on ep (the all-to-alls), edp
(the expert gradients) and dp (the dense gradients), counted by Comm
(engine.traffic_by_dimension) beside the all-to-all formula (zmpi.models.moe_counts.moe_alltoall,
docs/moe.md: 4 all-to-alls per MoE layer of E x G x capacity x d_model elements, (ep - 1) / ep
of them sent) and the strategy's
declared gradient traffic (engine.expected_traffic). Written to OUT/scaling_n<N>.json, which
the one-rank run then tabulates.

Timings are this machine's (2 shared CPU cores, oversubscribed at 4 and 8 ranks, under the
load of other jobs): they compare the runs side by side, not hardware.
"""
import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from interleaved import add_arguments, shakespeare, train_interleaved

from results import write_losses, write_results
from zmpi.comm import Comm
from zmpi.data import BatchSampler
from zmpi.engine import Engine
from zmpi.memory import ARRAY_OPS
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_expert_numel, gpt_num_params
from zmpi.models.moe_counts import moe_alltoall
from zmpi.parallel.mesh import Mesh
from zmpi.runinfo import run_metadata

MIB = 2**20
FP32 = 4  # bytes an element: the runs' parameters and activations
MARKS = (0.1, 0.5, 1.0)  # the fractions of the run the load table reports


def moe_section(args, aux_coef: float, ep: int = 1) -> dict:
    return {"num_experts": args.experts, "k": args.k, "moe_layer_interval": args.moe_interval,
            "capacity_factor": args.capacity_factor, "aux_loss_coef": aux_coef, "ep_size": ep}


def engine_for(args, vocab: int, moe: dict | None, comm, micro_batch: int) -> Engine:
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
              "zero_optimization": {"stage": 0}}
    if moe is not None:
        config["moe"] = moe
    ep = 1 if moe is None else moe["ep_size"]
    model = GPT(GPTConfig(vocab, args.seq_len, args.n_layer, args.n_head, args.d_model),
                seed=args.seed, moe=moe)
    return Engine(model, config, comm, mesh=Mesh(comm, ep=ep))


def parameters(args, vocab: int, moe: dict | None) -> tuple[int, int]:
    """(total, active per token): a token meets k of each MoE layer's E experts."""
    total = gpt_num_params(args.n_layer, args.d_model, vocab, args.seq_len, moe=moe)
    if moe is None:
        return total, total
    experts = gpt_expert_numel(args.n_layer, args.d_model, moe)
    return total, total - experts + experts * args.k // args.experts


# ---- the loss, and the experts' load over training (one rank) ---------------------------------
def train_runs(args, comm) -> list[dict]:
    tok, train, val = shakespeare()
    runs = {"dense": None, f"MoE aux {args.aux_coef:g}": moe_section(args, args.aux_coef),
            "MoE no aux": moe_section(args, 0.0)}
    engines = {name: engine_for(args, tok.vocab_size, moe, comm, args.batch)
               for name, moe in runs.items()}
    rows = {name: {"run": name, "losses": [], "aux": [], "step_s": [], "load": [],
                   "dropped": []} for name in runs}

    def observe(name, engine, loss):
        aux = float(engine.moe.losses())  # the MoE layers' aux and z losses (0: dense)
        rows[name]["aux"].append(aux)
        stats = engine.moe.statistics(comm)  # [] for the dense run
        rows[name]["load"].append([load.tolist() for load, _ in stats])
        rows[name]["dropped"].append([dropped for _, dropped in stats])
        return loss - aux  # one micro-batch, one rank: exact

    def describe(name):
        total, active = parameters(args, tok.vocab_size, runs[name])
        return {"total_params": total, "active_params": active}

    train_interleaved(args, engines, rows, train, val, observe, describe)
    for r in rows.values():
        r["seconds"] = float(sum(r["step_s"]))
    budget = min(r["seconds"] for r in rows.values())  # the fastest run's whole time
    for r in rows.values():
        r["steps_in_budget"] = int(np.searchsorted(np.cumsum(r["step_s"]), budget,
                                                   side="right")) or 1
        last = r["steps_in_budget"]
        r["loss_at_equal_time"] = float(np.mean(r["losses"][max(0, last - args.window):last]))
    return list(rows.values())


def balance(args, rows) -> list[dict]:
    """Per MoE run, layer and mark (the step at each of MARKS' fractions of the run): max /
    mean expert load and the dropped fraction of the k x tokens assignments, each the mean
    over the --window steps that end at the mark (a single step's batch is noisy)."""
    assignments = args.k * args.batch * args.seq_len
    out = []
    for r in rows:
        if r["run"] == "dense":
            continue
        load = np.asarray(r["load"], dtype=float)  # (steps, layers, E)
        ratio = load.max(axis=2) / load.mean(axis=2)  # (steps, layers)
        dropped = np.asarray(r["dropped"], dtype=float) / assignments
        for mark in MARKS:
            step = mark_step(args, mark)
            window = slice(max(0, step + 1 - args.window), step + 1)
            for layer in range(load.shape[1]):
                out.append({"run": r["run"], "layer": layer, "step": step,
                            "max_over_mean": float(ratio[window, layer].mean()),
                            "dropped_fraction": float(dropped[window, layer].mean())})
    return out


def mark_step(args, mark: float) -> int:
    """The (0-based) step at the fraction `mark` of the run."""
    return max(1, math.ceil(mark * args.steps)) - 1


def load_figure(args, rows, path: Path) -> None:
    """load.png, a column per MoE run: the last MoE layer's share of the assignments per
    expert over the steps (top), every layer's max / mean load (middle) and dropped
    fraction (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moe = [r for r in rows if r["run"] != "dense"]
    fig, axes = plt.subplots(3, len(moe), figsize=(4.2 * len(moe), 7.2), sharex=True,
                             squeeze=False, layout="constrained")
    assignments = args.k * args.batch * args.seq_len
    for col, r in enumerate(moe):
        load = np.asarray(r["load"], dtype=float)  # (steps, layers, E)
        share = load[:, -1, :] / load[:, -1, :].sum(axis=1, keepdims=True)
        image = axes[0, col].imshow(share.T, aspect="auto", interpolation="nearest",
                                    cmap="viridis", vmin=0, vmax=1)
        axes[0, col].set(title=f"{r['run']}: layer {load.shape[1] - 1} load share",
                         ylabel="expert")
        dropped = np.asarray(r["dropped"], dtype=float) / assignments
        for layer in range(load.shape[1]):
            axes[1, col].plot(load[:, layer].max(axis=1) / load[:, layer].mean(axis=1),
                              color=f"C{layer}", label=f"MoE layer {layer}")
            axes[2, col].plot(dropped[:, layer], color=f"C{layer}", label=f"MoE layer {layer}")
        axes[1, col].set(ylabel="max / mean load", ylim=(0, args.experts))
        axes[2, col].set(ylabel="dropped fraction", ylim=(0, 1), xlabel="step")
        for ax in axes[1:, col]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.colorbar(image, ax=axes[0, :].tolist(), shrink=0.8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- step time and traffic against ep (mpiexec -n N --scaling) --------------------------------
def sent(counts: dict) -> int:
    return sum(c["sent"] for op, c in counts.items() if op in ARRAY_OPS)


def scaling(args, comm) -> list[dict]:
    tok, tokens, _ = shakespeare()
    rows = []
    for ep in (1, 2, 4, 8):
        if comm.size % ep or args.experts % ep:
            continue
        engine = engine_for(args, tok.vocab_size, moe_section(args, args.aux_coef, ep), comm,
                            args.micro_batch)
        data = BatchSampler(tokens, args.seq_len, args.micro_batch * comm.size,
                            engine.mesh.dp_rank, comm.size, seed=args.seed)
        engine.train_step(*data.sample(0))  # warm-up: first touch of every buffer
        engine.reset_counters()
        times = []
        for step in range(1, args.scaling_steps + 1):
            comm.barrier()
            t0 = time.perf_counter()
            engine.train_step(*data.sample(step))
            times.append(comm.allreduce_scalar(time.perf_counter() - t0, "max"))
        by_dim = engine.traffic_by_dimension()
        declared = engine.expected_traffic()
        formula = moe_alltoall(args.n_layer, args.d_model, args.seq_len, args.micro_batch,
                               moe_section(args, args.aux_coef, ep))  # per step: one micro-batch
        per_step = {dim: sent(by_dim.get(dim, {})) / args.scaling_steps
                    for dim in ("ep", "edp", "dp")}
        a2a = by_dim.get("ep", {}).get("alltoall", {"bytes": 0, "calls": 0})
        rows.append({"ranks": comm.size, "ep": ep, "edp": comm.size // ep,
                     "step_ms": 1e3 * statistics.median(times),
                     "ep_sent_mib": per_step["ep"] / MIB,
                     "ep_alltoall_bytes": a2a["bytes"] / args.scaling_steps,
                     "ep_alltoall_calls": a2a["calls"] / args.scaling_steps,
                     "ep_formula_calls": formula["calls"],
                     "ep_formula_bytes": formula["elements"] * FP32,
                     "ep_formula_sent_mib": formula["sent_elements"] * FP32 / MIB,
                     "edp_sent_mib": per_step["edp"] / MIB,
                     "edp_declared_mib": declared.get("experts", 0) / MIB,
                     "dp_sent_mib": per_step["dp"] / MIB,
                     "dp_declared_mib": declared["world"] / MIB})
        engine.close()
        if comm.rank == 0:
            r = rows[-1]
            print(f"{comm.size} ranks, ep {ep}: {r['step_ms']:.0f} ms, ep {r['ep_sent_mib']:.3f}"
                  f" MiB (formula {r['ep_formula_sent_mib']:.3f}), edp {r['edp_sent_mib']:.3f},"
                  f" dp {r['dp_sent_mib']:.3f} MiB/step", flush=True)
    return rows


# ---- tables -----------------------------------------------------------------------------------
def tables(args, rows, marks, scaled) -> list[str]:
    md = [f"GPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, T "
          f"{args.seq_len}, batch {args.batch}, AdamW lr {args.lr}, {args.steps} steps on Tiny "
          f"Shakespeare (characters), the same seed and batches; MoE: {args.experts} experts, "
          f"top-{args.k}, capacity factor {args.capacity_factor:g}, in blocks "
          f"{list(range(args.moe_interval - 1, args.n_layer, args.moe_interval))}. Training "
          f"loss: the cross-entropy (the MoE runs' auxiliary loss left out), mean of "
          f"{args.window} steps; "
          f"validation: {args.val_batches} held-out batches; equal time: each run's loss at "
          "the step where its cumulative step time reaches the fastest run's total (one rank, "
          "the runs' steps interleaved, on this 2-core machine: machine-relative).", "",
          "| run | parameters (active) | step ms | training loss | validation loss | "
          "loss at equal time (steps) |", "|---|---|---|---|---|---|"]
    md += [f"| {r['run']} | {r['total_params']:,} ({r['active_params']:,}) | "
           f"{r['step_ms']:.1f} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | "
           f"{r['loss_at_equal_time']:.4f} ({r['steps_in_budget']}) |" for r in rows]
    md += ["", "Expert load and dropped tokens per MoE layer (engine.moe.statistics, summed "
           "over the step's batch): max / mean of the assignments each expert received "
           "before drops (1.00: even), and the share of the k x tokens assignments over "
           f"capacity, each the mean of the {args.window} steps up to the step named.", "",
           "| run | MoE layer | " + " | ".join(
               f"step {mark_step(args, m) + 1}: max/mean, dropped" for m in MARKS)
           + " |", "|---|---|" + "---|" * len(MARKS)]
    keyed = {(m["run"], m["layer"], m["step"]): m for m in marks}
    for run, layer in dict.fromkeys((m["run"], m["layer"]) for m in marks):
        cells = []
        for mark in MARKS:
            m = keyed[(run, layer, mark_step(args, mark))]
            cells.append(f"{m['max_over_mean']:.2f}, {m['dropped_fraction']:.1%}")
        md.append(f"| {run} | {layer} | " + " | ".join(cells) + " |")
    if scaled:
        md += ["", f"Step time and bytes each rank sends per step against ep (micro-batch "
               f"{args.micro_batch} per rank, ZeRO stage 0, median of {args.scaling_steps} "
               "steps after a warm-up; 4 and 8 ranks oversubscribe the 2 cores): counted by "
               "Comm, in brackets the all-to-all formula (moe_alltoall, docs/moe.md) and the "
               "strategies' declared gradient traffic.", "",
               "| ranks | ep x edp | step ms | ep MiB (formula) | edp MiB (declared) | "
               "dp MiB (declared) |", "|---|---|---|---|---|---|"]
        md += [f"| {s['ranks']} | {s['ep']} x {s['edp']} | {s['step_ms']:.0f} | "
               f"{s['ep_sent_mib']:.3f} ({s['ep_formula_sent_mib']:.3f}) | "
               f"{s['edp_sent_mib']:.3f} ({s['edp_declared_mib']:.3f}) | "
               f"{s['dp_sent_mib']:.3f} ({s['dp_declared_mib']:.3f}) |" for s in scaled]
    return md


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--moe-interval", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--aux-coef", type=float, default=0.01)
    parser.add_argument("--scaling", action="store_true",
                        help="measure step time and traffic against ep on this mpiexec's ranks")
    parser.add_argument("--micro-batch", type=int, default=4, help="per rank, of --scaling")
    parser.add_argument("--scaling-steps", type=int, default=5)
    parser.add_argument("--out", default="results/moe_train")
    args = parser.parse_args()
    comm = Comm()
    out = Path(args.out)
    if args.scaling:
        rows = scaling(args, comm)
        meta = run_metadata(comm, argv=sys.argv, args=vars(args), rows=rows)
        if comm.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"scaling_n{comm.size}.json").write_text(json.dumps(meta, indent=2,
                                                                       default=str))
        return
    if comm.size != 1:
        sys.exit("moe_train.py runs its loss runs on one rank (--scaling under mpiexec)")
    rows = train_runs(args, comm)
    marks = balance(args, rows)
    scaled = [json.loads(p.read_text()) for p in sorted(
        out.glob("scaling_n*.json"), key=lambda p: int(p.stem.rsplit("_n", 1)[1]))]
    md = tables(args, rows, marks, [s for meta in scaled for s in meta["rows"]])
    summary = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
    write_results(out, summary, md, comm, argv=sys.argv, args=vars(args), balance=marks,
                  runs=rows, scaling=scaled)
    write_losses(out, rows, "run")
    load_figure(args, rows, out / "load.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()

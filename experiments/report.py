"""Collect the experiments' results into experiments/RESULTS.md, with plots.

    python experiments/report.py                  # after the experiments (make reproduce)
    python experiments/report.py --results results --out experiments/RESULTS.md

Reads the CSV and run.json files the experiment scripts wrote under --results (one folder per
experiment and world size, e.g. results/zero_tables_n4), draws the figures into
<results>/figures/ (matplotlib, from the `bench` extra), and writes RESULTS.md: each table
beside the papers' numbers, the figures, the command that made it and how to run it at full
scale. It measures nothing itself; a result folder that is missing is reported as such, never
filled in.
"""
import argparse
import csv
import json
import os
from pathlib import Path

from zmpi.memory import model_state_bytes
from zmpi.models.gpt import gpt_num_params

STAGES = (0, 1, 2, 3)
# ZeRO (Rajbhandari et al., SC'20), Fig. 1: model states per device, Psi = 7.5 B, N = 64,
# K = 12 (mixed-precision Adam), in GB (1e9 bytes)
PAPER_FIG1_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
PAPER_PSI, PAPER_N = 7.5e9, 64


def read_rows(folder: Path, name: str = "table") -> list[dict] | None:
    path = folder / f"{name}.csv"
    if not path.exists():
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def world_sizes(results: Path, prefix: str) -> list[int]:
    """World sizes N with a results/<prefix>_n<N> folder, ascending."""
    return sorted(int(p.name.rsplit("_n", 1)[1]) for p in results.glob(f"{prefix}_n*")
                  if p.name.rsplit("_n", 1)[1].isdigit())


def revision(folder: Path) -> str:
    try:
        meta = json.loads((folder / "run.json").read_text())
    except FileNotFoundError:
        return "?"
    return f"{meta.get('git_revision', '?')[:10]}, {meta.get('time', '?')[:10]}"


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def figure(path: Path, title: str, xlabel: str, ylabel: str, series, logx=False,
           xticks=None) -> None:
    """series: [(label, xs, ys, style, color)], style 'line', 'points' or 'bar', color an
    index into matplotlib's cycle (a formula and its measured points share one). xticks:
    [(x, label)] to name the ticks (then no legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, xs, ys, style, color in series:
        if style == "bar":
            ax.bar(xs, ys, color=f"C{color}", label=label)
        else:
            ax.plot(xs, ys, "-" if style == "line" else "o", color=f"C{color}", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if xticks:
        ax.set_xticks([x for x, _ in xticks], [t for _, t in xticks], rotation=20,
                      ha="right", fontsize=8)
    else:
        ax.legend(fontsize=8)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Report:
    def __init__(self, results: Path, out: Path):
        self.results, self.out = results, out
        self.figures = results / "figures"
        self.lines: list[str] = []
        self.used: set[Path] = set()  # result folders read: their revisions go in the header

    def rows(self, folder: Path, name: str = "table") -> list[dict] | None:
        rows = read_rows(folder, name)
        if rows is not None:
            self.used.add(folder)
        return rows

    def first_run(self, name: str) -> Path | None:
        """results/<name>_n<N> of the smallest N measured (as sorted), or None."""
        return next(iter(sorted(self.results.glob(f"{name}_n*"))), None)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def image(self, name: str, alt: str) -> None:
        rel = os.path.relpath(self.figures / name, self.out.parent)
        self.add("", f"![{alt}]({rel})", "")

    def missing(self, what: str, command: str) -> None:
        self.add("", f"*Not measured yet: {what}. Run `{command}`.*", "")

    def zero_tables(self, ns) -> dict[int, dict[str, dict]]:
        """{N: {strategy: row}} of results/zero_tables_n<N>/table.csv."""
        return {n: {r["strategy"]: r for r in self.rows(self.results / f"zero_tables_n{n}")}
                for n in ns}

    # ---- 1. memory per device
    def memory(self) -> None:
        self.add("## 1. Model-state memory per device (ZeRO, Fig. 1)", "",
                 f"The paper's example: Psi = 7.5 B parameters on N = {PAPER_N} devices, "
                 "mixed-precision Adam (K = 12), model states per device in GB. zmpi's "
                 "estimator (`zmpi estimate`) gives:", "")
        rows = [[s, PAPER_FIG1_GB[s],
                 f"{model_state_bytes(PAPER_PSI, PAPER_N, s, 2, 2, 12) / 1e9:.1f}"]
                for s in STAGES]
        self.add(*table(["stage", "paper (GB)", "zmpi estimate (GB)"], rows), "")
        ns = world_sizes(self.results, "zero_tables")
        if not ns:
            return self.missing("measured model states", "make reproduce")
        measured = self.zero_tables(ns)
        psi = int(measured[ns[0]]["stage0"]["psi"])
        self.add(f"Measured here: the demo GPT ({psi:,} parameters, fp16 + Adam), one training "
                 "step, model-state bytes per rank as the memory ledger counted them, beside "
                 "the formula (MiB):", "")
        rows = []
        for n in ns:
            row = [n]
            for s in STAGES:
                r = measured[n][f"stage{s}"]
                same = "=" if abs(float(r["measured_MiB"]) - float(r["formula_MiB"])) < 1e-9 \
                    else "!="
                row.append(f"{float(r['measured_MiB']):.3f} {same} {float(r['formula_MiB']):.3f}")
            rows.append(row)
        self.add(*table(["N"] + [f"stage {s}: measured vs formula" for s in STAGES], rows))
        xs = list(range(1, max(ns + [8]) + 1))
        series = [(f"stage {s} formula", xs,
                   [model_state_bytes(psi, n, s, 2, 2, 12) / 2**20 for n in xs], "line", s)
                  for s in STAGES]
        series += [(f"stage {s} measured", ns,
                    [float(measured[n][f"stage{s}"]["measured_MiB"]) for n in ns], "points", s)
                   for s in STAGES]
        figure(self.figures / "memory_per_device.png",
               f"Model states per rank, GPT {psi:,} params, fp16 + Adam", "ranks N",
               "MiB per rank", series)
        self.image("memory_per_device.png", "model-state memory per rank against N")
        self.add("Made by `make reproduce` (`mpiexec -n N python experiments/zero_tables.py "
                 "--out results/zero_tables_nN` for N = 1..4). At full scale: "
                 "`zmpi estimate --params 7.5e9 --world-size 64` for the paper's figure, and "
                 "`mpiexec -n 64 python experiments/zero_tables.py --d-model 4096 --n-layer 36` "
                 "on 64 GPUs for the measured bytes.", "")

    # ---- 2. the lab table
    def lab(self) -> None:
        self.add("## 2. The lab table (CSCS ZeRO lecture)", "")
        ns = world_sizes(self.results, "zero_tables")
        labs = {n: self.rows(self.results / f"zero_tables_n{n}", "lab") for n in ns}
        labs = {n: rows for n, rows in labs.items() if rows}
        if not labs:
            return self.missing("the lab table", "make reproduce")
        rows = [[r["strategy"][-1], n, r["global_batch"], f"{int(r['psi']):,}",
                 f"{float(r['init_MiB']):.2f}", f"{float(r['training_peak_MiB']):.2f}",
                 f"{float(r['activation_peak_MiB']):.2f}",
                 f"{float(r['comm_buffer_peak_MiB']):.2f}"]
                for s in STAGES for n, lab in labs.items() for r in lab
                if r["strategy"] == f"stage{s}"]
        self.add("Device memory per rank in MiB, counted by the ledger (every buffer zmpi "
                 "allocates, the layers' cached activations included). On a GPU the CuPy pool's "
                 "`used`/`held` bytes would stand beside it: not measured, no GPU was lent "
                 "(run `make reproduce` on a GPU node with `ZMPI_BACKEND=cupy`).", "")
        self.add(*table(["ZeRO stage", "ranks", "batch size", "parameters", "memory at init",
                         "memory during training (peak)", "of which activations",
                         "of which comm buffers"], rows), "")
        self.add("Activations do not shrink with the stage, model states do: at this size "
                 "the activations of one micro-batch are a large share of the peak. The same "
                 "`experiments/zero_tables.py` writes it (lab.md).", "")

    # ---- 3. communication
    def communication(self) -> None:
        self.add("## 3. Communication volume per step", "",
                 "ZeRO's analysis: stages 0-2 send 2 Psi elements per rank per step "
                 "(reduce-scatter + allgather, (N-1)/N each), stage 3 sends 3 Psi (one more "
                 "allgather of the parameters in backward). Measured by Comm's counters, ring "
                 "model, fp16 (MiB per rank per step):", "")
        ns = [n for n in world_sizes(self.results, "zero_tables") if n > 1]
        if not ns:
            return self.missing("traffic", "make reproduce")
        rows, series = [], []
        measured = self.zero_tables(ns)
        psi = int(measured[ns[0]]["stage0"]["psi"])
        for n in ns:
            rows.append([n] + [f"{float(measured[n][f'stage{s}']['sent_MiB']):.3f} "
                               f"({float(measured[n][f'stage{s}']['formula_sent_MiB']):.3f})"
                               for s in STAGES])
        self.add(*table(["N"] + [f"stage {s} measured (formula)" for s in STAGES], rows), "")
        self.add("Stage 3's measured volume is slightly above 3 Psi (N-1)/N: the tied "
                 "embedding is gathered again for the output head, which reads it. What each "
                 "strategy declares it sends is checked to the byte in `make test`.", "")
        for color, s in enumerate((0, 3)):
            series.append((f"stage {s} measured / Psi", ns,
                           [float(measured[n][f"stage{s}"]["sent_MiB"]) * 2**20 / (2 * psi)
                            for n in ns], "points", color))
        xs = [1 + i / 10 for i in range(71)]
        series = [("2 (N-1)/N (stages 0-2)", xs, [2 * (x - 1) / x for x in xs], "line", 0),
                  ("3 (N-1)/N (stage 3)", xs, [3 * (x - 1) / x for x in xs], "line", 1)
                  ] + series
        figure(self.figures / "comm_volume.png", "Elements sent per rank per step / Psi",
               "ranks N", "sent / Psi", series)
        self.image("comm_volume.png", "communication volume against N")
        bw = self.rows(self.results / "bandwidth_n2")
        if bw:
            self.add("Bus bandwidth of each collective on this MPI (`experiments/bandwidth.py`, "
                     "N = 2, shared memory), which turns those volumes into time:", "")
            ops = sorted({r["op"] for r in bw})
            figure(self.figures / "bandwidth.png", "Bus bandwidth, N = 2 (this machine)",
                   "message bytes", "busbw GB/s",
                   [(op, [int(r["bytes"]) for r in bw if r["op"] == op],
                     [float(r["busbw_GBps"]) for r in bw if r["op"] == op], "line", i)
                    for i, op in enumerate(ops)], logx=True)
            self.image("bandwidth.png", "bus bandwidth against message size")
            sizes = sorted({int(r["bytes"]) for r in bw})
            cell = {(r["op"], int(r["bytes"])): r for r in bw}
            self.add(*table(["op"] + [f"{b:,} B" for b in sizes],
                            [[op] + [f"{float(cell[op, b]['seconds']) * 1e6:,.0f} us, "
                                     f"{float(cell[op, b]['busbw_GBps']):.2f} GB/s"
                                     for b in sizes] for op in ops]), "")
        packing = self.rows(self.results / "bandwidth_n2", "packing")
        if packing:
            self.add("Why large units are never packed into a bucket (`Strategy.solo_numel`, "
                     "16 Ki elements): allgathering a bucket of "
                     f"{packing[0]['units']} units one collective per unit, against packed "
                     "into one with the copies in and out:", "")
            self.add(*table(["elements per unit", "per unit", "packed", "packed / per unit"],
                            [[f"{int(r['unit_numel']):,}", f"{float(r['solo_s']) * 1e6:,.0f} us",
                              f"{float(r['packed_s']) * 1e6:,.0f} us",
                              f"{float(r['packed_over_solo']):.2f}"] for r in packing]), "")
        self.cost_model(bw)
        self.add("Made by `make reproduce` (zero_tables at N = 2, 3, 4; bandwidth at N = 2). "
                 "At full scale: the same scripts under `srun` on the cluster "
                 "(experiments/slurm/).", "")

    def cost_model(self, bw) -> None:
        """The volumes over the measured bus bandwidth, against the time the benchmark's ranks
        were blocked in MPI (overlap off) for the same model at N = 2."""
        bench = self.rows(self.results / "vs_torch_n2")
        if not bw or not bench:
            return
        model = json.loads((self.results / "vs_torch_n2" / "run.json").read_text())["model"]
        psi = gpt_num_params(model["n_layer"], model["d_model"], model["vocab_size"],
                             model["seq_len"])
        largest = max(int(r["bytes"]) for r in bw)
        busbw = {r["op"]: float(r["busbw_GBps"]) * 1e9 for r in bw if int(r["bytes"]) == largest}
        per_pass = 4 * psi / 2  # fp32 bytes one rank sends in one pass, (N-1)/N = 1/2
        passes = {0: {"allreduce": 2}, 1: {"reduce_scatter": 1, "allgather": 1},
                  2: {"reduce_scatter": 1, "allgather": 1},
                  3: {"reduce_scatter": 1, "allgather": 2}}
        rows = []
        for r in bench:
            s = int(r["stage"])
            predicted = sum(k * per_pass / busbw[op] for op, k in passes[s].items())
            rows.append([s, f"{1e3 * predicted:.0f}", f"{1e3 * float(r['comm_s']):.0f}"])
        self.add(f"The cost model checked against this MPI: the benchmark's GPT ({psi:,} "
                 "parameters, fp32, section 5) at N = 2, its per-step volume over the bus "
                 f"bandwidth above at {largest:,} bytes, against the time its critical rank "
                 "(the one busy longest) was blocked in MPI with overlap off (ms per step):", "")
        self.add(*table(["stage", "predicted from bandwidth", "measured blocked"], rows), "")
        self.add("The blocked time also holds the per-step scalar allreduces and, unit by "
                 "unit, the moments the critical rank ran ahead of the other (both ranks "
                 "compute on the same 2 cores), so it stays above the prediction.", "")

    # ---- 4. largest model
    def largest(self) -> None:
        self.add("## 4. Largest trainable model under a memory budget (ZeRO-Offload)", "",
                 "The paper: 13 B parameters on one 32 GB V100, where data parallelism "
                 "(PyTorch) fits about 1.4 B: roughly 10x.", "")
        folder = self.first_run("largest")
        rows = self.rows(folder) if folder else None
        if not rows:
            return self.missing("the largest model", "make reproduce")
        self.add((folder / "table.md").read_text().split("\n\n")[0], "")
        base = int(rows[0]["params"])
        ratio = {r["setting"]: int(r["params"]) / base for r in rows}
        self.add(*table(["setting", "layers", "parameters", "vs stage 0", "paper"],
                        [[r["setting"], r["layers"] + ("+" if r["at_ceiling"] == "True" else ""),
                          f"{int(r['params']):,}", f"{ratio[r['setting']]:.1f}x",
                          "about 10x" if "offload" in r["setting"] else ""] for r in rows]), "")
        figure(self.figures / "largest_model.png", "Largest GPT that trains, same budget",
               "", "x stage 0 (DP)",
               [(r["setting"], [i], [ratio[r["setting"]]], "bar", i) for i, r in enumerate(rows)],
               xticks=list(enumerate(r["setting"] for r in rows)))
        self.image("largest_model.png", "largest model per setting")
        argv = json.loads((folder / "run.json").read_text()).get("argv") or ["?"]
        self.add(f"Made by `mpiexec -n {folder.name.rsplit('_n', 1)[1]} python "
                 f"{' '.join(argv)}`. At full scale on one GPU: `ZMPI_BACKEND=cupy python "
                 "experiments/largest_model.py --budget-mib 32000 --d-model 4096` (the paper's "
                 "shape family).", "")

    # ---- 5. throughput
    def throughput(self) -> None:
        self.add("## 5. Throughput and scaling (against PyTorch on the same work)", "")
        ns = world_sizes(self.results, "vs_torch")
        if not ns:
            return self.missing("throughput", "make bench NP=2")
        runs = {n: self.rows(self.results / f"vs_torch_n{n}") for n in ns}
        setup = (self.results / f"vs_torch_n{ns[0]}" / "table.md").read_text().split("\n\n")[0]
        self.add(setup.replace(f"{ns[0]} ranks", "N ranks").split("; SGEMM peak")[0]
                 + "; MFU against the SGEMM peak each run measures per rank (half the "
                 "single-rank peak when 4 ranks share the 2 cores).", "")
        rows = [[s] + [f"{float(r['zmpi_tokens_per_s']):,.0f} ({float(r['ratio']):.2f}, "
                       f"{100 * float(r['zmpi_mfu']):.0f}%)"
                       for n in ns for r in runs[n] if int(r["stage"]) == s]
                for s in STAGES]
        self.add("zmpi tokens/s (zmpi/PyTorch step time, zmpi MFU), by stage and ranks; more "
                 "than 2 ranks share this machine's 2 cores (oversubscribed):", "")
        self.add(*table(["stage"] + [f"N = {n}" for n in ns], rows), "")
        figure(self.figures / "throughput.png", "Tokens/s on this machine (2 cores)", "ranks N",
               "tokens/s",
               [(f"stage {s}", ns, [float(r["zmpi_tokens_per_s"]) for n in ns for r in runs[n]
                                    if int(r["stage"]) == s], "line", s) for s in STAGES]
               + [("PyTorch, stage 0 peer (DDP)", ns,
                   [float(r["torch_tokens_per_s"]) for n in ns for r in runs[n]
                    if int(r["stage"]) == 0], "points", 7)], logx=True)
        self.image("throughput.png", "tokens per second against ranks")
        self.add("The papers' throughput figures (ZeRO: 15 PFlop/s on 400 V100s; ZeRO-Offload: "
                 "40 TFlop/s on one V100) are GPU measurements: not measured here, no GPU was "
                 "lent. On a GPU node: `mpiexec -n 8 python -m zmpi.cli train --stage 3 "
                 "--precision fp16 --profile` (experiments/slurm/train.sbatch).", "")

    # ---- 6. tensor parallelism
    def tensor(self) -> None:
        self.add("## 6. Tensor parallelism against data parallelism (Megatron-LM)", "",
                 "Megatron-LM trains a model split over T ranks at the cost of 4 allreduces of "
                 "B x T x C activations per layer and step, which is why it keeps a tensor group "
                 "inside one node. Every dp x tp layout of the same ranks (SP: with sequence "
                 "parallelism), the same GPT and batch, with the traffic of each mesh dimension "
                 "counted:", "")
        folder = self.first_run("tensor")
        rows = self.rows(folder) if folder else None
        if not rows:
            return self.missing("tensor parallelism", "make bench-tensor")
        self.add((folder / "table.md").read_text().rstrip(), "")
        self.add("Each rank holds 1/tp of the split parameters and the replicated ones whole, so "
                 "its model states shrink almost by tp; the data-parallel traffic shrinks with "
                 "them, and the tensor-parallel traffic grows with the activations, not with the "
                 "model. The loss is the same under every layout (the same model). On this "
                 "machine the ranks share 2 cores, so the step times compare layouts on one "
                 "machine, not the network a cluster would add.", "")

    # ---- 7. pipeline parallelism
    def pipeline(self) -> None:
        self.add("## 7. Pipeline parallelism and 3D layouts (GPipe, 1F1B)", "",
                 "A pipeline of p stages idles (p - 1) / (m + p - 1) of a step with m "
                 "micro-batches, under GPipe and 1F1B alike (1F1B holds fewer activations). "
                 "Measured with units that sleep (compute that does not share this machine's "
                 "cores), from the ops each stage's runner recorded:", "")
        folder = self.first_run("pipeline")
        bubble = self.rows(folder, "bubble") if folder else None
        rows = self.rows(folder) if folder else None
        if not bubble or not rows:
            return self.missing("pipeline parallelism", "make bench-pipeline")
        self.add((folder / "bubble.md").read_text().rstrip(), "")
        series = []
        for color, schedule in enumerate(sorted({r["schedule"] for r in bubble})):
            mine = [r for r in bubble if r["schedule"] == schedule]
            series.append((f"{schedule} measured", [int(r["m"]) for r in mine],
                           [float(r["measured"]) for r in mine], "points", color))
        ms = sorted({int(r["m"]) for r in bubble})
        formula = {int(r["m"]): float(r["formula"]) for r in bubble}
        series.append(("(p - 1) / (m + p - 1)", ms, [formula[m] for m in ms], "line", 2))
        figure(self.figures / "pipeline_bubble.png", f"Pipeline bubble, p = {bubble[0]['p']}",
               "micro-batches m", "idle fraction of the step", series, logx=True)
        self.image("pipeline_bubble.png", "pipeline bubble against micro-batches")
        self.image("pipeline_timeline.png", "measured GPipe and 1F1B timelines")
        self.add("Every dp x pp x tp layout of the same ranks, one GPT and batch:", "",
                 (folder / "table.md").read_text().rstrip(), "",
                 "The loss is the same under every layout (the same model). Pipeline stages "
                 "send only activations and their gradients (and the tied embedding's gradient "
                 "between the first and last stage), far less than the tensor layouts' "
                 "allreduces; their cost here is the bubble and the activations the first "
                 "stages hold (1F1B: p - s micro-batches). On this machine the ranks share 2 "
                 "cores, so the step times compare layouts, not a cluster's network.", "")

    # ---- 8. activation recompute
    def recompute(self) -> None:
        self.add("## 8. Activation recompute: what it costs and what it buys (ZeRO-R, "
                 "Megatron-LM)", "",
                 "Activation checkpointing trades compute for memory: keep less of the forward, "
                 "compute it again in backward (docs/recompute.md). Megatron-LM (Korthikanti et "
                 "al. 2022) puts full recompute at about a third of a step (one more forward) "
                 "and selective recompute, the attention probabilities only, at a few per cent; "
                 "zmpi targets full <= ~1/3 and selective <= ~5 %. The same GPT and "
                 "batches under each option, the options' steps interleaved:", "")
        folder = self.first_run("recompute")
        cost = self.rows(folder, "cost") if folder else None
        if not cost:
            return self.missing("activation recompute", "make bench-recompute")
        self._recompute_cost(folder, cost)
        self.add("Where the overhead comes from: full recompute runs each unit's forward again, "
                 "one more forward on top of a forward and a backward of about twice its cost: "
                 "up to a third of the step, less the optimizer's share. Selective recomputes "
                 "only the attention probabilities, softmax(q k^T): per layer about "
                 "B heads T^2 (head dim + a few) operations against the linear layers' "
                 "24 B T d_model^2, so its share of the step grows with T / d_model "
                 f"({self._t_over_c(folder)} above, a shape where attention matters; GPT-2 "
                 "small's is 1.33, and Megatron-LM's GPT-3-like models have T / d_model <= 1/3, "
                 "where its few per cent hold). The recompute column times that work directly; "
                 "the step time's overhead also holds the allocations it adds or saves and, on "
                 "this machine, the noise of 2 shared cores.", "")
        short = self.results / "recompute_t512_n1"
        short_cost = self.rows(short, "cost") if short.exists() else None
        if short_cost:
            self.add(f"The same at T / d_model = {self._t_over_c(short)} (`make "
                     "bench-recompute`'s second run, the cost table only):", "")
            self._recompute_cost(short, short_cost)
        longest = self.rows(folder, "longest")
        if longest:
            self.add("What it buys: the longest sequence, and the largest micro batch, that "
                     "one training step fits into a device-memory budget (as section 4 does "
                     "for model size):", "", (folder / "longest.md").read_text().rstrip())
            ratios = [float(r["longest_seq_len"]) / float(longest[0]["longest_seq_len"])
                      if float(longest[0]["longest_seq_len"]) else 0.0 for r in longest]
            figure(self.figures / "recompute_longest.png",
                   "Longest sequence that trains, same budget", "",
                   f"x {longest[0]['option']}",
                   [(r["option"], [i], [ratios[i]], "bar", i) for i, r in enumerate(longest)],
                   xticks=list(enumerate(r["option"] for r in longest)))
            self.image("recompute_longest.png", "longest sequence per recompute option")
            self.add("Without recompute every layer keeps its B x heads x T x T/2 attention "
                     "probabilities, so the longest T grows only as the square root of the "
                     "budget; selective recompute drops them and leaves what grows linearly "
                     "in T (Korthikanti et al.'s 34 bytes per position and channel of a layer, "
                     "at 16 bits); full recompute keeps one input per unit (B x T x C) plus "
                     "one unit's working set at a time, T^2 probabilities of one layer "
                     "included. Which of the two goes further depends on the number of layers "
                     "against T and the width: full wins with many layers, selective at long "
                     "T on few.", "")
        argv = json.loads((folder / "run.json").read_text()).get("argv") or ["?"]
        self.add(f"Made by `make bench-recompute` (`mpiexec -n "
                 f"{folder.name.rsplit('_n', 1)[1]} python {' '.join(argv)}`). The script takes "
                 "the model's shape and the budget as flags (`--help`), and runs as it is on a "
                 "GPU with `ZMPI_BACKEND=cupy` (not measured here).", "")

    def _recompute_cost(self, folder: Path, cost: list) -> None:
        """Section 8's cost table of `folder` and its verdict against the targets."""
        self.add((folder / "cost.md").read_text().rstrip(), "")
        by = {r["option"]: r for r in cost}
        verdicts = []
        for name, target, label in (("full", 1 / 3, "1/3"), ("selective", 0.05, "5 %")):
            if name in by:
                r = by[name]
                got = float(r.get("overhead_paired") or r["overhead"])  # the steadier one
                medians, share = float(r["overhead"]), float(r["recompute_share"])
                verdicts.append(f"{name} {100 * got:+.1f} % paired ({100 * medians:+.1f} % of "
                                f"the medians; recomputing: {100 * share:.1f} % of its step), "
                                f"target <= {label}: "
                                f"{'met' if got <= target else 'not met'}")
        same = all(r["params_identical"] == "True" and r["losses_identical"] == "True"
                   for r in cost)
        self.add("Overhead over no recompute: " + "; ".join(verdicts) + ". "
                 + ("Every option ends with the same parameters and losses, bit for bit (the "
                    "max param diff column)." if same else
                    "**Some option's parameters or losses differ from no recompute: the max "
                    "param diff column.**"), "")

    @staticmethod
    def _t_over_c(folder: Path) -> str:
        args = json.loads((folder / "run.json").read_text()).get("args") or {}
        if not args.get("d_model"):
            return "?"
        return f"{args['seq_len'] / args['d_model']:g}"

    def write(self) -> None:
        sources = sorted({revision(p) for p in self.used})
        head = ["# Reproducing the ZeRO papers' tables", "",
                "Generated by `make reproduce` (`experiments/report.py`) from the results under "
                f"`{os.path.relpath(self.results, self.out.parent)}/`; do not edit by hand. "
                "Machine: 2 CPU cores (NumPy backend, the `mpich` wheel, shared memory). "
                "Results from (git revision, date): " + "; ".join(sources) + ".", ""]
        self.out.write_text("\n".join(head + self.lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results")
    parser.add_argument("--out", default="experiments/RESULTS.md")
    args = parser.parse_args()
    report = Report(Path(args.results), Path(args.out))
    for section in (report.memory, report.lab, report.communication, report.largest,
                    report.throughput, report.tensor, report.pipeline, report.recompute):
        section()
    report.write()
    print(f"wrote {args.out} and {report.figures}/")


if __name__ == "__main__":
    main()

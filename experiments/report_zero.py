"""RESULTS.md's sections on the ZeRO papers' own tables (a mixin of report.Report): model-state
memory per device, the lab table, communication volume, the largest model under a budget,
throughput against PyTorch."""
import json

from reporting import figure, table, world_sizes

from zmpi.memory import model_state_bytes
from zmpi.models.gpt_counts import gpt_num_params

STAGES = (0, 1, 2, 3)
# ZeRO (Rajbhandari et al., SC'20), Fig. 1: model states per device, Psi = 7.5 B, N = 64,
# K = 12 (mixed-precision Adam), in GB (1e9 bytes)
PAPER_FIG1_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
PAPER_PSI, PAPER_N = 7.5e9, 64


class ZeroSections:
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
        why = ("The blocked time also holds the per-step scalar allreduces and, unit by "
               "unit, the moments the critical rank ran ahead of the other (both ranks "
               "compute on the same 2 cores)")
        if all(int(measured) >= int(predicted) for _, predicted, measured in rows):
            self.add(f"{why}, so it stays above the prediction.", "")
            return
        runs = [json.loads((self.results / name / "run.json").read_text())
                for name in ("bandwidth_n2", "vs_torch_n2")]
        self.add("Here the prediction is above the blocked time in some stages: the two come "
                 "from different runs (bandwidth "
                 + " and the benchmark ".join(f"{r['git_revision'][:10]} at {r['time'][:16]}"
                                              for r in runs)
                 + "), and this shared machine's bus bandwidth moves by up to 2x from one hour "
                 f"to the next (docs/stages.md). {why}: with the bandwidth of a quieter hour "
                 "(the run before, 6.5-7.0 GB/s at 16 MiB) the blocked time stayed above the "
                 "prediction in every stage.", "")

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

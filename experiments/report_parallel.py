"""RESULTS.md's sections on the parallel dimensions and the planner (a mixin of report.Report):
tensor and pipeline parallelism, activation recompute, `zmpi plan` against published runs
and this machine."""
import json
from pathlib import Path

from reporting import figure


class ParallelSections:
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

    # ---- 9. the planner
    def plan(self) -> None:
        self.add("## 9. Planning a run: `zmpi plan`'s model against published runs and this "
                 "machine", "",
                 "The planner's memory and time model (docs/plan.md) priced on the papers' "
                 "hardware with one efficiency constant fixed before comparing, and against "
                 "what runs measure on this machine (every rank's ledger, the step time):", "")
        published, here = self.results / "plan_published", self.results / "plan_validation"
        if self.rows(published) is None:
            self.missing("the published comparison",
                         "python experiments/plan_published.py --out results/plan_published")
        else:
            self.add((published / "table.md").read_text().strip(), "")
        if self.rows(here) is None:
            return self.missing("the validation on this machine", "python "
                                "experiments/validate_plan.py --out results/plan_validation")
        self.add((here / "table.md").read_text().strip(), "")
        quiet = self.results / "plan_validation_h100_host"
        if self.rows(quiet) is not None:
            self.add("The same validation on a quiet machine: the 16-core host of a GPU "
                     "machine, a core per rank, Open MPI (`python experiments/validate_plan.py "
                     "--out results/plan_validation_h100_host` there):", "",
                     (quiet / "table.md").read_text().strip(), "")
        busy = self.results / "plan_validation_h100_host_busy"
        if self.rows(busy) is not None:
            self.add("A host of the same kind later that day, busy (its GEMM rate 55-66 "
                     "GFLOP/s against 152-155 in the run above), with the engine's MPI probes "
                     "between "
                     "units (code of e33c044; run.json names the session's first commit, "
                     "264990a+dirty, as the machine received a copy of the working tree):", "",
                     (busy / "table.md").read_text().strip(), "")
        self.add("What each column means and why the step times differ: "
                 "[docs/plan.md](../docs/plan.md#validation).", "")

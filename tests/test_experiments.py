"""Experiment scripts run end to end at a tiny size (what they write is checked, never a
timing), into one results folder that experiments/report.py then turns into RESULTS.md."""
import pytest
from mpi_util import REPO_ROOT, launch_mpi

EXPERIMENTS = REPO_ROOT / "experiments"
ENV = {"PYTHONPATH": f"{REPO_ROOT}:{EXPERIMENTS}"}


def _run(script, n, *args, timeout=180):
    result = launch_mpi(EXPERIMENTS / script, n, timeout=timeout, args=list(args), env=ENV)
    assert result.returncode == 0, result.describe()
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    for n in (1, 2):
        _run("zero_tables.py", n, "--n-layer", "1", "--d-model", "32", "--out",
             out / f"zero_tables_n{n}")
    _run("bandwidth.py", 2, "--sizes", "1024", "65536", "--repeats", "2", "--unit-numels",
         "1000", "5000", "--out", out / "bandwidth_n2", timeout=120)
    _run("largest_model.py", 2, "--budget-mib", "2", "--d-model", "64", "--max-layers", "6",
         "--out", out / "largest_n2")
    _run("bench_tensor.py", 4, "--n-layer", "1", "--d-model", "32", "--n-head", "4",
         "--seq-len", "16", "--batch", "4", "--steps", "2", "--out", out / "tensor_n4")
    _run("bench_pipeline.py", 2, "--unit-ms", "1", "--bubble-steps", "1", "--n-layer", "1",
         "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
         "--micro-batches", "2", "--steps", "1", "--out", out / "pipeline_n2", "--figures",
         out / "figures")
    _run("bench_recompute.py", 2, "--n-layer", "3", "--d-model", "32", "--n-head", "4",
         "--seq-len", "128", "--batch", "4", "--steps", "2", "--budget-mib", "4",
         "--search-n-layer", "4", "--search-d-model", "32", "--search-seq-len", "128",
         "--max-seq-len", "2048", "--max-batch", "64", "--out", out / "recompute_n2")
    _run("bench_sparse_gpt.py", 1, "--d-model", "32", "--search-d-model", "32",
         "--budget-mib", "3", "--max-seq-len", "1024", "--seq-lens", "64", "128", "--steps", "1",
         "--loss-steps", "2", "--loss-window", "1", "--loss-seq-len", "64", "--loss-batch", "2",
         "--out", out / "sparse_gpt")
    _run("bench_checksums.py", 1, "--mib", "2", "--rounds", "1", "--out",
         out / "nvme_checksums")
    _run("bench_sparse_attention.py", 1, "--d-model", "32", "--seq-lens", "64,128",
         "--repeats", "1", "--out", out / "sparse_attention")
    moe = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "16",
           "--experts", "4", "--out", out / "moe_train"]
    _run("moe_train.py", 2, "--scaling", "--micro-batch", "2", "--scaling-steps", "1", *moe)
    _run("moe_train.py", 1, "--batch", "4", "--steps", "30", "--window", "5",
         "--val-batches", "1", "--aux-coef", "0.1", *moe)
    _run("llama_vs_gpt.py", 1, "--n-layer", "2", "--d-model", "32", "--n-head", "4",
         "--kv-heads", "2", "--seq-len", "16", "--batch", "4", "--steps", "30", "--window", "5",
         "--val-batches", "1", "--out", out / "llama_vs_gpt")
    return out


def _md_rows(path, prefix):
    return [[c.strip() for c in line.split("|")[1:-1]]
            for line in path.read_text().splitlines() if line.startswith(prefix)]


@pytest.mark.mpi
def test_largest_model_under_a_budget(results):
    layers = {r[0]: r[1] for r in _md_rows(results / "largest_n2" / "table.md", "| stage")}
    assert len(layers) == 7 and int(layers["stage 0 (DP)"]) >= 1
    assert int(layers["stage 3"].rstrip("+")) >= int(layers["stage 0 (DP)"])
    most = int(layers["stage 3 + offload + params"].rstrip("+"))  # activations bound it now
    assert most >= int(layers["stage 3"].rstrip("+"))


@pytest.mark.mpi
def test_tensor_bench_counts_match_the_formulas(results):
    rows = _md_rows(results / "tensor_n4" / "table.md", "| ")[1:]  # after the header
    assert [r[0] for r in rows] == ["4 x 1", "2 x 2", "2 x 2 SP", "1 x 4", "1 x 4 SP"]
    for r in rows:
        params, formula = r[1].split(" (")
        assert params == formula.rstrip(")")  # each rank's parameters
        for cell in (r[6], r[7]):  # dp and tp MiB per step, counted (formula)
            counted, formula = cell.split(" (")
            assert counted == formula.rstrip(")")
    assert len({r[8][:5] for r in rows}) == 1  # the same loss under every layout


@pytest.mark.mpi
def test_pipeline_bench_measures_every_schedule_and_layout(results):
    bubble = _md_rows(results / "pipeline_n2" / "bubble.md", "| ")[1:]
    assert [(r[0], r[1]) for r in bubble] == [(s, m) for s in ("gpipe", "1f1b")
                                              for m in ("4", "8", "16")]
    assert all(0 < float(r[2]) < 1 and r[3] == f"{1 / (int(r[1]) + 1):.3f}" for r in bubble)
    rows = _md_rows(results / "pipeline_n2" / "table.md", "| ")[1:]
    assert [r[0] for r in rows] == ["2 x 1 x 1", "1 x 1 x 2", "1 x 2 x 1"]
    assert len({r[-1] for r in rows}) == 1  # the same loss under every layout
    assert float(rows[2][4]) > 0 and float(rows[0][4]) == 0  # pp traffic only with stages


@pytest.mark.mpi
def test_recompute_bench_costs_and_what_it_buys(results):
    """Every option the config takes trains to the same parameters and losses as without
    recompute; selective keeps less than none and full less than selective; the longest
    sequence and the largest micro batch under the budget grow in the same order. Options the
    config refuses are listed as such, not run."""
    import json

    meta = json.loads((results / "recompute_n2" / "run.json").read_text())
    cost = {r["option"]: r for r in meta["rows"]}
    assert list(cost)[:3] == ["none", "selective", "full"]
    for name, r in cost.items():
        assert r["max_param_diff"] == 0.0 and r["params_identical"], name
        assert r["losses_identical"] and r["step_ms"] > 0, name
        if name != "none":  # every option keeps less on the device than none
            assert r["activation_peak_mib"] < cost["none"]["activation_peak_mib"], name
    peak = {p: cost[p]["activation_peak_mib"] for p in ("none", "selective", "full")}
    assert peak["full"] < peak["selective"] < peak["none"]
    assert cost["none"]["recompute_ms"] == 0 and cost["full"]["recompute_ms"] > 0
    skipped = [name for name, _ in meta["skipped"]]
    assert set(cost).isdisjoint(skipped) and len(cost) + len(skipped) >= 3
    longest = {r["option"]: r for r in meta["longest"]}
    assert set(longest) <= set(cost) | {n for n, _ in meta["search_skipped"]}
    t = [longest[p]["longest_seq_len"] for p in ("none", "selective", "full")]
    b = [longest[p]["largest_micro_batch"] for p in ("none", "selective", "full")]
    assert 0 < t[0] <= t[1] <= t[2] and t[2] > t[0] and all(x % 64 == 0 for x in t), t
    assert b[0] <= b[1] <= b[2] and b[2] > b[0], b
    rows = _md_rows(results / "recompute_n2" / "longest.md", "| ")[1:]
    assert [r[0] for r in rows] == list(longest) and rows[0][2] == "1.00x"


@pytest.mark.mpi
def test_sparse_bench_every_layout_fits_at_least_dense_and_trains(results):
    """Every layout's longest T under the budget is a multiple of the block and at least
    dense's (a layout keeps a subset of the causal blocks), without and with full recompute;
    every layout has a step time at each T and a finite loss; the tables name every layout."""
    import json
    import math

    meta = json.loads((results / "sparse_gpt" / "run.json").read_text())
    layouts = list(meta["layouts"])
    assert layouts[0] == "dense" and len(layouts) >= 6
    longest = {(r["layout"], r["recompute"]): r["longest_seq_len"] for r in meta["rows"]}
    for recompute in ("none", "full"):
        dense = longest[("dense", recompute)]
        assert dense > 0 and dense % 16 == 0
        for name in layouts:
            assert longest[(name, recompute)] >= dense and longest[(name, recompute)] % 16 == 0
    assert longest[("local", "full")] > longest[("dense", "full")]
    assert {(r["layout"], r["seq_len"]) for r in meta["step_times"]} == \
        {(n, t) for n in layouts for t in (64, 128)}
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["val_loss"])
               for r in meta["losses"]) and [r["layout"] for r in meta["losses"]] == layouts
    table = (results / "sparse_gpt" / "table.md").read_text()
    assert all(f"| {name} |" in table for name in layouts)
    kernel = json.loads((results / "sparse_attention" / "run.json").read_text())
    assert kernel["rows"] and all(r["sparse_ms"] > 0 and r["dense_ms"] > 0
                                  for r in kernel["rows"])


@pytest.mark.mpi
def test_moe_bench_trains_counts_the_load_and_meets_the_all_to_all_formula(results):
    """The MoE GPT and its dense base have equal active parameters (the gate's d x E per MoE
    layer aside); every run's loss falls; each step's load sums to the batch's assignments
    (k = 1: its tokens) with at most that many dropped, and the aux loss evens the load (the
    run is deterministic: same seed, batches and code); the scaling rows (2 ranks: ep 1 and
    2) send on ep what the all-to-all formula says, 4 calls per MoE layer, and on dp and edp
    what the strategies declare; the tables and the figure are written."""
    import json

    import numpy as np

    folder = results / "moe_train"
    meta = json.loads((folder / "run.json").read_text())
    runs = {r["run"]: r for r in meta["runs"]}
    assert list(runs) == ["dense", "MoE aux 0.1", "MoE no aux"]
    for name, r in runs.items():
        assert len(r["losses"]) == 30 and r["train_loss"] < r["losses"][0], name
        assert r["steps_in_budget"] >= 1 and r["val_loss"] > 0, name
    dense = runs["dense"]
    for name in ("MoE aux 0.1", "MoE no aux"):
        r = runs[name]
        assert r["active_params"] - dense["active_params"] == 16 * 4  # one MoE layer's gate
        assert r["total_params"] > r["active_params"]
        assert all(sum(layer) == 4 * 16 for step in r["load"] for layer in step)
        assert all(0 <= d <= 4 * 16 for step in r["dropped"] for d in step)
    assert {(m["run"], m["step"]) for m in meta["balance"]} == {
        (n, s) for n in ("MoE aux 0.1", "MoE no aux") for s in (2, 14, 29)}

    def max_over_mean(r):  # over the run's steps (3.0 without the aux loss here, 1.9 with)
        return np.mean([max(layer) / np.mean(layer) for step in r["load"] for layer in step])

    assert max_over_mean(runs["MoE aux 0.1"]) < max_over_mean(runs["MoE no aux"])
    [scaling] = meta["scaling"]
    assert [(s["ranks"], s["ep"]) for s in scaling["rows"]] == [(2, 1), (2, 2)]
    for s in scaling["rows"]:
        assert s["ep_sent_mib"] == pytest.approx(s["ep_formula_sent_mib"], rel=1e-12)
        assert s["ep_alltoall_calls"] == s["ep_formula_calls"] == (4 if s["ep"] == 2 else 0)
        assert s["ep_alltoall_bytes"] == s["ep_formula_bytes"]  # one MoE layer: 4 calls
        assert s["dp_sent_mib"] == pytest.approx(s["dp_declared_mib"], rel=1e-12)
        assert s["edp_sent_mib"] == pytest.approx(s["edp_declared_mib"], rel=1e-12)
    table = (folder / "table.md").read_text()
    assert "| MoE no aux | 0 |" in table and "| 2 | 2 x 1 |" in table
    assert (folder / "load.png").stat().st_size > 1000


@pytest.mark.mpi
def test_llama_bench_matches_the_gpts_parameters_and_trains(results):
    """Each Llama's parameters are within 1 % of the GPT-2's (its SwiGLU width chosen for
    it); every model's loss falls; the table and the loss curves name every model."""
    import json

    folder = results / "llama_vs_gpt"
    rows = json.loads((folder / "run.json").read_text())["runs"]
    assert [r["model"] for r in rows] == ["GPT-2", "Llama", "Llama GQA 2 kv"]
    for r in rows:
        assert abs(r["params"] / rows[0]["params"] - 1) < 0.01, r["model"]
        assert r["train_loss"] < r["losses"][0] and r["step_ms"] > 0, r["model"]
    assert rows[2]["config"]["num_key_value_heads"] == 2
    assert rows[2]["config"]["intermediate_size"] > rows[1]["config"]["intermediate_size"]
    table = (folder / "table.md").read_text()
    assert all(f"| {r['model']} |" in table for r in rows)
    assert (folder / "losses.csv").read_text().startswith("step,GPT-2,Llama,Llama GQA 2 kv\n")


@pytest.mark.mpi
def test_checksum_bench_times_both_passes_with_and_without(results):
    import json

    rows = json.loads((results / "nvme_checksums" / "run.json").read_text())["rows"]
    assert [r["pass"] for r in rows] == ["write", "read"]
    assert all(r["gib_s_with"] > 0 and r["gib_s_without"] > 0 for r in rows)


@pytest.mark.mpi
def test_bandwidth_table(results):
    rows = [r for r in _md_rows(results / "bandwidth_n2" / "table.md", "| ")
            if r[0] in ("allreduce", "reduce_scatter", "allgather")]
    # a time and a bandwidth for each (the bandwidth of 1 Ki elements can round to 0.00 on a
    # busy machine: timings are not pass/fail)
    assert len(rows) == 6 and all(float(r[2].split()[0].replace(",", "")) > 0
                                  and float(r[4]) >= 0 for r in rows)
    packing = _md_rows(results / "bandwidth_n2" / "packing.md", "| ")[1:]  # after the header
    assert [r[0] for r in packing] == ["1,000", "5,000"]
    # the ratio is the table's arithmetic on the exact times (packing.csv), not on the rounded
    # microseconds it shows (3 us / 1 us): no timing is pass/fail, however loaded the machine
    import csv

    with open(results / "bandwidth_n2" / "packing.csv") as f:
        exact = list(csv.DictReader(f))
    assert [int(r["unit_numel"]) for r in exact] == [1000, 5000]
    for row, shown in zip(exact, packing, strict=True):
        ratio = float(row["packed_s"]) / float(row["solo_s"])
        assert float(row["packed_over_solo"]) == pytest.approx(ratio, rel=1e-12)
        assert shown[3] == f"{ratio:.2f}", (shown, row)


@pytest.mark.mpi
def test_lab_table(results):
    import csv

    for n in (1, 2):
        md = _md_rows(results / f"zero_tables_n{n}" / "lab.md", "| ")[1:]  # after the header
        assert [r[0] for r in md] == ["0", "1", "2", "3"] and {r[1] for r in md} == {str(n)}
        with open(results / f"zero_tables_n{n}" / "lab.csv") as f:
            rows = list(csv.DictReader(f))
        init, peak, activations = ([float(r[k]) for r in rows] for k in
                                   ("init_MiB", "training_peak_MiB", "activation_peak_MiB"))
        assert all(a > 0 for a in activations)  # the layers' caches are counted
        assert all(p >= i + a for p, i, a in zip(peak, init, activations, strict=True))
        if n == 2:  # sharding shrinks what is held at init, stage by stage
            assert init[0] > init[1] > init[2] > init[3], init


@pytest.mark.mpi
def test_bench_vs_torch_at_a_tiny_size(results):
    """Only where the bench extra (torch) is installed: `make test` on a fresh machine has no
    torch, and zmpi never depends on it."""
    pytest.importorskip("torch")
    _run("bench_vs_torch.py", 2, "--d-model", "32", "--n-layer", "1", "--n-head", "2",
         "--seq-len", "16", "--micro-batch", "2", "--warmup", "1", "--steps", "1", "--out",
         results / "vs_torch_n2")
    rows = _md_rows(results / "vs_torch_n2" / "table.md", "| ")[1:]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]  # first losses agreed, or it exits
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
    assert "Stage 3 prefetch" in (results / "vs_torch_n2" / "table.md").read_text()


@pytest.mark.mpi
def test_report_collects_every_table_and_marks_what_is_missing(results, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "RESULTS.md"
    subprocess.run([sys.executable, EXPERIMENTS / "report.py", "--results", results, "--out",
                    out], env={**ENV, "MPLBACKEND": "Agg"}, check=True, cwd=REPO_ROOT)
    text = out.read_text()
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7.", "## 8.",
                    "## 15.", "## 16."):
        assert heading in text
    fig1 = _md_rows(out, "| 0 |") + _md_rows(out, "| 3 |")
    assert ["0", "120", "120.0"] in fig1 and ["3", "1.9", "1.9"] in fig1  # the paper's Fig. 1
    measured = [r for r in _md_rows(out, "| 1 |") + _md_rows(out, "| 2 |") if " = " in r[1]]
    assert len(measured) == 2 and all(" = " in c for r in measured for c in r[1:])
    if (results / "vs_torch_n2").exists():
        assert "| 0 | " in text.split("## 5.")[1]
    else:  # no bench run here: said, not invented
        assert "Not measured yet: throughput" in text
    for png in ("memory_per_device", "comm_volume", "bandwidth", "largest_model",
                "pipeline_bubble", "pipeline_timeline", "recompute_longest"):
        assert (results / "figures" / f"{png}.png").stat().st_size > 1000
        assert f"figures/{png}.png" in text
    section = text.split("## 8.")[1]
    assert "| full |" in section and "selective" in section and "target <=" in section


@pytest.mark.mpi
def test_zero_tables_give_a_plugin_strategy_its_row(tmp_path):
    """`make tables STRATEGY_MODULE=FILE.py`: the file's strategy (docs/strategies.md's
    tutorial) is measured beside the shipped ones, against its declaration and the formula of
    the closest ZeRO stage (stage 1: it shards the optimizer only)."""
    from test_strategies_doc import example_code

    (tmp_path / "zero1_allreduce.py").write_text(example_code())
    _run("zero_tables.py", 2, "--n-layer", "1", "--d-model", "32", "--strategy-module",
         tmp_path / "zero1_allreduce.py", "--out", tmp_path / "tables")
    rows = {r[0]: r for r in _md_rows(tmp_path / "tables" / "table.md", "| ")[1:]}
    mine = rows["zero1_allreduce (vs ZeRO-1)"]
    assert mine[1] == mine[2] == mine[3] == rows["stage1"][1]  # measured, declared, ZeRO-1
    assert mine[5] == mine[6]  # sent as declared: 3 passes, stage 1 sends 2
    assert float(mine[5]) == pytest.approx(1.5 * float(rows["stage1"][5]), abs=2e-3)

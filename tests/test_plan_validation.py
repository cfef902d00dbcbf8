"""`zmpi plan`'s memory model (zmpi.plan.memory.stage_memory) against the engine's ledger, on a
few layouts of a small GPT run under mpiexec on 2 ranks (tests/ranks/plan_checks.py, one
launch): the model states each rank holds after a step exactly, and the device peak of a
step within 5%. The layouts are those whose peak the planner once missed: ZeRO-2/3's unit
gradients in flight over the micro-steps, stage 1's shard when activations are freed, GPipe's
LM-head caches under full recompute. experiments/validate_plan.py runs the full set of
layouts (docs/plan.md, "Validation")."""
import json
import subprocess
import sys
from dataclasses import asdict

import pytest
from mpi_util import RANKS_DIR, REPO_ROOT, child_env, run_mpi

from zmpi.plan.collectives import counted_calls, stage_calls
from zmpi.plan.layout import Job, Layout
from zmpi.plan.memory import stage_memory

JOB = Job(n_layer=4, d_model=128, n_head=4, vocab_size=65, seq_len=64, global_batch=16,
          nodes=1, gpus_per_node=2, precision="fp16")
STEPS = 2
LAYOUTS = {
    "dp2 stage0": Layout(2, 1, 1, 0, "none", "none", False, 4, 2, "1f1b"),
    "dp2 stage1 optimizer offload, full": Layout(2, 1, 1, 1, "optimizer", "full", False, 2, 4,
                                                 "1f1b"),
    "tp2 sp stage1 selective": Layout(1, 1, 2, 1, "none", "selective", True, 8, 2, "1f1b"),
    "pp2 1f1b stage1": Layout(1, 2, 1, 1, "none", "none", False, 8, 2, "1f1b"),
    "dp2 stage2": Layout(2, 1, 1, 2, "none", "none", False, 2, 4, "1f1b"),
    "dp2 stage3 optimizer offload": Layout(2, 1, 1, 3, "optimizer", "selective", False, 2, 4,
                                           "1f1b"),
    "pp2 gpipe full stage0": Layout(1, 2, 1, 0, "none", "full", False, 4, 4, "gpipe"),
}


@pytest.fixture(scope="module")
def reports():
    items = [{"job": asdict(JOB), "layout": layout.to_dict()} for layout in LAYOUTS.values()]
    ranks = run_mpi(RANKS_DIR / "plan_checks.py", 2, [json.dumps(items), STEPS], timeout=120)
    return {name: [r["layouts"][i] for r in ranks] for i, name in enumerate(LAYOUTS)}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_model_states_exact(reports, name):
    layout = LAYOUTS[name]
    for r in reports[name]:
        predicted = stage_memory(JOB, layout, r["pp_rank"], on_gpu=False)
        assert r["model_state"] == predicted.model_state, (name, r["rank"])


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collective_calls_exact(reports, name):
    """The collectives and sends the time model charges (zmpi.plan.collectives) are those the
    engine's counters count in a step, on each dimension, on every rank."""
    layout = LAYOUTS[name]
    for r in reports[name]:
        if r["calls_step_skipped"]:  # fp16's loss scale found an overflow: no update, no
            pytest.skip("the counted step skipped its update")  # parameter allgather
        assert counted_calls(r["calls"]) == stage_calls(JOB, layout, r["pp_rank"]), \
            (name, r["rank"], r["calls"])


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_device_peak_within_5_percent(reports, name):
    layout = LAYOUTS[name]
    for r in reports[name]:
        predicted = stage_memory(JOB, layout, r["pp_rank"], on_gpu=False).device
        measured = r["peak"]["device"]
        assert abs(measured / predicted - 1) <= 0.05, (name, r["rank"], measured, predicted)


def test_a_layouts_rounds_are_judged_by_the_median_and_all_kept():
    """validate_plan's median round: the round whose measured / predicted time is the median,
    every round's ratio beside it (also as text, for table.csv), the model states exact only
    if they were in every round; and the quiet ratio: the least measured step of any round
    over the median of the rounds' predictions."""
    sys.path.insert(0, str(REPO_ROOT / "experiments"))
    from plan_tables import median_round

    rounds = [(1.3, True, 0.13, 0.10), (1.0, True, 0.12, 0.12), (1.1, False, 0.11, 0.09)]
    rows = [{"time_ratio": ratio, "ms_exact": exact, "time_meas_s": meas, "time_pred_s": pred,
             "at": k} for k, (ratio, exact, meas, pred) in enumerate(rounds)]
    row = median_round(rows)
    assert (row["at"], row["round"], row["time_ratio"]) == (2, 3, 1.1)
    assert row["round_ratios"] == [1.3, 1.0, 1.1] and row["rounds"] == "1.300 1.000 1.100"
    assert row["ms_exact"] is False
    assert (row["quiet_meas_s"], row["median_pred_s"]) == (0.11, 0.10)
    assert row["quiet_ratio"] == pytest.approx(1.1)
    assert median_round([{**rows[0], "error": "boom"}, rows[1]])["error"] == "boom"



def test_validate_plans_ranks_run_on_numpy(monkeypatch, tmp_path):
    """The model it checks is this machine's CPU (`measure_this`): its layouts run on NumPy
    even where CuPy and a GPU are found (on a GPU machine they once ran on the GPU)."""
    import subprocess
    import types
    sys.path.insert(0, str(REPO_ROOT / "experiments"))
    import validate_plan

    seen = {}

    def run(cmd, env, **kwargs):
        seen.update(env)
        done = cmd[cmd.index("--results") + 1]
        with open(done, "w") as f:
            json.dump([], f)
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("ZMPI_BACKEND", "cupy")
    args = types.SimpleNamespace(steps=2, seed=0, timeout=10)
    assert validate_plan.launch(args, 2, []) == []
    assert seen["ZMPI_BACKEND"] == "numpy" and seen["OMP_NUM_THREADS"] == "1"


def test_validate_plan_reports_the_cpu_time_the_hypervisor_took():
    """Steal (/proc/stat's eighth CPU time) over the layouts' launches: a VM's ranks slow
    down by it without its load showing it, so the table states it beside the load."""
    sys.path.insert(0, str(REPO_ROOT / "experiments"))
    from plan_tables import steal_line
    from validate_plan import cpu_times, stolen

    assert stolen([10, 0, 10, 70, 0, 0, 0, 10], [40, 0, 20, 110, 0, 0, 0, 30]) == 0.2
    assert stolen(None, [1] * 8) is None
    times = cpu_times()
    assert times is None or (len(times) >= 8 and stolen(times, cpu_times()) >= 0)
    ranks = [{"world": 2, "steal": 0.01}, {"world": 2, "steal": 0.2}, {"world": 1}]
    assert steal_line(ranks) == (" CPU time the hypervisor gave other guests (steal) while "
                                 "the layouts ran: 2 ranks 1.0-20.0% over the rounds.")
    assert steal_line([{"world": 4}]) == ""


@pytest.mark.parametrize("name", ["plan_validation", "plan_validation_h100_host",
                                  "plan_validation_h100_host_busy"])
def test_the_committed_validations_are_this_codes_judgement(tmp_path, name):
    """Each committed validation table is what this code's model and judgement make of its
    run's measurements (`validate_plan.py --rerender`; a remade table also names the run it
    came from): a change of the time model that is not followed by regenerating the tables
    fails here."""
    committed = REPO_ROOT / "results" / name
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "experiments" / "validate_plan.py"), "--rerender",
         str(committed / "run.json"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=child_env(PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, result.stderr
    remedy = (f"the model changed: python experiments/validate_plan.py --rerender "
              f"results/{name}/run.json --out results/{name}")
    for table in ("table.md", "table.csv"):  # less blank lines and the run's provenance
        made, kept = ([line for line in (path / table).read_text().splitlines()
                       if line and not line.startswith("Measured at ")]
                      for path in (tmp_path, committed))
        assert made == kept, remedy


def test_a_world_within_the_cores_is_predicted_with_the_hardware_on_its_ranks(monkeypatch):
    """validate_plan's round: a layout of 2 up to the cores' ranks is compared with the
    hardware measured on that many ranks at once, the others (1 rank, ranks beyond the cores)
    with the one process's; the round returns the former by world (the launches and the
    measurements stubbed)."""
    from dataclasses import replace
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(REPO_ROOT / "experiments"))
    import validate_plan

    from zmpi.plan import measure
    from zmpi.plan.hardware import PRESETS

    one_process = replace(PRESETS["cpu"], name="one process", cores_per_node=2)
    monkeypatch.setattr(measure, "measure_this", lambda **kw: one_process)
    monkeypatch.setattr(validate_plan, "measure_on_ranks",
                        lambda args, world: replace(one_process, name=f"on {world} ranks"))
    monkeypatch.setattr(validate_plan, "launch", lambda args, world, items: items)
    monkeypatch.setattr(validate_plan, "compare",
                        lambda item, hw: (item["layout"]["dp"] * item["layout"]["pp"]
                                          * item["layout"]["tp"], hw.name))
    args = SimpleNamespace(
        n_layer=4, d_model=128, n_head=4, vocab=65, seq_len=64, global_batch=16,
        precision="fp16", other_precisions=[], worlds=[1, 2, 4], only=1, hardware="this")
    hw, on_ranks, rows, _ = validate_plan.run_round(args, validate_plan.pick_layouts(args))
    assert hw is one_process and list(on_ranks) == [2]
    assert rows == [(1, "one process"), (2, "on 2 ranks"), (4, "one process")]

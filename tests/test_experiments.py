"""Experiment scripts run end to end at a tiny size (what they print is checked, never a
timing)."""
import pytest
from mpi_util import REPO_ROOT, launch_mpi

EXPERIMENTS = REPO_ROOT / "experiments"


@pytest.mark.mpi
def test_largest_model_under_a_budget(tmp_path):
    result = launch_mpi(EXPERIMENTS / "largest_model.py", 2, timeout=180, args=[
        "--budget-mib", "2", "--d-model", "64", "--max-layers", "6", "--out", tmp_path / "out"],
        env={"PYTHONPATH": f"{REPO_ROOT}:{EXPERIMENTS}"})
    assert result.returncode == 0, result.describe()
    rows = [line.split("|") for line in (tmp_path / "out" / "table.md").read_text().splitlines()
            if line.startswith("| stage")]
    layers = {r[1].strip(): r[2].strip() for r in rows}
    assert len(layers) == 7 and int(layers["stage 0 (DP)"]) >= 1
    assert int(layers["stage 3"].rstrip("+")) >= int(layers["stage 0 (DP)"])
    most = int(layers["stage 3 + offload + params"].rstrip("+"))  # activations bound it now
    assert most >= int(layers["stage 3"].rstrip("+"))


@pytest.mark.mpi
def test_bandwidth_table(tmp_path):
    result = launch_mpi(EXPERIMENTS / "bandwidth.py", 2, timeout=120, args=[
        "--sizes", "1024", "65536", "--repeats", "2", "--out", tmp_path / "out"],
        env={"PYTHONPATH": f"{REPO_ROOT}:{EXPERIMENTS}"})
    assert result.returncode == 0, result.describe()
    rows = [line for line in (tmp_path / "out" / "table.md").read_text().splitlines()
            if line.startswith("| all") or line.startswith("| reduce")]
    assert len(rows) == 6 and all(float(r.split("|")[5]) > 0 for r in rows)

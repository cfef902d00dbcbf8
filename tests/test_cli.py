"""The `zmpi` command: `estimate` reproduces the paper's table; `train` runs end to end."""
import json
import subprocess
import sys

from mpi_util import REPO_ROOT, launch_mpi


def test_estimate_reproduces_design_table():
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--params", "7.5e9",
                          "--world-size", "64"], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout
    gb = [line.split()[1] for line in out.splitlines()[2:]]
    assert gb == ["120.0", "31.4", "16.6", "1.9"], out


def test_train_two_ranks_end_to_end(tmp_path):
    result = launch_mpi(REPO_ROOT / "zmpi" / "cli.py", 2, timeout=180, args=[
        "train", "--stage", "3", "--precision", "fp16", "--steps", "30", "--n-layer", "1",
        "--d-model", "32", "--seq-len", "32", "--sample-tokens", "20",
        "--out", tmp_path / "run", "--log-dir", tmp_path / "logs"])
    assert result.returncode == 0, result.describe()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["world_size"] == 2 and meta["engine"]["strategy"] == "stage3"
    assert meta["git_revision"] and meta["environment"]["mpi_library"]
    lines = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    losses = [float(line.split(",")[1]) for line in lines[1:]]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.3  # it learns
    table = result.stdout[result.stdout.index("model-state memory"):].splitlines()
    for row in table[2:4]:  # per rank: measured == formula
        rank, measured, formula, _ = row.split()
        assert measured == formula, table
    assert "--- sample ---" in result.stdout
    assert (tmp_path / "logs" / "rank1.log").read_text().count("step") >= 3

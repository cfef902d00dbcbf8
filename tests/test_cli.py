"""The `zmpi` command: `estimate` reproduces the paper's table; `train` runs end to end."""
import json
import subprocess
import sys

import pytest
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


def _args(**kw):
    import argparse

    base = {"config": None, "batch": None, "lr": None, "stage": None, "precision": None,
            "seed": 0}
    return argparse.Namespace(**{**base, **kw})


def test_flags_override_config(tmp_path):
    from zmpi.cli import build_config
    from zmpi.config import Config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 64, "gradient_accumulation_steps": 2,
                                "fp16": {"enabled": True, "loss_scale_window": 100}}))
    cfg = Config.from_dict(build_config(_args(config=str(path)), 4)).resolve_batch(4)
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.train_batch_size == 64
    cfg = Config.from_dict(build_config(_args(config=str(path), precision="bf16", batch=16), 4))
    assert cfg.dtype_name == "bfloat16" and cfg.fp16.loss_scale_window == 100
    assert cfg.resolve_batch(4).train_micro_batch_size_per_gpu == 2
    assert Config.from_dict(build_config(_args(config=str(path), precision="fp32"), 4)) \
        .dtype_name == "float32"
    with pytest.raises(SystemExit, match="does not split"):
        build_config(_args(batch=30), 4)

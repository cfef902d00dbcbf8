"""Checkpoints of tensor- and pipeline-parallel runs (tests/ranks/tp_checkpoint_checks.py, one
4-rank launch): saved at one (dp, pp, tp, stage) and loaded at another, every parameter equals
the saver's right after the load (bit for bit), and training on matches the uninterrupted run:
fp64 to 1e-12 of the move training made (only the order of sums differs), fp32 at the same
layout bit for bit, fp16 within 2e-3 (measured 3.9e-4); and so with the vocabulary padded
(vocab_multiple) at the save, the load or both. The offline tools read them; `zmpi
train --tp 2` saves and resumes at pp 2."""
import json

import numpy as np
import pytest
from mpi_util import CLI, RANKS_DIR, launch_mpi, run_mpi

from zmpi.checkpoint import tools
from zmpi.checkpoint.manifest import read_manifest
from zmpi.checkpoint.store import resolve_tag

pytestmark = pytest.mark.mpi
BOUND = {"fp64": 1e-12, "fp32": 0.0, "fp16": 2e-3}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("tp_ckpt")
    reports = run_mpi(RANKS_DIR / "tp_checkpoint_checks.py", 4, args=[work], timeout=300)
    return work, reports


def test_a_checkpoint_saved_at_one_tensor_layout_loads_at_another(work):
    _, reports = work
    cases = reports[0]["cases"]
    assert len(cases) == 16  # 4 of them with the vocabulary padded (PADDED)
    for name, case in cases.items():
        precision = name.rsplit("_", 1)[-1] if name.endswith(("fp32", "fp16")) else "fp64"
        assert case["loaded_step"] == 3 and case["after_load"] == 0.0, (name, case)
        assert case["after_training"] <= BOUND[precision], (name, case)
    pairs = ("tp2s3_to_2ranks_tp2s2", "tp2s0_to_2ranks_pp2s3")
    for r in reports[2:]:  # ranks 2 and 3 sat out the 2-rank loads
        assert all(r["cases"][pair] == {} for pair in pairs)
        assert {k: v for k, v in r["cases"].items() if v} == \
            {k: v for k, v in cases.items() if k not in pairs}


def test_a_model_of_other_whole_shapes_is_refused(work):
    _, reports = work
    for r in reports:
        assert "mismatch: the checkpoint is of a different model (1 parameter of another shape; " \
            "units.0.wte: checkpoint (13, 16), model (14, 16))" in r["other_model"]


def test_offline_tools_read_a_tensor_parallel_checkpoint(work, tmp_path):
    work, _ = work
    for case, tp, pp in (("tp2s3_to_tp4s1", 2, 1), ("tp4s0_to_tp2s3off", 4, 1),
                         ("pp2tp2s1_to_pp4s2", 2, 2), ("pp4s0_to_pp2tp2s1", 1, 4)):
        ckpt = resolve_tag(work / case, None)
        manifest = read_manifest(ckpt)
        assert manifest["mesh"]["tp"] == tp and manifest["splits_obj"].size == tp
        assert manifest.get("pipeline", {"stages": 1})["stages"] == pp
        assert len(manifest["files"]) == manifest["world_size"] * tp * pp
        first = f"rank00000-of-{manifest['world_size']:05d}.h5"
        first = first if tp == 1 else f"tp000-{first}"
        assert manifest["files"][0]["file"] == (first if pp == 1 else f"pp000-{first}")
        assert tools.verify(work / case) == []
        assert tp == 1 or f"x tensor-parallel {tp}" in tools.inspect(work / case)
        assert pp == 1 or f"x pipeline {pp}" in tools.inspect(work / case)
        out = tools.consolidate(work / case, tmp_path / f"{case}.npz", npz=True)
        want = np.load(work / f"{case}.npz")
        with np.load(out) as got:
            assert got["units.0.wte"].shape == (13, 16)  # the padding left out
            for name in want.files:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)
            whole = sum(got[name].size for name in got.files if name != "__tied__")
        # the whole model's count: at tp 2 it gave one tensor rank's slices (15,040 of 28,576)
        assert f"  {whole:,} parameters in " in tools.inspect(work / case)
        assert tp == 1 or manifest["num_params"] < whole


def test_a_tampered_split_is_refused(work, tmp_path):
    """An edited split (a rank's runs that no longer fill its slice) is named, not read."""
    import shutil

    from zmpi.checkpoint.manifest import write_manifest

    work, _ = work
    copy = tmp_path / "copy"
    shutil.copytree(work / "tp2s3_to_tp4s1", copy)
    ckpt = resolve_tag(copy, None)
    body = json.loads((ckpt / "manifest.json").read_text())
    body["tensor"]["splits"]["units.0.wte"]["index"][1] = [[7, 13]]
    for key in ("format", "version", "checksum"):
        body.pop(key)
    write_manifest(ckpt / "manifest.json", body)
    problems = tools.verify(copy)
    assert len(problems) == 1 and "corrupt: tensor.splits['units.0.wte']" in problems[0]


def test_train_saves_at_tp_2_and_resumes_at_pp_2(tmp_path):
    common = ["train", "--steps", "6", "--n-layer", "1", "--d-model", "16", "--n-head", "2",
              "--seq-len", "8", "--batch", "4", "--ckpt-dir", tmp_path / "ckpt"]
    first = launch_mpi(CLI, 2, timeout=120, args=[*common[:2], "4", *common[3:], "--tp", "2",
                                                  "--save-every", "2", "--out", tmp_path / "a"])
    assert first.returncode == 0, first.describe()
    resumed = launch_mpi(CLI, 2, timeout=120, args=[*common, "--resume", tmp_path / "ckpt",
                                                    "--pp", "2", "--out", tmp_path / "b"])
    assert resumed.returncode == 0, resumed.describe()
    meta = json.loads((tmp_path / "b" / "run.json").read_text())
    assert meta["engine"]["mesh"] == {"dp": 1, "pp": 2, "tp": 1}
    steps = [int(line.split(",")[0]) for line in
             (tmp_path / "b" / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == [4, 5], steps  # went on from the tp-2 checkpoint of step 4

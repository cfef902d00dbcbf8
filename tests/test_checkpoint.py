"""Sharded checkpoints: round trips, exact resume in a new mpiexec, reshape N -> M across
stages and offload, consolidation, damaged checkpoints, crashes during a save, async save.

One module fixture runs the multi-rank jobs of tests/ranks/checkpoint_checks.py in five
launches, in dependency order (A saves at 4 ranks; C, D, E load those at 1, 2, 3 ranks and
save their own; B resumes A's at 4 ranks in a new mpiexec and loads C's); the tests assert
on the reports and on the parameter dumps (.npz) the jobs wrote.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi_util import RANKS_DIR, launch_mpi, run_mpi

from zmpi.checkpoint import tools
from zmpi.checkpoint.manifest import _body_crc, read_manifest
from zmpi.checkpoint.ownership import LOCK
from zmpi.checkpoint.store import MANIFEST, CheckpointError

pytestmark = pytest.mark.mpi
SCRIPT = RANKS_DIR / "checkpoint_checks.py"


def job(name, case, until, save_at=None, load=None, **extra):
    j = {"name": name, "case": case, "until": until, **extra}
    if save_at is not None:
        j.update(save_at=save_at, save_as=extra.get("save_as", name))
    if load:
        j["load"] = load
    return j


def roundtrips(n):
    """Every stage at world size n: save at step 2, a fresh engine loads, states compared."""
    return [job(f"rt{n}_s{s}", f"{s}/fp32", 2, save_at=2, roundtrip=True) for s in range(4)]


EXACT = {  # uninterrupted run at 4 ranks (saving midway) -> its resume in a new mpiexec
    "s0_fp32": "0/fp32", "s1_fp32": "1/fp32", "s2_fp32": "2/fp32", "s3_fp32": "3/fp32",
    "s3_fp16": "3/fp16", "s1_fp16_offload": "1/fp16/offload", "s2_dpu": "2/fp32/dpu",
    "h2_fp16": "hybrid:2/fp16",  # hybrid sharding: groups of 2 ranks, 2 shard files
}
UNTIL = {"s2_dpu": 7}  # the DPU save at step 4 happens with an update in flight
RESHAPE = [  # (resumed job, uninterrupted job it must match, tolerance)
    ("r4s3_to_1s0", "u1_s0_fp64", 1e-12),  # fp64: only the order of sums differs
    ("r4s3_to_2s1", "u2_s1_fp64", 1e-12),
    ("r4s3_to_3s2", "u3_s2_fp64", 1e-12),
    ("r2s2off_to_3s3", "u3_s3_fp64", 1e-12),
    ("r1s0_to_4s3", "u4_s3_fp64", 1e-12),
    ("r4s3h_to_2s1off", "u2_s1_fp16_offload", 2e-3),  # fp16 sums in another order; lr 1e-2
    ("r4h2_to_3s3", "u3_s3_fp64", 1e-12),  # a hybrid checkpoint (2 shards) into stage 3
    ("r4s3_to_4h2", "u4_s3_fp64", 1e-12),  # and a stage-3 one into hybrid
]
DAMAGE = {  # damaged copy -> the word its error must contain
    "flipped_data": "corrupt", "flipped_metadata": "corrupt", "flipped_last_byte": "corrupt",
    "truncated": "truncated", "missing_shard": "missing", "no_manifest": "missing",
    "edited_manifest": "corrupt", "future_version": "mismatch", "wrong_model": "mismatch",
    "no_such_directory": "missing",
}


def launches():
    a = [job(f"u4_{k}", c, UNTIL.get(k, 6), save_at=UNTIL.get(k, 6) - 3, save_as=f"n4_{k}",
             roundtrip=True) for k, c in EXACT.items()]
    a += [job("u4_s3_fp64", "3/fp64", 6, save_at=3, save_as="n4_s3_fp64"),
          job("u4_h2_fp64", "hybrid:2/fp64", 6, save_at=3, save_as="n4_h2_fp64"),
          job("async4_s3_fp16", "3/fp16", 6, save_at=3, save_as="n4_async", **{"async": True}),
          *roundtrips(4)]
    c = [job("u1_s0_fp64", "0/fp64", 6, save_at=3, save_as="n1_s0_fp64"),
         job("r4s3_to_1s0", "0/fp64", 6, load="n4_s3_fp64"), *roundtrips(1)]
    d = [job("u2_s1_fp64", "1/fp64", 6),
         job("r4s3_to_2s1", "1/fp64", 6, load="n4_s3_fp64"),
         job("u2_s2_fp64_offload", "2/fp64/offload", 6, save_at=3, save_as="n2_s2_off"),
         job("u2_s1_fp16_offload", "1/fp16/offload", 6),
         job("r4s3h_to_2s1off", "1/fp16/offload", 6, load="n4_s3_fp16"),
         {"name": "damaged", "case": "3/fp16", "corrupt": list(DAMAGE)}, *roundtrips(2)]
    e = [job("u3_s2_fp64", "2/fp64", 6), job("r4s3_to_3s2", "2/fp64", 6, load="n4_s3_fp64"),
         job("u3_s3_fp64", "3/fp64", 6),
         job("r2s2off_to_3s3", "3/fp64", 6, load="n2_s2_off"),
         job("r4h2_to_3s3", "3/fp64", 6, load="n4_h2_fp64"), *roundtrips(3)]
    b = [job(f"r4_{k}", c, UNTIL.get(k, 6), load=f"n4_{k}") for k, c in EXACT.items()]
    b += [job("r1s0_to_4s3", "3/fp64", 6, load="n1_s0_fp64"),
          job("r4s3_to_4h2", "hybrid:2/fp64", 6, load="n4_s3_fp64")]
    return [("A", 4, a), ("C", 1, c), ("D", 2, d), ("E", 3, e), ("B", 4, b)]


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def make_damaged(work):
    """Damaged copies of the 4-rank fp16 stage-3 checkpoint in work/damaged/<case>."""
    src = work / "ckpt" / "n4_s3_fp16"
    tag = (src / "latest").read_text().strip()
    for name in DAMAGE:
        if name != "no_such_directory":
            shutil.copytree(src, work / "damaged" / name)
    shard = lambda name, r: work / "damaged" / name / tag / f"rank{r:05d}-of-00004.h5"  # noqa
    with h5py.File(shard("flipped_data", 1)) as f:
        offset = f["master/units.1.mlp.fc.weight"].id.get_chunk_info(0).byte_offset
    flip_byte(shard("flipped_data", 1), offset + 10)
    flip_byte(shard("flipped_metadata", 2), 200)
    flip_byte(shard("flipped_last_byte", 3), shard("flipped_last_byte", 3).stat().st_size - 1)
    truncated = shard("truncated", 0)
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    shard("missing_shard", 3).unlink()
    (work / "damaged" / "no_manifest" / tag / MANIFEST).unlink()
    for name, edit in (("edited_manifest", lambda m: m.update(global_steps=99)),
                       ("future_version", lambda m: m.update(version=99))):
        path = work / "damaged" / name / tag / MANIFEST
        manifest = json.loads(path.read_text())
        edit(manifest)
        if name == "future_version":  # a well-formed manifest of a newer format
            manifest.pop("checksum")
            manifest["checksum"] = _body_crc(manifest)
        path.write_text(json.dumps(manifest))
    shutil.rmtree(work / "damaged" / "wrong_model")
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    other = Engine(GPT(GPTConfig(16, 8, 1, 2, 32)), {"train_micro_batch_size_per_gpu": 2})
    other.save_checkpoint(work / "damaged" / "wrong_model")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt")
    reports = {}
    for label, n, jobs in launches():
        if label == "D":
            make_damaged(work)
        ranks = run_mpi(SCRIPT, n, args=[work, json.dumps(jobs)], timeout=300)
        for j in range(len(jobs)):
            reports[jobs[j]["name"]] = [r["jobs"][j] for r in ranks]
    return work, reports


def load_npz(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def test_roundtrip_restores_every_state_bit_for_bit(runs):
    _, reports = runs
    names = [n for n, rs in reports.items() if "roundtrip_equal" in rs[0]]
    assert {f"rt{n}_s{s}" for n in (1, 2, 3, 4) for s in range(4)} <= set(names)
    bad = [n for n in names if not all(r["roundtrip_equal"] for r in reports[n])]
    assert not bad, f"a fresh engine's states differ from the saver's after loading: {bad}"


@pytest.mark.parametrize("case", list(EXACT) + ["async"])
def test_resume_in_a_new_mpiexec_is_bit_identical(runs, case):
    work, _ = runs
    resumed = work / ("async4_s3_fp16.npz" if case == "async" else f"r4_{case}.npz")
    whole = work / ("u4_s3_fp16.npz" if case == "async" else f"u4_{case}.npz")
    got, want = load_npz(resumed), load_npz(whole)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_hybrid_checkpoint_has_one_shard_per_group_rank(runs):
    work, _ = runs
    ckpt = work / "ckpt" / "n4_h2_fp64"
    manifest = read_manifest(ckpt / (ckpt / "latest").read_text().strip())
    assert manifest["world_size"] == 2 and manifest["strategy"] == "hybrid"
    assert [f["file"] for f in manifest["files"]] == ["rank00000-of-00002.h5",
                                                      "rank00001-of-00002.h5"]


def test_async_save_captures_the_state_of_its_call(runs):
    _, reports = runs
    assert all(r["async_equals_saver"] for r in reports["async4_s3_fp16"])


@pytest.mark.parametrize("resumed,whole,tol", RESHAPE)
def test_reshape_continues_like_an_uninterrupted_run(runs, resumed, whole, tol):
    work, _ = runs
    got, want = load_npz(work / f"{resumed}.npz"), load_npz(work / f"{whole}.npz")
    assert got["__step__"] == want["__step__"] and got["__scale__"] == want["__scale__"]
    worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    assert worst <= tol, f"{resumed} vs {whole}: max |diff| {worst:.3g} > {tol}"


@pytest.mark.parametrize("ckpt,at_save", [("n4_s3_fp64", "u4_s3_fp64"),
                                          ("n4_s3_fp16", "u4_s3_fp16"),
                                          ("n2_s2_off", "u2_s2_fp64_offload")])
def test_consolidate_equals_gather_parameters(runs, ckpt, at_save, tmp_path):
    work, _ = runs
    want = load_npz(work / f"{at_save}_at_save.npz")
    params = {k: v for k, v in want.items() if not k.startswith("__")}
    out = tools.consolidate(work / "ckpt" / ckpt, tmp_path / "model.h5")
    with h5py.File(out) as f:
        assert json.loads(f.attrs["tied"]) == {"units.3.wte": "units.0.wte"}
        assert f.get("units.3.wte", getlink=True).path == "/units.0.wte"  # stored once
        for k, v in params.items():
            np.testing.assert_array_equal(f[k][...], v, err_msg=k)
    z = load_npz(tools.consolidate(work / "ckpt" / ckpt, tmp_path / "m.npz", npz=True))
    assert json.loads(str(z.pop("__tied__"))) == {"units.3.wte": "units.0.wte"}
    assert z.keys() == params.keys()
    for k, v in params.items():
        np.testing.assert_array_equal(z[k], v, err_msg=k)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_fails_on_every_rank_and_leaves_the_engine(runs, damage):
    _, reports = runs
    word = DAMAGE[damage]
    for rank, r in enumerate(reports["damaged"]):
        outcome = r["corrupt"][damage]
        assert outcome["error"] is not None, f"rank {rank} loaded the {damage} copy"
        assert word in outcome["error"], f"rank {rank}: {outcome['error']!r} lacks {word!r}"
        assert outcome["untouched"], f"rank {rank}: a failed load changed the engine"
    if damage.startswith(("flipped", "truncated", "missing_shard")):
        assert ".h5" in reports["damaged"][0]["corrupt"][damage]["error"]  # names the file


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_reports_each_damage(runs, damage):
    work, _ = runs
    problems = tools.verify(work / "damaged" / damage)
    if damage == "wrong_model":  # a sound checkpoint, of another model: load's to refuse
        assert problems == []
        return
    assert problems and DAMAGE[damage] in problems[0], problems


def test_verify_passes_every_checkpoint_saved(runs):
    work, _ = runs
    for ckpt in (work / "ckpt").iterdir():
        assert tools.verify(ckpt) == [], ckpt


@pytest.mark.parametrize("kill_at", [1, 2, 4, 6])
def test_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path, kill_at):
    """fsync 1: shard written, not renamed; 2: manifest being written; 4: manifest complete,
    staging not renamed; 6: new tag in place, `latest` being replaced."""
    result = launch_mpi(RANKS_DIR / "checkpoint_kill.py", 2, args=[tmp_path, kill_at],
                        timeout=120)
    assert result.returncode != 0 and "the save finished" not in result.stdout, \
        result.describe()
    assert (tmp_path / "latest").read_text().strip() == "step2"
    assert tools.verify(tmp_path) == []
    from zmpi.comm import Comm

    sys.path.insert(0, str(RANKS_DIR))
    from checkpoint_checks import build

    engine = build("3/fp16", Comm())  # the 2-rank checkpoint, on one rank
    assert engine.load_checkpoint(tmp_path).client_state == {"step": 2}
    # the killed save's staging directory (there until the rename: fsyncs 1-4) is removed
    # at the next claim of the directory, which says so; it used to stay for good
    partial = tmp_path / ".step3.partial"
    assert partial.is_dir() == (kill_at < 6)
    assert engine.claim_checkpoint_dir(tmp_path).notes == (
        [f"removed {partial}, left by a save that did not finish (its writer is gone)"]
        if kill_at < 6 else [])
    assert not partial.exists()
    engine.close()


# ---- single-process API behaviour ------------------------------------------------------------
def _engine(lr=1e-2, stage=2, precision=None, **zero):
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage, **zero},
           "optimizer": {"type": "AdamW", "params": {"lr": lr}}}
    if precision:
        cfg[precision] = {"enabled": True}
    return Engine(GPT(GPTConfig(16, 8, 1, 2, 16), seed=0), cfg)


def _steps(engine, start, stop):
    from zmpi.data import SyntheticSource

    data = SyntheticSource(16, 8, 2, seed=0)
    for step in range(start, stop):
        engine.train_step(*data.sample(step))


def test_keep_last_removes_old_tags_only_after_the_new_one(tmp_path):
    engine = _engine()
    for step in range(4):
        _steps(engine, step, step + 1)
        engine.save_checkpoint(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "latest", "step3", "step4"]
    assert (tmp_path / "latest").read_text().strip() == "step4"
    with pytest.warns(UserWarning, match="step4 exists .* replaces it"):  # not silently
        engine.save_checkpoint(tmp_path, keep_last=2)  # the same tag again: replaced in place
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "latest", "step3", "step4"]
    assert tools.verify(tmp_path) == []


def test_load_reports_what_the_config_overrides(tmp_path):
    engine = _engine(lr=1e-2)
    _steps(engine, 0, 1)
    engine.save_checkpoint(tmp_path, client_state={"step": 1})
    loaded = _engine(lr=5e-3).load_checkpoint(tmp_path)
    assert loaded.global_steps == 1 and loaded.client_state == {"step": 1}
    assert loaded.notes == ["optimizer lr is 0.005 (the checkpoint had 0.01)"]


def test_bad_save_arguments_are_clear_errors(tmp_path):
    engine = _engine()
    with pytest.raises(ValueError, match="plain file name"):
        engine.save_checkpoint(tmp_path, tag="a/b")
    with pytest.raises(TypeError, match="not JSON serializable"):
        engine.save_checkpoint(tmp_path, client_state={"x": object()})
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="claiming checkpoint directory .*file failed: .*"
                       "not writable"):
        engine.save_checkpoint(tmp_path / "file")
    assert engine.checkpoints.pending is None


def test_checkpoint_of_offloaded_stage3_loads_into_stage0(tmp_path):
    """Offload on -> off and stage 3 -> 0 in one process; then both train identically."""
    a = _engine(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    _steps(a, 0, 2)
    a.save_checkpoint(tmp_path)
    b = _engine(stage=0)
    b.load_checkpoint(tmp_path)
    _steps(a, 2, 4)
    _steps(b, 2, 4)
    pa, pb = a.gather_parameters(), b.gather_parameters()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_manifest_records_layout_and_state(tmp_path):
    engine = _engine(stage=1)
    _steps(engine, 0, 3)
    path = engine.save_checkpoint(tmp_path, tag="mine")
    m = read_manifest(path)
    assert (m["tag"], m["global_steps"], m["optimizer"]["step_count"]) == ("mine", 3, 3)
    assert m["layout"] == engine.layout.to_dict() and m["strategy"] == "stage1"
    assert m["tied"] == {"units.2.wte": "units.0.wte"}


def test_ckpt_cli_inspect_verify_consolidate(tmp_path, capsys):
    from zmpi.cli import main

    engine = _engine(stage=3)
    _steps(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "c")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "zmpi.cli", "ckpt", *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    out = cli("inspect", tmp_path / "c")
    assert out.returncode == 0 and "global step 1" in out.stdout and "stage3" in out.stdout
    assert cli("verify", tmp_path / "c").returncode == 0
    out = cli("consolidate", tmp_path / "c", tmp_path / "m.npz", "--npz")
    assert out.returncode == 0 and (tmp_path / "m.npz").is_file(), out.stderr
    shard = next((tmp_path / "c" / "step1").glob("*.h5"))
    before = shard.read_bytes()
    os.mkfifo(tmp_path / "fifo")  # it was replaced by the zip (and /dev/full, by a device)
    (tmp_path / "null").symlink_to("/dev/null")
    for args, message in (([shard], "inside the checkpoint directory"),  # would destroy it
                          ([tmp_path / "c" / "latest"], "inside the checkpoint directory"),
                          ([tmp_path], "a directory"),
                          ([tmp_path / "no" / "m.h5"], "no directory"),
                          ([tmp_path / "fifo", "--npz"], "fifo: a FIFO, not a regular file"),
                          ([tmp_path / "null"], "a character device, not a regular file"),
                          ([tmp_path / "m.h5", "--tag", "../x"], "must be a plain file name")):
        with pytest.raises(SystemExit) as done:  # in this process: 7 fewer interpreters
            main(["ckpt", "consolidate", str(tmp_path / "c"), *map(str, args)])
        err = capsys.readouterr().err
        assert done.value.code == 2 and message in err and len(err.splitlines()) == 1, err
    assert shard.read_bytes() == before and cli("verify", tmp_path / "c").returncode == 0
    assert stat.S_ISFIFO((tmp_path / "fifo").stat().st_mode)
    assert (tmp_path / "null").resolve() == Path("/dev/null")
    assert not list(tmp_path.glob("*.tmp"))
    out = cli("inspect", tmp_path / "c" / "step1")  # a tag's directory, not the checkpoints'
    assert out.returncode == 1 and "this is one checkpoint (tag step1)" in out.stderr
    flip_byte(shard, 300)
    out = cli("verify", tmp_path / "c")
    assert out.returncode == 1 and "corrupt" in out.stdout, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == "1 problem"  # was "1 problems"
    out = cli("consolidate", tmp_path / "c", tmp_path / "m.h5")
    assert out.returncode == 1 and not list(tmp_path.glob("m.h5*"))  # no partial file left
    out = cli("inspect", tmp_path / "nowhere")
    assert out.returncode == 1 and "missing" in out.stderr


@pytest.mark.parametrize("npz", [False, True])
def test_consolidate_on_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(tmp_path,
                                                                               tmpfs, npz):
    """A full disk (a tmpfs of 8 KiB, the model's HDF5 is ~20 KiB) is exit 1, one line, no
    .tmp file: HDF5 never sees the failed write (it crashed the process with exit 139 after
    ~24 "Exception ignored" tracebacks). A read-only mount is refused before anything is
    read, exit 2 (its clean-up's unlink raised EROFS: a traceback)."""
    engine = _engine(stage=0)
    _steps(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "c")
    full, read_only = tmpfs("size=8k"), tmpfs("ro,size=8k")
    for directory, code, message in ((full, 1, "not written: No space left on device"),
                                     (read_only, 2, "Read-only file system")):
        out = subprocess.run([sys.executable, "-m", "zmpi.cli", "ckpt", "consolidate",
                              tmp_path / "c", directory / "m.h5", *(["--npz"] if npz else [])],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == code and message in out.stderr, (out.returncode, out.stderr)
        assert len(out.stderr.splitlines()) == 1 and out.stdout == ""
        assert list(directory.iterdir()) == []  # no .tmp, no partial file


def test_bf16_round_trip_and_a_change_of_storage_dtype(tmp_path):
    """bf16 is stored as its uint16 bits; loading into fp16 storage casts the master."""
    a = _engine(stage=2, precision="bf16")
    _steps(a, 0, 2)
    a.save_checkpoint(tmp_path)
    with h5py.File(next((tmp_path / "step2").glob("*.h5"))) as f:
        assert f["params/units.0.wte"].attrs["dtype"] == "bfloat16"
    b = _engine(stage=3, precision="bf16")
    b.load_checkpoint(tmp_path)
    np.testing.assert_array_equal(np.asarray(a.strategy.state_shard("params")),
                                  np.asarray(b.strategy.state_shard("params")))
    c = _engine(stage=1, precision="fp16")
    notes = c.load_checkpoint(tmp_path).notes
    assert any("master weights cast" in n for n in notes), notes
    master = np.asarray(c.strategy.state_shard("master"))
    np.testing.assert_array_equal(np.asarray(c.strategy.state_shard("params")),
                                  master.astype(np.float16))

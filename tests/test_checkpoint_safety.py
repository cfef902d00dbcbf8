"""Checkpoints under a hostile but fair user: a directory belongs to one run (a second writer,
another run's checkpoints, retention), the manifest is untrusted data (paths, types, edited
steps), disk faults during a save, a damaged newest checkpoint, bad `latest` files.

Multi-rank cases run in one 2-rank launch of tests/ranks/checkpoint_faults.py; the CLI cases
launch `zmpi train` (tiny GPT) with a hard timeout each.
"""
import json
import shutil
import subprocess
import sys
import time

import pytest
from mpi_util import CLI, RANKS_DIR, REPO_ROOT, launch_mpi, run_mpi, said_by_ranks, start_mpi

from zmpi.checkpoint import CheckpointError, tools
from zmpi.checkpoint.manifest import _body_crc, read_manifest
from zmpi.checkpoint.ownership import LOCK
from zmpi.checkpoint.store import MANIFEST

TINY = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "4",
        "--sample-tokens", "5"]


def zmpi_train(n, *args, timeout=120):
    return launch_mpi(CLI, n, timeout=timeout,
                      args=["train", *TINY, *map(str, args)])


def _tiny_with(flag, value) -> list[str]:
    """TINY with `flag`'s value replaced."""
    i = TINY.index(flag)
    return [*TINY[:i + 1], value, *TINY[i + 2:]]


def one_line_error(result, code=1):
    """The run failed with `code` and one line on stderr, no traceback."""
    assert result.returncode == code, result.describe()
    lines = result.ranks_stderr()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.describe()
    return lines[0]


def listing(directory):
    return sorted(p.name for p in directory.iterdir())


# ---- several ranks: disk faults, second writers, other runs, retention ---------------------
@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    reports = run_mpi(RANKS_DIR / "checkpoint_faults.py", 2,
                      args=[tmp_path_factory.mktemp("faults")], timeout=240)
    assert reports[0] == {**reports[1], "rank": 0}  # every rank saw the same
    return reports[0]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_shard_write_is_one_error_on_every_rank_and_loses_nothing(faults, mode):
    error = faults[f"{mode}_disk_full"]
    assert error.startswith("saving shard files in ") and "failed (rank 1): " in error
    assert error.endswith("rank00001-of-00002.h5: not written: File too large")
    assert faults[f"{mode}_after"] == [LOCK, "latest", "step1"]  # no partial directory
    assert faults["latest"] == "step1" and faults["save_after_fault"] is None


@pytest.mark.mpi
def test_a_second_writer_is_refused_naming_the_holder(faults):
    assert "in use: run " in faults["in_use"] and " is writing checkpoints here" in faults["in_use"]


@pytest.mark.mpi
def test_a_new_run_is_refused_a_directory_of_another_run_unless_it_starts_over(faults):
    assert "mismatch: it holds checkpoints of another run (recovered, step1)" in \
        faults["other_run"]
    assert faults["other_run_after"] == [LOCK, "latest", "recovered", "step1"]
    assert faults["overwrite_claim"] is None
    # nothing deleted until the new run's first checkpoint is complete; then the old run's go
    assert faults["overwrite_before_save"] == [LOCK, "latest", "recovered", "step1"]
    assert faults["overwrite_save"] is None and faults["overwrite_after"] == [LOCK, "latest",
                                                                             "step1"]


@pytest.mark.mpi
def test_a_resumed_run_keeps_its_id_and_prunes_its_own_checkpoints(faults):
    assert faults["same_run"] and faults["resumed_save"] is None
    assert faults["resumed_after"] == [LOCK, "latest", "step3", "step4"]


# ---- one process: the manifest is untrusted ------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 1-rank checkpoint (tag step2) saved by the engine API, without a zmpi train step."""
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    directory = tmp_path_factory.mktemp("saved")
    engine = Engine(GPT(GPTConfig(16, 8, 1, 2, 16)), {"train_micro_batch_size_per_gpu": 2})
    x = (__import__("numpy").arange(16).reshape(2, 8) % 16)
    for _ in range(2):
        engine.train_step(x, x)
    engine.save_checkpoint(directory)
    engine.close()
    return directory


def tampered(saved, tmp_path, edit, recompute=True):
    """A copy of `saved` whose manifest `edit` changed (its checksum recomputed)."""
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    path = copy / "step2" / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    if recompute:
        manifest.pop("checksum")
        manifest["checksum"] = _body_crc(manifest)
    path.write_text(json.dumps(manifest))
    return copy


def set_in(path, value):
    def edit(manifest):
        *parents, key = path
        section = manifest
        for name in parents:
            section = section[name]
        section[key] = value
    return edit


EDITS = {  # what an edited manifest (checksum recomputed) says: each refused with one line
    "shard path escapes": (set_in(["files", 0, "file"], "../../x.h5"), "files[0] names"),
    "absolute shard path": (set_in(["files", 0, "file"], "/etc/passwd"), "files[0] names"),
    "complex dtype": (set_in(["dtype"], "complex64"), "dtype is \"complex64\""),
    "world size a string": (set_in(["world_size"], "1"), "world_size is \"1\""),
    "world size too large": (set_in(["world_size"], 4), "layout has world_size 1"),
    "negative step": (set_in(["global_steps"], -1), "global_steps is -1"),
    "step as float": (set_in(["global_steps"], 2.5), "global_steps is 2.5"),
    "step a bool": (set_in(["global_steps"], True), "global_steps is true"),
    "edited step": (set_in(["global_steps"], 7), "the manifest does not describe the state"),
    "edited client step": (set_in(["client_state"], {"step": 900}),
                           "the manifest does not describe the state"),
    "inf lr": (set_in(["optimizer", "lr"], float("inf")), "optimizer.lr is Infinity"),
    "beta of one": (set_in(["optimizer", "betas"], [0.9, 1.0]), "optimizer.betas is"),
    "missing optimizer": (lambda m: m.pop("optimizer"), "optimizer is absent"),
    "layout overlaps": (set_in(["layout", "units", 0, "params", 0, "offset"], 3),
                        "layout.units[0] has a parameter entry"),
    "tied to nothing": (set_in(["tied"], {"a": "b"}), "tied maps 'a' to 'b'"),
    "bad checkpoint id": (set_in(["checkpoint_id"], "../x"), "checkpoint_id is"),
}


@pytest.mark.parametrize("case", EDITS)
def test_an_edited_manifest_is_refused_by_load_and_verify(saved, tmp_path, case):
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    edit, words = EDITS[case]
    copy = tampered(saved, tmp_path, edit)
    problems = tools.verify(copy)
    assert len(problems) == 1 and words in problems[0], problems
    engine = Engine(GPT(GPTConfig(16, 8, 1, 2, 16)), {"train_micro_batch_size_per_gpu": 2})
    with pytest.raises(CheckpointError, match="corrupt|mismatch") as error:
        engine.load_checkpoint(copy)
    assert words in str(error.value)
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "ckpt", "verify", str(copy)],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 1 and "Traceback" not in out.stderr and words in out.stdout


@pytest.mark.parametrize("text", ["..", "", "/etc", "step2/../..", ".step2.partial"])
def test_a_latest_naming_no_tag_is_one_line(saved, tmp_path, text):
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    (copy / "latest").write_text(text)
    assert tools.verify(copy) == [f"{copy / 'latest'}: corrupt: it names {text!r}, not a "
                                  "checkpoint tag"]
    for command in ("verify", "inspect"):
        out = subprocess.run([sys.executable, "-m", "zmpi.cli", "ckpt", command, str(copy)],
                             capture_output=True, text=True, cwd=REPO_ROOT)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out


def test_a_kill_between_the_renames_of_a_re_save_loses_nothing(saved, tmp_path):
    """Publish moves step2 to .step2.old, then .step2.partial to step2: killed in between,
    `latest` names a missing tag. The complete copy is loaded from where it is; the next
    claim of the directory puts it back."""
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    (copy / "step2").rename(copy / ".step2.old")
    shutil.copytree(copy / ".step2.old", copy / ".step2.partial")  # the new copy, complete
    assert tools.verify(copy) == []
    engine = Engine(GPT(GPTConfig(16, 8, 1, 2, 16)), {"train_micro_batch_size_per_gpu": 2})
    assert engine.load_checkpoint(copy).global_steps == 2
    held = engine.claim_checkpoint_dir(copy)
    assert held.notes == [f"restored {copy / 'step2'} from .step2.partial (a re-save was "
                          "interrupted)"]
    assert listing(copy) == [LOCK, "latest", "step2"]
    engine.close()
    (copy / "step2").rename(copy / ".step2.old")  # killed before the new copy was complete
    assert read_manifest(tools.resolve_tag(copy, None))["global_steps"] == 2


def test_a_dead_saves_partial_directory_is_removed_never_a_live_writers(saved, tmp_path):
    """A save's staging directory (.<tag>.partial) that a kill left is removed by the next
    claim of the directory, which says so; while a writer holds the directory's lock, its
    staging directory is its own: a second claim is refused and removes nothing."""
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    def engine():
        return Engine(GPT(GPTConfig(16, 8, 1, 2, 16)), {"train_micro_batch_size_per_gpu": 2})

    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    live = engine()
    live.load_checkpoint(copy)  # continues the saver's run
    live.claim_checkpoint_dir(copy)
    for tag in ("step3", "step2"):  # a new tag's save, a re-save's: both in flight
        shutil.copytree(copy / "step2", copy / f".{tag}.partial")
        (copy / f".{tag}.partial" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="in use"):
        engine().claim_checkpoint_dir(copy)
    assert listing(copy) == [".step2.partial", ".step3.partial", LOCK, "latest", "step2"]
    live.close()  # as a SIGKILL would: the lock goes with the writer
    successor = engine()
    successor.load_checkpoint(copy)
    assert successor.claim_checkpoint_dir(copy).notes == [
        f"removed {copy / name}, left by a save that did not finish (its writer is gone)"
        for name in (".step2.partial", ".step3.partial")]
    assert listing(copy) == [LOCK, "latest", "step2"] and tools.verify(copy) == []
    successor.close()


# ---- zmpi train ---------------------------------------------------------------------------
@pytest.mark.mpi
def test_train_refuses_another_runs_directory_and_keeps_its_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    assert zmpi_train(1, "--steps", "4", "--save-every", "2", "--ckpt-dir", ck, "--out",
                      tmp_path / "a").returncode == 0
    line = one_line_error(zmpi_train(2, "--steps", "2", "--save-every", "1", "--keep-last",
                                     "1", "--ckpt-dir", ck, "--out", tmp_path / "b"))
    assert "holds checkpoints of another run (step2, step4)" in line
    assert "--overwrite-ckpt-dir" in line
    assert listing(ck) == [LOCK, "latest", "step2", "step4"]
    assert (ck / "latest").read_text().strip() == "step4"
    # the engine API's checkpoint (no zmpi train step) resumes, continuing that run in ck
    result = zmpi_train(1, "--steps", "6", "--save-every", "1", "--keep-last", "1",
                        "--resume", ck, "--out", tmp_path / "c")
    assert result.returncode == 0, result.describe()
    assert listing(ck) == [LOCK, "latest", "step6"]


@pytest.mark.mpi
def test_train_resumes_an_engine_checkpoint_from_its_global_step(tmp_path):
    """A checkpoint of engine.save_checkpoint() has no zmpi train step: the run goes on from
    the engine's global step (and says so)."""
    import numpy as np

    from zmpi.data import CharTokenizer, load_text
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    vocab = CharTokenizer(load_text()).vocab_size  # the model zmpi train builds from TINY
    engine = Engine(GPT(GPTConfig(vocab, 8, 1, 2, 16), seed=0),
                    {"train_micro_batch_size_per_gpu": 4})
    x = np.arange(32).reshape(4, 8) % vocab
    for _ in range(2):
        engine.train_step(x, x)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    result = zmpi_train(1, "--stage", "0", "--steps", "4", "--resume", tmp_path / "ck",
                        "--out", tmp_path / "run")
    assert result.returncode == 0, result.describe()
    assert "going on from step 2" in result.stdout, result.stdout
    steps = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in steps] == [2, 3]


@pytest.mark.mpi
def test_train_resume_offers_and_takes_the_newest_sound_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    assert zmpi_train(2, "--steps", "4", "--save-every", "2", "--ckpt-dir", ck, "--out",
                      tmp_path / "a").returncode == 0
    shard = ck / "step4" / "rank00001-of-00002.h5"
    shard.write_bytes(shard.read_bytes()[:100])  # the newest is damaged
    result = zmpi_train(2, "--steps", "6", "--resume", ck, "--out", tmp_path / "b")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.describe()
    assert result.stderr.count("cannot resume") == 1 and "truncated" in result.stderr
    assert "the newest checkpoint that verifies is " + str(ck / "step2") in result.stderr
    assert "--resume-tag step2, or add --resume-fallback" in result.stderr
    result = zmpi_train(2, "--steps", "6", "--resume", ck, "--resume-fallback", "--out",
                        tmp_path / "c")
    assert result.returncode == 0, result.describe()
    assert "fell back to step2" in result.stdout and "step 2, saved by 2 ranks" in result.stdout


@pytest.mark.mpi
def test_train_resume_of_another_model_offers_no_other_checkpoint(tmp_path):
    """A sound checkpoint of another model is refused without the hint for a damaged one
    (an older checkpoint of the same run would fail the same way); another head count, which
    no parameter's shape shows, is refused by the config's model section; another batch
    resumes with a note."""
    ck = tmp_path / "ck"
    assert zmpi_train(1, "--steps", "2", "--save-every", "2", "--ckpt-dir", ck, "--out",
                      tmp_path / "a").returncode == 0
    wider = _tiny_with("--d-model", "32")
    result = launch_mpi(CLI, 1, timeout=120, args=[
        "train", *wider, "--steps", "4", "--resume", ck, "--out", tmp_path / "b"])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.describe()
    assert "cannot resume" in result.stderr and "verifies" not in result.stderr, \
        result.describe()
    heads = _tiny_with("--n-head", "1")
    result = launch_mpi(CLI, 1, timeout=120, args=[
        "train", *heads, "--steps", "4", "--resume", ck, "--out", tmp_path / "c"])
    assert result.returncode == 1, result.describe()
    assert "mismatch: the checkpoint is of a different model (model.n_head: checkpoint 2, " \
           "this run 1)" in result.stderr, result.describe()
    batch = _tiny_with("--batch", "8")
    result = launch_mpi(CLI, 1, timeout=120, args=[
        "train", *batch, "--steps", "4", "--resume", ck, "--out", tmp_path / "d"])
    assert result.returncode == 0, result.describe()
    assert "train_batch_size is 8 (the checkpoint had 4)" in result.stdout, result.describe()


@pytest.mark.mpi
def test_train_finds_an_unwritable_checkpoint_directory_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    result = zmpi_train(2, "--steps", "50", "--save-every", "25", "--ckpt-dir",
                        tmp_path / "file" / "ck", "--out", tmp_path / "run")
    line = one_line_error(result)
    assert line.endswith("ck: not writable: Not a directory"), line
    assert not (tmp_path / "run" / "metrics.csv").exists()  # no step was trained


@pytest.mark.mpi
def test_train_refuses_a_second_writer_at_start_up(tmp_path):
    ck = tmp_path / "ck"
    first = start_mpi(CLI, 1, args=[
        "train", *TINY, "--steps", "100000", "--save-every", "100000", "--ckpt-dir", ck,
        "--out", tmp_path / "a"])
    try:
        deadline = time.monotonic() + 60
        while not ((ck / LOCK).is_file() and (ck / LOCK).read_text()):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.2)
        line = one_line_error(zmpi_train(1, "--steps", "2", "--save-every", "1",
                                         "--ckpt-dir", ck, "--out", tmp_path / "b"))
        holder = json.loads((ck / LOCK).read_text())
        assert f"in use: run {holder['run_id'][:12]} (pid {holder['pid']} on " in line
    finally:
        first.kill()
        first.communicate()


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_during_a_shard_write_is_a_checkpoint_error_and_no_file(tmp_path):
    """ENOSPC from the disk (the shard's temporary file is /dev/full, which fails every
    write with ENOSPC): HDF5 never sees the failure (it cannot recover from one), the save
    raises one CheckpointError and leaves no file."""
    import numpy as np

    from zmpi.checkpoint.store import write_shard
    from zmpi.zero.flat import ModelLayout, UnitLayout

    layout = ModelLayout([UnitLayout.build({"w": (1000,)}, 1)])
    path = tmp_path / "rank00000-of-00001.h5"
    path.with_name(path.name + ".tmp").symlink_to("/dev/full")
    with pytest.raises(CheckpointError, match=r"rank00000-of-00001.h5: not written: No space "
                                              r"left on device$"):
        write_shard(path, layout, 0, {"master": np.ones(1000, np.float32)}, {})
    assert listing(tmp_path) == []


RANKS_SEE_DIFFERENT_FILES = """
import sys
from pathlib import Path
import numpy as np
from zmpi.checkpoint import CheckpointError, sharded
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

comm, directory = Comm(), Path(sys.argv[1]) / "ckpt"
engine = Engine(GPT(GPTConfig(32, 8, 1, 2, 16), seed=0),
                {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, comm)
tokens = np.random.default_rng(comm.rank).integers(0, 32, (2, 9))
for tag in ("a", "b"):  # `latest` names b
    engine.train_step(tokens[:, :-1], tokens[:, 1:])
    engine.save_checkpoint(directory, tag=tag)
if comm.rank == 1:  # as if its node's file system showed an older `latest`
    sharded.resolve_tag = lambda directory, tag: Path(directory) / "a"
said = []
for fallback in (False, True):
    try:
        engine.load_checkpoint(directory, fallback=fallback)
        said.append("loaded")
    except CheckpointError as e:
        said.append(str(e))
with open(Path(sys.argv[1]) / f"rank{comm.rank}.txt", "w") as fh:
    fh.write("\\n".join(said))
"""


@pytest.mark.mpi
def test_ranks_that_read_different_checkpoints_fail_alike(tmp_path):
    """Each rank finds the checkpoint itself; where their file systems disagree (rank 1 sees
    an older `latest` here) the load fails on every rank, naming what each read, instead of
    training on from different states; with fallback too (not a damaged checkpoint)."""
    said = said_by_ranks(tmp_path, RANKS_SEE_DIFFERENT_FILES, timeout=120)
    assert said[0] == said[1], said
    plain, fallback = said[0].split("\n")
    assert fallback == plain, said
    assert "the ranks read different checkpoints (rank 0: " in said[0], said
    assert f"{tmp_path / 'ckpt' / 'b'}" in said[0] and f"rank 1: {tmp_path / 'ckpt' / 'a'}" \
        in said[0], said


def test_a_manifest_that_cannot_be_read_while_listed_is_left_out(tmp_path, monkeypatch):
    """complete_checkpoints (the other-runs note after a load, claim and prune run it on rank 0
    alone) leaves out a checkpoint whose manifest another run prunes while it is listed: an
    OSError there, on rank 0 only, left the other ranks waiting for rank 0's answer."""
    from zmpi.checkpoint import ownership

    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "manifest.json").write_text("{}")

    def pruned_meanwhile(path):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(ownership, "read_manifest", pruned_meanwhile)
    assert list(ownership.complete_checkpoints(tmp_path)) == []

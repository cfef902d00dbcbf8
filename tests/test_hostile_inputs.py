"""Hostile inputs and faults (issue 56, section 4): each case here was a traceback, a hang, a
destroyed file or a silent wrong answer before its fix, and is now one line (or a note) and
the exit code docs/failures.md gives. Most run in this process (`main([...])`, one rank)."""
import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from zmpi.checkpoint import tools
from zmpi.checkpoint.store import MANIFEST, CheckpointError
from zmpi.cli import main

TINY = ["--steps", "1", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len",
        "8", "--sample-tokens", "0"]
DEEP = "[" * 5000 + "]" * 5000  # json.loads: a RecursionError


def _engine(**config):
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **config}
    return Engine(GPT(GPTConfig(16, 8, 1, 2, 16), seed=0), cfg)


def _steps(engine, start, stop):
    from zmpi.data import SyntheticSource

    data = SyntheticSource(16, 8, 2, seed=0)
    for step in range(start, stop):
        engine.train_step(*data.sample(step))


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _cli_fails(argv, code=2) -> str:
    """main(argv) in this process: its exit code `code` and its one line on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
            pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    assert done.value.code == code, (done.value.code, err.getvalue())
    return _one_line(err.getvalue())


def _train_fails(tmp_path, *flags, code=2) -> str:
    """`zmpi train` with TINY's flags (those `flags` give replaced) and --out tmp_path/run
    (unless given) fails with `code` and one line, which is returned."""
    base = [a for i in range(0, len(TINY), 2) if TINY[i] not in flags for a in TINY[i:i + 2]]
    out = [] if "--out" in flags else ["--out", tmp_path / "run"]
    return _cli_fails(["train", *base, *out, *flags], code)


# --- 4.1: a symbolic link as consolidate's output is written through, never replaced --------

def test_consolidate_writes_through_a_link_and_keeps_it(tmp_path):
    engine = _engine()
    _steps(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "c")
    (tmp_path / "real.npz").write_bytes(b"old")
    link = tmp_path / "link.npz"
    link.symlink_to(tmp_path / "real.npz")
    tools.consolidate(tmp_path / "c", link, npz=True)
    assert link.is_symlink() and os.readlink(link) == str(tmp_path / "real.npz")
    assert set(np.load(tmp_path / "real.npz")) >= {"units.0.wte"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "link.npz", "real.npz"]


# --- 4.3: a manifest nested 5,000 deep; a 4,301-digit integer in a config --------------------

def test_a_deeply_nested_manifest_is_corrupt_and_resume_falls_back(tmp_path, capsys):
    engine = _engine()
    for step in (1, 2):
        _steps(engine, step - 1, step)
        engine.save_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "step2" / MANIFEST).write_text(DEEP)
    problems = tools.verify(tmp_path / "c")
    assert len(problems) == 1 and "nested too deeply" in problems[0], problems
    for command in ("inspect", "verify", "consolidate"):
        extra = [tmp_path / "m.npz", "--npz"] if command == "consolidate" else []
        with pytest.raises(SystemExit) as done:
            main(["ckpt", command, str(tmp_path / "c"), *map(str, extra)])
        said = capsys.readouterr()
        assert done.value.code == 1 and "Traceback" not in said.err
        assert "not a readable manifest (nested too deeply)" in said.out + said.err
    with pytest.raises(CheckpointError, match="nested too deeply"):
        _engine().load_checkpoint(tmp_path / "c")
    loaded = _engine().load_checkpoint(tmp_path / "c", fallback=True)
    assert loaded.path.name == "step1" and loaded.global_steps == 1


def test_an_integer_of_4301_digits_in_a_config_is_one_line_naming_the_key(tmp_path):
    config = tmp_path / "c.json"
    config.write_text('{"optimizer": {"params": {"lr": 1}}, "seed": ' + "9" * 4301 + "}")
    assert _train_fails(tmp_path, "--config", config) == (
        f"zmpi train: config {config}: seed: an integer of 4,301 digits, beyond any value "
        "zmpi takes")


# --- 4.4: special files as --config, --data or --hardware -----------------------------------

@pytest.mark.parametrize("flag", ["--config", "--data"])
def test_special_files_as_inputs_are_refused_not_read(tmp_path, flag):
    """/dev/zero and /dev/urandom never end, a FIFO waits for a writer: each hung."""
    os.mkfifo(tmp_path / "fifo")
    extra = ["--vocab-size", "65"] if flag == "--data" else []
    for path, kind in (("/dev/zero", "a character device"),
                       ("/dev/urandom", "a character device"),
                       (tmp_path / "fifo", "a FIFO"),
                       (tmp_path, "a directory")):
        said = "a directory, not a file" if path == tmp_path else f"{kind}, not a regular file"
        assert _train_fails(tmp_path, flag, path, *extra) == (
            f"zmpi train: config {path}: cannot read {path}: {said}" if flag == "--config" else
            f"zmpi train: --data {path}: {said}")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert _train_fails(tmp_path, flag, tmp_path / "dangling", *extra).endswith(
        f"dangling: not found (a link to {tmp_path / 'gone'}, which does not exist)")


def test_plan_hardware_names_what_the_file_is(tmp_path):
    """/dev/null was "not found"."""
    from zmpi.plan.measure import load_hardware

    with pytest.raises(ValueError, match="^hardware file /dev/null: a character device, not "
                                         "a regular file$"):
        load_hardware("/dev/null")


# --- 4.2 and 4.10: --out is locked as a checkpoint directory is; no other run's rows --------

def test_out_is_locked_while_another_run_writes_it(tmp_path):
    """Two runs started at once into one fresh --out interleaved their rows; two resumes of
    one run into its --out dropped one's rows: the second is refused, the holder named."""
    from zmpi.checkpoint.ownership import lock_directory

    (tmp_path / "run").mkdir()
    held = lock_directory(tmp_path / "run", "0123456789abcdef", "writing its record")
    try:
        line = _train_fails(tmp_path)
    finally:
        held.close()
    assert line.startswith(f"zmpi train: --out {tmp_path / 'run'}: in use: run 0123456789ab "
                           "(pid ") and "is writing its record (run.json, metrics.csv) here" \
        in line, line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".zmpi-lock"]
    with contextlib.redirect_stdout(io.StringIO()):  # released: the directory is free again
        main(["train", *TINY, "--out", str(tmp_path / "run")])
    assert (tmp_path / "run" / "run.json").is_file()


def test_out_holding_rows_but_no_run_json_or_checkpoints_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.csv").write_text("step,loss\n0,4.1\n")
    assert _train_fails(tmp_path) == (
        f"zmpi train: --out {out} holds a metrics.csv but no run.json (another run's rows, "
        "which this run's would be appended to): give another directory")
    assert (out / "metrics.csv").read_text() == "step,loss\n0,4.1\n"
    engine = _engine()
    _steps(engine, 0, 1)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()  # lets go of the directory
    assert _train_fails(tmp_path, "--out", tmp_path / "ck") == (
        f"zmpi train: --out {tmp_path / 'ck'} is a checkpoint directory: give another "
        "directory for the run's record (run.json, metrics.csv); checkpoints go to --ckpt-dir")
    assert _train_fails(tmp_path, "--out", tmp_path / "new", "--save-every", "1",
                        "--ckpt-dir", tmp_path / "new") == (
        f"zmpi train: --out {tmp_path / 'new'} is the checkpoint directory too: give two "
        "directories")


def test_a_lock_file_that_is_a_fifo_is_named(tmp_path):
    """It was `not writable: None`."""
    from zmpi.checkpoint.ownership import LOCK

    (tmp_path / "ck").mkdir()
    os.mkfifo(tmp_path / "ck" / LOCK)
    with pytest.raises(CheckpointError, match=r"ck: cannot be locked: lock file .*\.zmpi-lock: "
                                              r"a FIFO, not a regular file$"):
        _engine().claim_checkpoint_dir(tmp_path / "ck")


# --- 4.6: output paths nothing can be written in, and a disk that fills -------------------

def test_out_and_log_dir_where_nothing_can_be_written_are_one_line(tmp_path):
    """They were a FileNotFoundError traceback from the first write."""
    for flags in (["--log-dir", "/proc"], ["--out", "/proc/x"]):
        line = _cli_fails(["train", *TINY, *flags])
        assert line.startswith(f"zmpi train: {flags[0]} {flags[1]}: cannot write in /proc: ")


def test_out_on_a_disk_that_fills_is_one_line_exit_1(tmp_path, tmpfs):
    """An 8 KiB tmpfs holds the lock and run.json, not metrics.csv too: the OSError of a
    buffered write came from append or close, a traceback."""
    out = tmpfs("size=8k") / "run"
    line = _cli_fails(["train", *TINY, "--out", out], code=1)
    assert line.startswith(f"zmpi train: --out {out}: ") and \
        line.endswith(" not written: No space left on device"), line
    assert not (out / "run.json.tmp").exists()


def test_an_output_link_whose_target_directory_is_missing_says_so(tmp_path):
    from zmpi.files import check_output

    (tmp_path / "link.h5").symlink_to(tmp_path / "gone" / "m.h5")
    with pytest.raises(ValueError, match=f"a link to {tmp_path / 'gone' / 'm.h5'}, whose "
                                         f"directory {tmp_path / 'gone'} does not exist$"):
        check_output(tmp_path / "link.h5", "output")


# --- 4.9: a static fp16 loss scale that skips every step, or flushes every gradient ----------

def test_a_static_loss_scale_that_overflows_every_step_ends_the_run():
    """1e30 skipped every step and the run ended "finished", exit 0, having trained nothing:
    `hysteresis` (2) overflows in a row at a scale that never changes end it."""
    engine = _engine(fp16={"enabled": True, "loss_scale": 1e30})
    _steps(engine, 0, 1)  # skipped
    assert engine.scaler.skipped_steps == 1 and engine.global_steps == 0
    with pytest.raises(FloatingPointError, match=r"at the static fp16.loss_scale 1e\+30, which "
                                                 r"never changes: 2 overflows in a row"):
        _steps(engine, 1, 2)


def test_a_static_loss_scale_that_flushes_every_gradient_ends_the_run():
    engine = _engine(fp16={"enabled": True, "loss_scale": 1e-30})
    with pytest.raises(FloatingPointError, match=r"every gradient is zero at optimizer step 0: "
                                                 r"the static fp16.loss_scale 1e-30 flushes"):
        _steps(engine, 0, 1)
    engine = _engine(fp16={"enabled": True, "loss_scale": 0.5})  # below 1, and trains
    _steps(engine, 0, 2)
    assert engine.global_steps == 2


# --- 4.5: absurd sizes, refused against this machine's memory before anything is allocated -

def test_absurd_sizes_are_one_line_before_any_allocation(tmp_path):
    """--n-layer 1e9 grew memory with no first line; --batch 1e9 was an ArrayMemoryError per
    rank; vocab_size 1e12 NumPy's "Unable to allocate", naming no key."""
    big = "1000000000"
    line = _train_fails(tmp_path, "--n-layer", big)
    assert line.startswith("zmpi train: the model (n_layer 1,000,000,000, d_model 16, "
                           "vocab_size 65: ") and "more than the memory of 1 rank of this " \
        "machine" in line and line.endswith("check --n-layer, --d-model and model.vocab_size")
    config = tmp_path / "c.json"
    config.write_text('{"model": {"vocab_size": 1e12}}')
    assert "vocab_size 1,000,000,000,000: " in _train_fails(tmp_path, "--config", config)
    for flags in (["--batch", big], ["--config", config]):
        config.write_text('{"train_micro_batch_size_per_gpu": 1000000000}')
        line = _train_fails(tmp_path, *flags)
        assert line.startswith("zmpi train: a micro-batch of 1,000,000,000 sequences "
                               "(train_micro_batch_size_per_gpu") and "for its logits alone" \
            in line and line.endswith("check --batch, train_micro_batch_size_per_gpu and "
                                      "model.vocab_size"), line


# --- 4.7: a --data file cut short or rewritten while training reads it ----------------------

_CUT_AT_STEP_2 = """
import os, sys
from zmpi.engine import Engine
data, how = sys.argv[1], sys.argv[2]
steps = []
train_step = Engine.train_step
def cut(self, x, y):
    steps.append(1)
    if len(steps) == 2:  # after step 1's batch was read: the next read is past the file's end
        if how == "cut":
            os.truncate(data, 0)
        else:
            with open(data, "r+b") as f:
                f.write(bytes(64))
    return train_step(self, x, y)
Engine.train_step = cut
from zmpi.cli import main
main(["train", *sys.argv[3:]])
"""


@pytest.mark.parametrize("how", ["cut", "rewritten"])
def test_a_data_file_that_changes_during_training_is_named(tmp_path, how):
    """Cut short, the memory map's next read was a SIGBUS (MPICH's banner, no word of the
    file); rewritten in place, the run trained on other tokens without a word."""
    data = tmp_path / "train.bin"
    (np.arange(200_000) % 65).astype(np.uint16).tofile(data)
    size = data.stat().st_size
    done = subprocess.run([sys.executable, "-c", _CUT_AT_STEP_2, data, how, *TINY[:1], "5",
                           *TINY[2:], "--data", data, "--vocab-size", "65", "--out",
                           tmp_path / "run"], capture_output=True, text=True, timeout=120)
    said = f"cut from {size:,} to 0 bytes" if how == "cut" else "rewritten in place"
    assert done.returncode == 1 and _one_line(done.stderr) == (
        f"zmpi train: --data {data} changed while training reads it ({said}): restore it (or "
        "give the new file) and --resume"), (done.returncode, done.stderr)


# --- 4.8: a resume under another attention layout says so, as for a dtype change -------------

def test_resuming_under_another_sparse_layout_or_dense_is_noted(tmp_path):
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    def engine(section):
        cfg = {"train_micro_batch_size_per_gpu": 2, "sparse_attention": section}
        return Engine(GPT(GPTConfig(16, 16, 1, 2, 16), seed=0, sparse_attention=section or None),
                      cfg)

    saved = {"mode": "fixed", "block": 8, "num_local_blocks": 2}
    first = engine(saved)
    first.train_step(*SyntheticSource(16, 16, 2).sample(0))
    first.save_checkpoint(tmp_path / "c")
    first.close()
    said = json.dumps(saved, sort_keys=True)
    for section, note in (({}, f"attention is dense attention (the checkpoint's run had "
                                f"sparse_attention {said})"),
                          ({"mode": "bslongformer", "block": 8},
                           "attention is sparse_attention {\"block\": 8, \"mode\": "
                           f"\"bslongformer\"}} (the checkpoint's run had sparse_attention "
                           f"{said})"),
                          ({**saved, "attention": "bidirectional"}, None)):  # its default
        notes = [n for n in engine(section).load_checkpoint(tmp_path / "c").notes
                 if n.startswith("attention is")]
        assert notes == ([] if note is None else
                         [note + ": the weights carry over, the layers attend to other "
                          "blocks"]), notes


# --- 4.10: a checkpoint directory that holds another run's tag -------------------------------

def test_resuming_in_a_directory_of_two_runs_names_them(tmp_path):
    import shutil

    a, b = _engine(), _engine()
    _steps(a, 0, 1)
    a.save_checkpoint(tmp_path / "a")
    _steps(b, 0, 2)
    b.save_checkpoint(tmp_path / "b")
    a.close(), b.close()
    shutil.copytree(tmp_path / "b" / "step2", tmp_path / "a" / "step2")  # copied in by hand
    (tmp_path / "a" / "latest").write_text("step2\n")
    loaded = _engine().load_checkpoint(tmp_path / "a")
    assert loaded.run_id == b.run_id
    note = f"{tmp_path / 'a'} holds checkpoints of more than one run: read step2 of run " \
           f"{b.run_id[:12]}; step1 is another run's"
    assert note in loaded.notes, loaded.notes
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main(["ckpt", "verify", str(tmp_path / "a")])
    assert done.value.code == 0 and out.getvalue().splitlines() == [
        "ok: every checksum matches", f"note: {note}"]

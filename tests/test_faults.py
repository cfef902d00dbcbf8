"""Failure behaviour: every injected fault ends the job quickly with a clear message (or, for
preemption, with a checkpoint and exit 0). Each launch has a hard timeout, so a hang fails.

Faults on 2 ranks (tests/ranks/faults.py): collectives of different sizes or dtypes with the
debug check, a rank that skips a collective (watchdog), a stage-3 collective called on rank 0
only, divergence of replicated state, a NaN in one unit's gradient, a bad token id on one rank,
fp16 overflow at the minimum loss scale. Then bad input in one process, SIGTERM preemption with
an exact resume, Ctrl-C, and the run record of a killed run.
"""
import json
import signal
import time

import numpy as np
import pytest
from mpi_util import RANKS_DIR, REPO_ROOT, finish_mpi, launch_mpi, start_mpi

from zmpi.models.gpt import GPT, GPTConfig

FAULTS = {  # mode: (env, exit code, every message that must appear in stderr)
    "mismatch_count": ({"ZMPI_DEBUG": "1"}, 1, [
        "CollectiveMismatch: the ranks called different collectives on a 2-rank communicator",
        "rank 0: call #1 allreduce(sum) float32 x 0/8 at tests/ranks/faults.py",
        "rank 1: call #1 allreduce(sum) float32 x 0/6 at tests/ranks/faults.py"]),
    "mismatch_dtype": ({"ZMPI_DEBUG": "1"}, 1, ["rank 0: call #1 allreduce(sum) float32 x 0/8",
                                                "rank 1: call #1 allreduce(sum) float64 x 0/8"]),
    # rank 1 (in a barrier) says so too, unless the abort outruns its output
    "skip": ({"ZMPI_COLLECTIVE_TIMEOUT": "2"}, 3, [
        "[rank 0] zmpi watchdog: waited 2 s (ZMPI_COLLECTIVE_TIMEOUT) in allreduce(sum) "
        "(float32 x 4, 2 ranks), called at tests/ranks/faults.py"]),
    "gather_on_rank0": ({"ZMPI_DEBUG": "1"}, None, [
        "rank 0: call #3 allgather float32", "in full_master (from tests/ranks/faults.py",
        "rank 1: call #3 end of program at exit"]),
    "diverge": ({}, 1, ["RuntimeError: replicas diverged after step 2: params of unit 1 "
                        "(Block) differs between the ranks of the world group: ranks [0] hold "
                        "copy 0; ranks [1] hold copy 1"]),
    "nan": ({}, 1, ["FloatingPointError: non-finite gradients at optimizer step 0 (0 skipped "
                    "before; float32); the first in backward order is in unit 1 (Block: "
                    "units.1.attn.proj.bias"]),
    "bad_ids_on_rank1": ({}, 1, ["[rank 1] IndexError: inputs (token ids) must be in [0, 16), "
                                 "found -1"]),
    "min_scale": ({}, 1, ["loss scale already at its minimum 1); the first in backward order "
                          "is in unit 3 (LMHead"]),
}


@pytest.mark.mpi
@pytest.mark.parametrize("mode", FAULTS)
def test_fault_ends_the_job_quickly_and_clearly(mode):
    env, code, messages = FAULTS[mode]
    result = launch_mpi(RANKS_DIR / "faults.py", 2, args=[mode], timeout=60, env=env)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0 and (code is None or result.returncode == code), \
        result.describe()
    assert result.seconds < (15 if mode == "skip" else 10), result.describe()
    for message in messages:
        assert message in result.stderr, (message, result.describe())
    assert "UNREACHABLE" not in result.stdout


CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8)


@pytest.mark.parametrize("inputs,targets,error,message", [
    (np.full((2, 8), 16), None, IndexError, r"inputs \(token ids\) must be in \[0, 16\), found 16"),
    (np.full((2, 8), -3), None, IndexError, r"inputs \(token ids\) must be in \[0, 16\), found -3"),
    (np.zeros((2, 8), np.float32), None, TypeError, r"inputs \(token ids\) must be integer ids in "
                                                     r"\[0, 16\), got dtype float32"),
    (np.zeros((2, 8, 1), int), None, ValueError, r"inputs must be \(batch, time <= 8\) token ids, "
                                                  r"got shape \(2, 8, 1\)"),
    (np.zeros((2, 9), int), None, ValueError, r"time <= 8"),
    (np.zeros((2, 8), int), np.zeros((2, 7), int), ValueError, r"inputs \(2, 8\) and targets "
                                                                r"\(2, 7\) differ"),
    (np.zeros((2, 8), int), np.full((2, 8), -100), IndexError, r"targets \(token ids\) must be "
                                                                r"in \[0, 16\), found -100"),
    (np.zeros((3, 8), int), None, ValueError, r"train_step got 3 input and 3 target rows"),
])
def test_bad_input_is_rejected_before_any_collective(inputs, targets, error, message):
    from zmpi.engine import Engine

    engine = Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2,
                               "zero_optimization": {"stage": 3}})
    engine.comm.reset_counters()
    targets = np.zeros(inputs.shape[:2], int) if targets is None else targets
    with pytest.raises(error, match=message):
        engine.train_step(inputs, targets)
    assert not any(c["calls"] for c in engine.comm.counters_snapshot().values())


def test_ignore_index_targets_pass_the_check():
    from zmpi.engine import Engine
    from zmpi.nn import CrossEntropyLoss

    model = GPT(CFG)
    model.loss_fn = CrossEntropyLoss(ignore_index=-100)
    engine = Engine(model, {"train_micro_batch_size_per_gpu": 2})
    targets = np.zeros((2, 8), int)
    targets[0, :3] = -100
    engine.train_step(np.zeros((2, 8), int), targets)


TRAIN = ["train", "--n-layer", "1", "--d-model", "32", "--seq-len", "32", "--sample-tokens", "5",
         "--stage", "2", "--precision", "fp16"]


def _wait_for_rows(path, rows, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) > rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {rows} rows")


@pytest.mark.mpi
def test_sigterm_saves_a_checkpoint_exits_0_and_resume_equals_an_uninterrupted_run(tmp_path):
    from zmpi.checkpoint.tools import consolidate

    cli, steps = REPO_ROOT / "zmpi" / "cli.py", 600
    whole = launch_mpi(cli, 2, timeout=180, args=[*TRAIN, "--steps", steps, "--save-every",
                                                  steps, "--out", tmp_path / "whole"])
    assert whole.returncode == 0, whole.describe()
    proc = start_mpi(cli, 2, args=[*TRAIN, "--steps", steps, "--save-every", steps,
                                   "--out", tmp_path / "cut"])
    _wait_for_rows(tmp_path / "cut" / "metrics.csv", 20, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # to mpiexec, which forwards it to every rank
    cut = finish_mpi(proc, 60)
    assert cut.returncode == 0, cut.describe()
    assert time.monotonic() - sent < 10
    run = json.loads((tmp_path / "cut" / "run.json").read_text())
    assert run["status"] == "preempted" and "SIGTERM: stopped after step" in cut.stdout
    stopped = run["last_step"] + 1
    assert 20 <= stopped < steps
    assert len((tmp_path / "cut" / "metrics.csv").read_text().splitlines()) == stopped + 1
    resumed = launch_mpi(cli, 2, timeout=180, args=[*TRAIN, "--steps", steps, "--save-every",
                                                    steps, "--out", tmp_path / "cut",
                                                    "--resume"])
    assert resumed.returncode == 0, resumed.describe()
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["status"] == "finished"
    rows = (tmp_path / "cut" / "metrics.csv").read_text().splitlines()
    assert len(rows) == steps + 1 and rows[0].startswith("step,")  # appended, one header
    a = consolidate(tmp_path / "whole" / "checkpoints", tmp_path / "a.npz", npz=True)
    b = consolidate(tmp_path / "cut" / "checkpoints", tmp_path / "b.npz", npz=True)
    with np.load(a) as fa, np.load(b) as fb:
        assert sorted(fa.files) == sorted(fb.files)
        for k in fa.files:
            np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.mark.mpi
def test_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    proc = start_mpi(REPO_ROOT / "zmpi" / "cli.py", 2,
                     args=[*TRAIN, "--steps", 100000, "--out", tmp_path / "run"])
    _wait_for_rows(tmp_path / "run" / "metrics.csv", 5, proc)
    proc.send_signal(signal.SIGINT)
    result = finish_mpi(proc, 30)
    assert result.returncode != 0 and not result.timed_out, result.describe()
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, \
        result.describe()
    assert result.stderr.count("zmpi: interrupted; ending all 2 ranks") == 1
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["status"] == "running"  # killed: run.json from the start, metrics up to now
    assert len((tmp_path / "run" / "metrics.csv").read_text().splitlines()) > 5

"""Failure behaviour: every injected fault ends the job quickly with a clear message (or, for
preemption, with a checkpoint and exit 0). Each launch has a hard timeout, so a hang fails.

Faults on 2 ranks (tests/ranks/faults.py): collectives of different sizes or dtypes with the
debug check, a rank that skips a collective (watchdog), a stage-3 collective called on rank 0
only, divergence of replicated state, a NaN in one unit's gradient, a bad token id on one rank,
fp16 overflow at the minimum loss scale; a rank stopped (SIGSTOP) when another aborts, with
the launcher unable to clean up. Then bad input in one process, SIGTERM preemption with an
exact resume, Ctrl-C, the run record of a killed run, metrics.csv after a resume from an older
checkpoint, and the constant state `zmpi train` keeps per run.
"""
import json
import os
import shutil
import signal
import sys
import time
from collections import deque

import numpy as np
import pytest
from mpi_util import CLI, RANKS_DIR, finish_mpi, launch_mpi, start_mpi

from zmpi.comm import mpi_flavour
from zmpi.models.gpt import GPT, GPTConfig

FAULTS = {  # mode: (env, exit code, every message that must appear in stderr)
    "mismatch_count": ({"ZMPI_DEBUG": "1"}, 1, [
        "CollectiveMismatch: the ranks called different collectives on a 2-rank communicator",
        "rank 0: call #1 allreduce(sum) float32 x 0/8 at tests/ranks/faults.py",
        "rank 1: call #1 allreduce(sum) float32 x 0/6 at tests/ranks/faults.py"]),
    "mismatch_dtype": ({"ZMPI_DEBUG": "1"}, 1, ["rank 0: call #1 allreduce(sum) float32 x 0/8",
                                                "rank 1: call #1 allreduce(sum) float64 x 0/8"]),
    # rank 1 enters its barrier 1.5 s late, so rank 0's watchdog fires first and aborts
    "skip": ({"ZMPI_COLLECTIVE_TIMEOUT": "2"}, 3, [  # waited 2 s, or 3 on a busy machine
        "[rank 0] zmpi watchdog: waited ",
        " s (ZMPI_COLLECTIVE_TIMEOUT) in allreduce(sum) (float32 x 4, 2 ranks), called at "
        "tests/ranks/faults.py"]),
    "gather_on_rank0": ({"ZMPI_DEBUG": "1"}, None, [
        "rank 0: call #5 allgather float32", "in full_master (from tests/ranks/faults.py",
        "rank 1: call #5 end of program at exit"]),
    "diverge": ({}, 1, ["RuntimeError: replicas diverged after step 2: params of unit 1 "
                        "(Block) differs between the ranks of the data-parallel group: ranks [0] "
                        "hold copy 0; ranks [1] hold copy 1"]),
    "nan": ({}, 1, ["FloatingPointError: non-finite gradients at optimizer step 0 (0 skipped "
                    "before; float32); the first in backward order is in unit 1 (Block: "
                    "units.1.attn.proj.bias"]),
    "nan_pp": ({}, 1, ["the first in backward order is in unit 1 (Block: units.1.attn.proj.bias, "
                       "units.1.attn.proj.weight, units.1.attn.qkv.bias, ...) of pipeline stage 0 "
                       "of 2"]),  # stage 1's unit 1 (units.2) was named, or an IndexError
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
    # ends, not hangs: the launch's timeout is the only bound (a time to exit is no pass/fail
    # on a loaded machine; docs/failures.md gives the times measured)
    for message in messages:
        assert message in result.stderr, (message, result.describe())
    assert "UNREACHABLE" not in result.stdout


def _proc(pid, field):
    """Field `field` (0: state letter, 1: parent pid) of /proc/pid/stat, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[field]
    except (OSError, IndexError):
        return None


def _wait_until(condition, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill_if(pid, name):
    """SIGKILL `pid` if it is still a process whose command line holds `name`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if name.encode() in f.read():
                os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
@pytest.mark.skipif(mpi_flavour() != "MPICH", reason="stops MPICH's Hydra proxy (its "
                    "process tree); Open MPI's prted cleans up after an abort itself")
def test_an_abort_ends_a_stopped_rank_even_where_the_launcher_does_not(tmp_path):
    """Rank 1 stops itself (SIGSTOP) and rank 0's watchdog aborts the job. MPICH's mpiexec
    returns as soon as the abort reaches it; its proxy SIGKILLs the ranks only after that, and
    each rank has a session of its own, so where the proxy cannot act then (stopped here; a
    batch system ending mpiexec's process group) the stopped rank stayed behind for ever.
    The aborting rank now ends the job's other ranks on its host itself."""
    proc = start_mpi(RANKS_DIR / "faults.py", 2, args=["stopped"],
                     env={"ZMPI_COLLECTIVE_TIMEOUT": "1", "ZMPI_REPORT_DIR": str(tmp_path)})
    pids, proxy = [], None
    try:
        reports = [tmp_path / f"rank-{r}.json" for r in (0, 1)]
        _wait_until(lambda: all(p.exists() for p in reports) or proc.poll() is not None,
                    "both ranks' pids")
        pids = [json.loads(p.read_text())["pid"] for p in reports]
        _wait_until(lambda: _proc(pids[1], 0) == "T", "rank 1 to stop")
        proxy = int(_proc(pids[0], 1))
        assert proxy != proc.pid and int(_proc(pids[1], 1)) == proxy
        os.kill(proxy, signal.SIGSTOP)  # the launcher can no longer clean up
        _wait_until(lambda: _proc(pids[0], 0) in ("Z", None), "rank 0 to end after its abort")
        assert _proc(pids[1], 0) in ("Z", None), "the stopped rank outlived the abort"
    finally:
        for pid in pids:
            _kill_if(pid, "faults.py")
        if proxy is not None:
            _kill_if(proxy, "hydra_pmi_proxy")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


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


# the preemption signal to send the launcher: Hydra forwards SIGTERM and waits for the ranks;
# Open MPI's mpirun forwards it and then ends the job, but only forwards SIGUSR1
# (docs/failures.md)
PREEMPT = signal.SIGTERM if mpi_flavour() == "MPICH" else signal.SIGUSR1


@pytest.mark.mpi
def test_sigterm_saves_a_checkpoint_exits_0_and_resume_equals_an_uninterrupted_run(tmp_path):
    from zmpi.checkpoint.tools import consolidate

    steps = 600
    whole = launch_mpi(CLI, 2, timeout=180, args=[*TRAIN, "--steps", steps, "--save-every",
                                                  steps, "--out", tmp_path / "whole"])
    assert whole.returncode == 0, whole.describe()
    proc = start_mpi(CLI, 2, args=[*TRAIN, "--steps", steps, "--save-every", steps,
                                   "--out", tmp_path / "cut"])
    _wait_for_rows(tmp_path / "cut" / "metrics.csv", 20, proc)
    proc.send_signal(PREEMPT)  # to mpiexec, which forwards it to every rank
    cut = finish_mpi(proc, 60)  # within the step and the save: the timeout bounds it
    assert cut.returncode == 0, cut.describe()
    run = json.loads((tmp_path / "cut" / "run.json").read_text())
    stopped = run["last_step"] + 1  # metrics.csv's step column counts from 0
    assert 20 <= stopped < steps
    # the line and the checkpoint's tag count the steps done alike (it said "after step 105"
    # beside step106)
    assert run["status"] == "preempted" and f"{PREEMPT.name}: stopped after {stopped} steps " \
        f"(checkpoint step{stopped}); go on with --resume" in cut.stdout, cut.stdout[-500:]
    assert (tmp_path / "cut" / "checkpoints" / f"step{stopped}").is_dir()
    assert len((tmp_path / "cut" / "metrics.csv").read_text().splitlines()) == stopped + 1
    resumed = launch_mpi(CLI, 2, timeout=180, args=[*TRAIN, "--steps", steps, "--save-every",
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
    proc = start_mpi(CLI, 2,
                     args=[*TRAIN, "--steps", 100000, "--out", tmp_path / "run"])
    _wait_for_rows(tmp_path / "run" / "metrics.csv", 5, proc)
    proc.send_signal(signal.SIGINT)
    result = finish_mpi(proc, 30)
    assert result.returncode != 0 and not result.timed_out, result.describe()
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, \
        result.describe()
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    if mpi_flavour() == "MPICH":  # Hydra forwards SIGINT: zmpi's line, every rank ended
        assert result.stderr.count("zmpi: interrupted; ending all 2 ranks") == 1
        # rank 0 writes "interrupted" unless the job's end (another rank's abort) kills it first
        assert run["status"] in ("interrupted", "running"), run["status"]
    else:  # Open MPI's mpirun sends the ranks SIGTERM (a preemption, if they get to it)
        assert run["status"] in ("interrupted", "running", "preempted"), run["status"]
    assert len((tmp_path / "run" / "metrics.csv").read_text().splitlines()) > 5


SMALL = ["train", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8",
         "--batch", "4", "--sample-tokens", "5"]


def _steps(run_dir):
    return [int(line.split(",")[0])
            for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]


@pytest.mark.mpi
def test_a_resumed_run_drops_the_metrics_rows_it_does_again(tmp_path):
    """A run killed after its step-4 checkpoint had written the rows of steps 4 and 5 (the
    step-6 save never happened); --resume into the same --out goes on from step 4 and used to
    append steps 4 and 5 again. Now each step is in metrics.csv once, run.json says what was
    dropped, and the last line's losses are the run's own first and last rows."""
    run = tmp_path / "run"
    first = launch_mpi(CLI, 2, timeout=120, args=[*SMALL, "--steps", 6, "--save-every", 4,
                                                  "--out", run])
    assert first.returncode == 0, first.describe()
    shutil.rmtree(run / "checkpoints" / "step6")  # as if killed before the step-6 save
    (run / "checkpoints" / "latest").write_text("step4")
    assert _steps(run) == [0, 1, 2, 3, 4, 5]
    resumed = launch_mpi(CLI, 2, timeout=120, args=[*SMALL, "--steps", 8, "--out", run,
                                                    "--resume"])
    assert resumed.returncode == 0, resumed.describe()
    assert "step 4" in resumed.stdout, resumed.describe()
    assert _steps(run) == list(range(8))
    meta = json.loads((run / "run.json").read_text())
    assert meta["first_step"] == 4 and meta["metrics_truncated_from"] == 4
    assert meta["metrics_rows_dropped"] == 2 and meta["steps_run"] == 4
    losses = [float(line.split(",")[1])
              for line in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert f"loss {losses[4]:.3f} -> {losses[7]:.3f} (val " in resumed.stdout
    assert meta["first_loss"] == losses[4] and meta["last_loss"] == losses[7]
    assert meta["mean_loss"] == pytest.approx(sum(losses[4:]) / 4)


def test_run_record_drops_rows_from_its_first_step_and_a_torn_row(tmp_path):
    from types import SimpleNamespace

    from zmpi.runinfo import RunRecord

    path = tmp_path / "metrics.csv"
    rows = ["step,loss,tokens_per_s,loss_scale,lr,skipped_steps"] + [
        f"{s},{4 - s / 10},100.0,1.0,0.003,0" for s in range(6)]
    path.write_bytes(("\r\n".join(rows) + "\r\n" + "6,3.3,1").encode())  # killed mid-row
    record = RunRecord(tmp_path, SimpleNamespace(rank=0, size=1), first_step=3)
    record.append((3, 3.5, 100.0, 1.0, 0.003, 0))
    record.close(status="finished")
    assert path.read_text().splitlines() == rows[:4] + ["3,3.5,100.0,1.0,0.003,0"]
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["metrics_truncated_from"] == 3 and meta["metrics_rows_dropped"] == 4
    assert not (tmp_path / "metrics.csv.tmp").exists()
    RunRecord(tmp_path, SimpleNamespace(rank=0, size=1), first_step=9).close()  # nothing to drop
    assert "metrics_truncated_from" not in json.loads((tmp_path / "run.json").read_text())
    assert len(path.read_text().splitlines()) == 5


def test_step_summary_keeps_constant_state():
    from zmpi.runinfo import StepSummary

    summary = StepSummary()
    assert summary.as_dict() == {"steps_run": 0, "first_loss": None, "last_loss": None,
                                 "mean_loss": None}
    for step in range(10_000):
        summary.add(np.float32(5 - step / 10_000))
    assert not hasattr(summary, "__dict__")  # four numbers, whatever the number of steps
    assert summary.steps == 10_000 and summary.first_loss == 5.0
    assert summary.last_loss == pytest.approx(4.0001)
    assert summary.mean_loss == pytest.approx(4.50005)


def test_train_keeps_no_per_step_state(tmp_path, monkeypatch):
    """What `zmpi train` holds at the end of the loop does not grow with the number of steps
    (it kept a ~300-byte tuple per step in a list for the whole run)."""
    from zmpi import cli, runinfo

    held = []
    close = runinfo.RunRecord.close

    def spy(self, **fields):  # called by train() at the end of the run
        held.append({name: len(value) for name, value in sys._getframe(1).f_locals.items()
                     if isinstance(value, (list, tuple, dict, set, deque))})
        return close(self, **fields)

    monkeypatch.setattr(runinfo.RunRecord, "close", spy)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:  # one rank, in this process
        for steps in (3, 9):
            cli.main([*map(str, SMALL), "--sample-tokens", "2", "--steps", str(steps),
                      "--out", str(tmp_path / str(steps))])
    finally:
        for s, h in handlers.items():  # zmpi train's PreemptionGuard took them
            signal.signal(s, h)
    assert len(held) == 2 and held[0] == held[1], held


def test_the_ranks_stderr_leaves_out_open_mpis_launcher():
    """What the one-line tests compare under Open MPI: its launcher's report below the ranks'
    lines and its runtime's PMIx line (as seen there) are not the ranks'."""
    from mpi_util import MPIResult

    dashes = "-" * 74
    stderr = "\n".join([
        "zmpi train: --steps must be >= 1, got 0",
        "[vm:23410] PMIX ERROR: PMIX_ERR_UNREACH in file pmix_server.c at line 3146", dashes,
        "prterun detected that one or more processes exited with non-zero status, thus",
        "causing the job to be terminated. The first process to do so was:", "",
        "   Process name: [prterun-vm-19474@1,0]", "   Exit code:    2", dashes, ""])
    result = MPIResult(2, "", stderr, 1.0, False)
    assert result.ranks_stderr() == ["zmpi train: --steps must be >= 1, got 0"]
    assert MPIResult(2, "", "a\n\n--- b\n", 1.0, False).ranks_stderr() == ["a", "--- b"]


HANGING_RANKS = """
import time
from mpi4py import MPI


def wait_for_the_other_rank():
    MPI.COMM_WORLD.Barrier()


def never_arrive():
    time.sleep(600)


never_arrive() if MPI.COMM_WORLD.Get_rank() == 1 else wait_for_the_other_rank()
"""


@pytest.mark.mpi
def test_a_timed_out_launch_says_where_each_rank_was(tmp_path):
    """A hung job fails with each rank's Python stack (faulthandler on SIGABRT), not with
    empty output: rank 0 in its barrier, rank 1 in its sleep."""
    script = tmp_path / "hang.py"
    script.write_text(HANGING_RANKS)
    result = launch_mpi(script, 2, timeout=8)
    assert result.timed_out and result.returncode is None, result.describe()
    assert "wait_for_the_other_rank" in result.stderr, result.describe()
    assert "never_arrive" in result.stderr, result.describe()


def test_a_run_that_raises_says_failed_in_run_json(tmp_path):
    """RunRecord as a context: an exception before close (a save refused on preemption, a
    non-finite loss) leaves run.json "failed" with the error, not "running"; a closed run
    keeps its status."""
    from types import SimpleNamespace

    from zmpi.runinfo import RunRecord

    rank0 = SimpleNamespace(rank=0, size=1)
    with pytest.raises(RuntimeError), RunRecord(tmp_path / "a", rank0):
        raise RuntimeError("the lock is held")
    meta = json.loads((tmp_path / "a" / "run.json").read_text())
    assert meta["status"] == "failed" and meta["error"] == "RuntimeError: the lock is held"
    with RunRecord(tmp_path / "b", rank0) as record:
        record.close(status="preempted")
    assert json.loads((tmp_path / "b" / "run.json").read_text())["status"] == "preempted"


def _main_in_process(*argv):
    """`zmpi train SMALL argv` in this process (one rank): (exit code, stderr)."""
    import contextlib
    import io

    from zmpi import cli

    err, handlers = io.StringIO(), {s: signal.getsignal(s) for s in (signal.SIGTERM,
                                                                     signal.SIGUSR1)}
    try:
        with contextlib.redirect_stderr(err):
            cli.main([*map(str, SMALL), *map(str, argv)])
        return 0, err.getvalue()
    except SystemExit as e:
        return e.code, err.getvalue()
    finally:
        for s, h in handlers.items():  # zmpi train's PreemptionGuard took them
            signal.signal(s, h)


def test_resume_into_another_runs_out_is_refused(tmp_path):
    """Issue 49: runs X and Y, each with its own --out; resuming Y with --out X spliced Y's
    steps into X's metrics.csv and replaced X's run.json. run.json names its run (the run id
    a resumed run takes from its checkpoint), so that is refused in one line (exit 2) with X
    untouched, while Y resumes into its own --out."""
    x, y = tmp_path / "x", tmp_path / "y"
    for out in (x, y):
        assert _main_in_process("--steps", 2, "--save-every", 2, "--out", out)[0] == 0
    ids = {out: json.loads((out / "run.json").read_text())["run_id"] for out in (x, y)}
    assert len(set(ids.values())) == 2 and all(len(i) == 32 for i in ids.values())
    kept = {name: (x / name).read_bytes() for name in ("run.json", "metrics.csv")}
    code, err = _main_in_process("--steps", 4, "--resume", y / "checkpoints", "--out", x)
    assert code == 2 and err == (
        f"zmpi train: --out {x} holds another run's record (run {ids[x][:12]}; this run is "
        f"{ids[y][:12]}): give another directory (a resumed run goes on in the --out of the "
        "run that saved its checkpoint)\n")
    assert kept == {name: (x / name).read_bytes() for name in kept}
    assert _main_in_process("--steps", 4, "--resume", "--out", y)[0] == 0
    meta = json.loads((y / "run.json").read_text())
    assert meta["run_id"] == ids[y] and meta["first_step"] == 2
    assert [int(row.split(",")[0]) for row in
            (y / "metrics.csv").read_text().splitlines()[1:]] == [0, 1, 2, 3]


class _World:
    """COMM_WORLD as `faults` sees it, for a rank of a job that must not really abort."""

    def __init__(self, rank, size, events):
        self.rank, self.size, self.events = rank, size, events

    def Get_rank(self):  # noqa: N802 (mpi4py's names)
        return self.rank

    def Get_size(self):  # noqa: N802
        return self.size

    def Abort(self, code):  # noqa: N802
        self.events.append(("abort", code))
        raise _Aborted


class _Aborted(Exception):
    pass


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("path", ["ctrl-c", "watchdog", "fail_alone", "exception"])
def test_every_abort_removes_the_swap_files_before_it_waits(monkeypatch, path, rank):
    """Issue 56: across hosts, the first rank's abort has mpiexec kill the ranks of every
    host. Ctrl-C's non-zero ranks waited a second, the watchdog two, an exception a quarter,
    before the removals (`at_abort`) that `_abort` ran: the second host's swap files stayed.
    Every path to an abort now runs them before any wait."""
    from types import SimpleNamespace

    from zmpi.comm import faults, watchdog

    events = []
    world = SimpleNamespace(COMM_WORLD=_World(rank, 4, events), Is_finalized=lambda: False,
                            Is_initialized=lambda: True)
    monkeypatch.setattr(faults, "MPI", world)
    monkeypatch.setattr(watchdog, "MPI", world)
    monkeypatch.setattr(faults, "_AT_ABORT", [lambda: events.append("removed")])
    monkeypatch.setattr(faults.time, "sleep", lambda s: events.append(("sleep", s)))
    monkeypatch.setattr(faults, "_end_local_peers", lambda: None)
    with pytest.raises(_Aborted):
        if path == "ctrl-c":
            assert not faults._INTERRUPT.locked()  # as the first SIGINT finds it
            try:
                faults._interrupted()
            finally:
                faults._INTERRUPT.release()
        elif path == "watchdog":
            watchdog._Watchdog._expire("an allreduce", sys._getframe(), 5.0)
        elif path == "fail_alone":
            faults.fail_alone("a swap file failed its checksum", 1)
        else:  # the hook an uncaught exception runs
            monkeypatch.setattr(faults, "_abort_installed", False)
            monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
            monkeypatch.setattr(faults, "_watch_interrupts", lambda: None)
            faults.install_abort_on_exception()
            sys.excepthook(ValueError, ValueError("boom"), None)
    waits = [e for e in events if e[0] == "sleep"]
    assert waits and events[0] == "removed" and events[-1][0] == "abort", events
    assert events.count("removed") == 1, events  # once per abort, however many paths call it


def test_run_json_names_the_hosts_and_their_ranks(tmp_path):
    """Issue 56: run.json recorded no hostname or node count. Across two hosts:
    tests/test_twohost.py; here one rank, and four ranks on two hosts as gathered."""
    import socket
    from types import SimpleNamespace

    from zmpi.runinfo import RunRecord, rank_hosts, run_metadata

    RunRecord(tmp_path, SimpleNamespace(rank=0, size=1)).close(status="finished")
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["nodes"] == 1 and meta["hosts"] == {socket.gethostname(): [0]}
    four = SimpleNamespace(rank=0, size=4, allgather_object=lambda _: ["b", "a", "b", "a"])
    assert rank_hosts(four) == {"b": [0, 2], "a": [1, 3]}
    meta = run_metadata(four, rank_hosts(four))
    assert meta["nodes"] == 2 and list(meta["hosts"]) == ["b", "a"]

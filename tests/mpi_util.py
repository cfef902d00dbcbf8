"""Launch a rank script under mpiexec from a test and collect what each rank reports.

    from mpi_util import RANKS_DIR, run_mpi
    reports = run_mpi(RANKS_DIR / "comm_checks.py", nprocs=3)   # list of dicts, by rank

The rank script prints one `ZMPI_REPORT <json>` line per rank via `tests/ranks/_report.py`
(`from _report import report`), which also writes it to `$ZMPI_REPORT_DIR/rank-<r>.json`
(set here), because mpiexec may interleave long lines from different ranks.
Every launch has a hard timeout: on expiry each rank writes its Python stacks to stderr
(faulthandler, on SIGABRT; no core file), every process of the job is killed, and the test
fails with the output so far; a non-zero exit fails the test with stdout and stderr.
Use `launch_mpi` to examine a run that is expected to fail.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from zmpi.comm import mpi_flavour

REPO_ROOT = Path(__file__).resolve().parent.parent
RANKS_DIR = Path(__file__).resolve().parent / "ranks"
CLI = REPO_ROOT / "zmpi" / "cli" / "__main__.py"  # `python -m zmpi.cli`, launched by path
PREFIX = "ZMPI_REPORT "

# what the suite's MPI (and its launcher) is called where the tests name it: MPICH's (the
# `mpich` wheel's Hydra) or Open MPI's
OPEN_MPI = mpi_flavour() == "Open MPI"
LOCAL_RANK_VARIABLE = "OMPI_COMM_WORLD_LOCAL_RANK" if OPEN_MPI else "MPI_LOCALRANKID"
CUDA_QUERY = "MPIX_Query_cuda_support" if OPEN_MPI else "MPIX_GPU_query_support"
OPEN_MPI_RUNTIME = re.compile(r"\[[\w.-]+:\d+\] (PMIX|PRTE) ")  # its runtime's lines
# kept in a child's minimal environment: Open MPI does not start (even a singleton) without
# HOME and PATH, nor as root without OMPI_ALLOW_RUN_AS_ROOT*; MCA / CVAR settings the caller
# chose stay in force, and the suite's ZMPI_NUMBA (tests/conftest.py)
KEPT_IN_CHILDREN = ("HOME", "PATH", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_", "PRTE_MCA_",
                    "MPIR_CVAR_", "ZMPI_NUMBA")


def child_env(**env) -> dict:
    """The environment of a Python a test starts directly (not under mpiexec): `env`, one
    BLAS thread, and what MPI needs from this process's (KEPT_IN_CHILDREN), nothing else."""
    kept = {k: v for k, v in os.environ.items() if k.startswith(KEPT_IN_CHILDREN)}
    return {**kept, "OMP_NUM_THREADS": "1", **env}


# the strict CuPy stand-in (tests/standin) in place of CuPy
STANDIN = child_env(PYTHONPATH=f"{REPO_ROOT / 'tests' / 'standin'}:{REPO_ROOT}",
                    ZMPI_BACKEND="cupy")


def mpiexec_path() -> str:
    """mpiexec next to the running interpreter (the venv's mpich wheel), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found next to sys.executable or on PATH")
    return found


@dataclass
class MPIResult:
    returncode: int | None  # None: killed on timeout
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def ranks_stderr(self) -> list[str]:
        """The non-blank lines of stderr that the ranks wrote: without the report Open MPI's
        launcher adds below them when a rank exits non-zero (a block between lines of
        dashes: "prterun detected that one or more processes exited with non-zero
        status, ...") and its runtime's own lines ("[host:pid] PMIX ERROR: ..." as the job
        ends). MPICH's Hydra adds nothing there."""
        lines, in_report = [], False
        for line in self.stderr.splitlines():
            text = line.strip()
            if len(text) >= 20 and set(text) == {"-"}:
                in_report = not in_report
            elif text and not in_report and not OPEN_MPI_RUNTIME.match(text):
                lines.append(line)
        return lines

    def describe(self) -> str:
        return (f"returncode={self.returncode} after {self.seconds:.1f}s"
                f"{' (TIMED OUT, killed)' if self.timed_out else ''}\n"
                f"--- stdout ---\n{self.stdout}\n--- stderr ---\n{self.stderr}")


def _no_core_files() -> None:
    """In the launched job: a rank aborted for its stacks (`finish_mpi`) leaves no core."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def start_mpi(script, nprocs: int, args=(), env=None) -> subprocess.Popen:
    """Start `mpiexec -n nprocs python script *args` (its own process group) and return it;
    finish it with `finish_mpi`. The child gets OMP_NUM_THREADS=1, the repo root prepended to
    PYTHONPATH, PYTHONFAULTHANDLER=1 unless set, and `env` on top."""
    full_env = dict(os.environ)
    full_env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    path = full_env.get("PYTHONPATH")
    full_env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
    full_env.setdefault("PYTHONFAULTHANDLER", "1")  # stacks on SIGABRT (`finish_mpi`)
    full_env.update(env or {})
    cmd = [mpiexec_path(), "-n", str(nprocs), sys.executable, str(script), *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=REPO_ROOT, start_new_session=True,
                            preexec_fn=_no_core_files)
    proc.started = time.monotonic()
    return proc


def launch_mpi(script, nprocs: int, args=(), timeout: float = 120, env=None) -> MPIResult:
    """Run `mpiexec -n nprocs python script *args` with a hard timeout; never raises on failure
    (see `start_mpi`)."""
    return finish_mpi(start_mpi(script, nprocs, args, env), timeout)


STACK_DUMP_SECONDS = 10  # what a timed-out job's ranks get to write their stacks


def _processes() -> dict[int, tuple[int, bytes]]:
    """Every readable process: pid -> (parent pid, argv[0])."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:  # gone, or not ours to read
                continue
            found[int(entry.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), argv0)
    return found


def _job_processes(launcher: int) -> dict[int, bytes]:
    """The processes below process `launcher` (a `start_mpi` job: its proxies put the ranks
    in sessions of their own, and a rank may start processes of its own): pid -> argv[0]."""
    processes = _processes()
    below, frontier = set(), {launcher}
    while frontier:
        frontier = {pid for pid, (parent, _) in processes.items() if parent in frontier}
        below |= frontier
    return {pid: processes[pid][1] for pid in below}


def _send(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def finish_mpi(proc: subprocess.Popen, timeout: float) -> MPIResult:
    """Wait for a `start_mpi` job at most `timeout` seconds; then abort its ranks, each
    writing its stacks to stderr, and kill whatever of the job is left."""
    start = proc.started
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        job = _job_processes(proc.pid)  # found while the ranks live: their children too
        # SIGABRT: under faulthandler (PYTHONFAULTHANDLER, set by `start_mpi`) each rank
        # writes every thread's stack to stderr, so a hang says where each rank was
        ranks = [pid for pid, argv0 in job.items() if argv0 == os.fsencode(sys.executable)]
        _send(ranks, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=STACK_DUMP_SECONDS if ranks else 0)
        except subprocess.TimeoutExpired:
            out = err = None
        _send([proc.pid, *job], signal.SIGKILL)  # whatever of the job is left
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if out is None:  # all the output, that before the timeout included
            out, err = proc.communicate(timeout=STACK_DUMP_SECONDS)
        timed_out = True
    seconds = time.monotonic() - start
    return MPIResult(None if timed_out else proc.returncode, out, err, seconds, timed_out)


def said_by_ranks(tmp_path, source: str, nprocs: int = 2, timeout: float = 60) -> list[str]:
    """Run the rank script `source` (written to `tmp_path`, which it gets as sys.argv[1]) on
    `nprocs` ranks; fail the test on a timeout or a non-zero exit; return what each rank
    wrote to `tmp_path/rank<r>.txt` (files, as the ranks' stdout lines may interleave)."""
    script = tmp_path / "ranks.py"
    script.write_text(source)
    result = launch_mpi(script, nprocs, [tmp_path], timeout=timeout)
    if result.returncode != 0:
        pytest.fail(f"mpiexec -n {nprocs} {script} failed\n" + result.describe())
    return [(tmp_path / f"rank{r}.txt").read_text() for r in range(nprocs)]


def parse_reports(stdout: str, report_dir=None) -> list[dict]:
    """Each rank's report, sorted by 'rank': the files in `report_dir` if any, else the
    `ZMPI_REPORT` lines of stdout."""
    files = sorted(Path(report_dir).glob("rank-*.json")) if report_dir else []
    if files:
        reports = [json.loads(f.read_text()) for f in files]
    else:
        reports = [json.loads(line[len(PREFIX):]) for line in stdout.splitlines()
                   if line.startswith(PREFIX)]
    return sorted(reports, key=lambda r: r["rank"])


def run_mpi(script, nprocs: int, args=(), timeout: float = 120, env=None) -> list[dict]:
    """Run a rank script on `nprocs` ranks; fail the test on timeout, a non-zero exit, or
    not exactly one report per rank. Returns the reports sorted by rank."""
    with tempfile.TemporaryDirectory(prefix="zmpi-reports-") as report_dir:
        env = {"ZMPI_REPORT_DIR": report_dir, **(env or {})}
        result = launch_mpi(script, nprocs, args=args, timeout=timeout, env=env)
        reports = parse_reports(result.stdout, report_dir)
    if result.timed_out:
        pytest.fail(f"mpiexec -n {nprocs} {script} timed out after {timeout}s\n"
                    + result.describe())
    if result.returncode != 0:
        pytest.fail(f"mpiexec -n {nprocs} {script} failed\n" + result.describe())
    if [r["rank"] for r in reports] != list(range(nprocs)):
        pytest.fail(f"expected one report from each of ranks 0..{nprocs - 1}, got ranks "
                    f"{[r['rank'] for r in reports]}\n" + result.describe())
    return reports

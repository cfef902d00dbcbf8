"""What a run records about itself: config, git revision, environment; per-rank log files.

    meta = run_metadata(comm, config=engine.config.to_dict(), argv=sys.argv)
    log = rank_logger(comm.rank, log_dir)      # log_dir=None: rank 0 to stdout, others silent
    record = RunRecord(out_dir, comm, config=...)  # run.json now, metrics.csv every step

Every experiment and `zmpi train` writes `run_metadata(...)` next to its results, so a table
can be traced back to the code and machine that produced it.
"""
from __future__ import annotations

import csv
import json
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def git_revision(path: str | Path | None = None) -> str:
    """The checkout's commit (with '+dirty' if it has uncommitted changes), or 'unknown'."""
    cwd = Path(path or Path(__file__).resolve().parent)
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict:
    """Versions of the interpreter, array and MPI libraries, and the machine."""
    from mpi4py import MPI

    from zmpi import backend
    from zmpi.comm import cuda_support, mpi_flavour

    cuda_aware, how = cuda_support()
    return {
        "mpi_flavour": mpi_flavour(), "mpi_cuda_aware": cuda_aware, "mpi_cuda_aware_source": how,
        "device": None if not backend.is_gpu else {
            "count": backend.device_count(), "chosen_by": backend.device_source},
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "backend": backend.name,
        "host_memory_kept": backend.host_memory_kept,
        "platform": platform.platform(),
        "processor": platform.machine(),
    }


def run_metadata(comm, **extra) -> dict:
    """A JSON-serialisable record of the run: time, world size, git revision, environment."""
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": comm.size,
            "git_revision": git_revision(), "environment": environment(), **extra}


def rank_logger(rank: int, log_dir: str | Path | None = None) -> logging.Logger:
    """A logger for this rank: to `log_dir/rank{rank}.log` when given (every rank), and to
    stdout on rank 0 only, so a job's console shows one voice."""
    log = logging.getLogger(f"zmpi.rank{rank}")
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(message)s", "%H:%M:%S")
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log", mode="w")
        handler.setFormatter(fmt)
        log.addHandler(handler)
    if rank == 0:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return log


METRICS = ("step", "loss", "tokens_per_s", "loss_scale", "lr", "skipped_steps")


class RunRecord:
    """A run's output directory, written as the run goes (rank 0; other ranks do nothing):
    run.json at the start (status "running") and again at the end (its final status and
    results), metrics.csv appended and flushed every step. A run that is killed keeps what it
    did; a resumed run in the same directory appends to its metrics.csv."""

    def __init__(self, out: str | Path, comm, **meta):
        self.out, self.active = Path(out), comm.rank == 0
        self.meta = run_metadata(comm, **meta)
        self._metrics = None
        if self.active:
            self.out.mkdir(parents=True, exist_ok=True)
            self.write(status="running")
            path = self.out / "metrics.csv"
            fresh = not path.exists() or path.stat().st_size == 0
            self._metrics = open(path, "a", newline="")  # noqa: SIM115 (open for the run)
            self._writer = csv.writer(self._metrics)
            if fresh:
                self._writer.writerow(METRICS)

    def write(self, **fields) -> None:
        """(Re)write run.json with the metadata and `fields` (atomically)."""
        if self.active:
            self.meta.update(fields)
            tmp = self.out / "run.json.tmp"
            tmp.write_text(json.dumps(self.meta, indent=2, default=str))
            tmp.replace(self.out / "run.json")

    def append(self, row) -> None:
        if self.active:
            self._writer.writerow(row)
            self._metrics.flush()

    def close(self, **fields) -> None:
        self.write(**fields)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


class PreemptionGuard:
    """SIGTERM and SIGUSR1 (what SLURM sends before it kills a job, see `sbatch --signal`)
    set a flag instead of killing the process; `requested(comm)` is a collective (one scalar
    allreduce) that says whether any rank got one, so every rank stops at the same step."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        import signal

        self.received = None
        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame):
        import signal

        self.received = signal.Signals(signum).name

    def requested(self, comm) -> bool:
        return comm.allreduce_scalar(float(self.received is not None), op="max") > 0

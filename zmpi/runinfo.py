"""What a run records about itself: config, git revision, environment; per-rank log files.

    meta = run_metadata(comm, config=engine.config.to_dict(), argv=sys.argv)
    log = rank_logger(comm.rank, log_dir)      # log_dir=None: rank 0 to stdout, others silent

Every experiment and `zmpi train` writes `run_metadata(...)` next to its results, so a table
can be traced back to the code and machine that produced it.
"""
from __future__ import annotations

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

    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "backend": backend.name,
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

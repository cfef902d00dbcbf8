"""What a run records about itself: config, git revision, environment; per-rank log files.

    meta = run_metadata(comm, config=engine.config.to_dict(), argv=sys.argv)
    log = rank_logger(comm.rank, log_dir)      # log_dir=None: rank 0 to stdout, others silent
    record = RunRecord(out_dir, comm, config=...)  # run.json now, metrics.csv every step

Every experiment and `zmpi train` writes `run_metadata(...)` next to its results, so a table
can be traced back to the code and machine that produced it.
"""
from __future__ import annotations

import contextlib
import csv
import json
import logging
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from zmpi.files import write_atomic


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
    from zmpi import backend
    from zmpi.comm import MPI, cuda_support, mpi_flavour

    cuda_aware, how = cuda_support()
    return {
        "mpi_flavour": mpi_flavour(), "mpi_cuda_aware": cuda_aware, "mpi_cuda_aware_source": how,
        "device": None if not backend.is_gpu else {
            "name": backend.device_name(), "count": backend.device_count(),
            "chosen_by": backend.device_source, "cupy": backend.xp.__version__},
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "mpi4py": __import__("mpi4py").__version__,
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(" \t\x00"),
        "backend": backend.name,
        "host_memory_kept": backend.host_memory_kept,
        "platform": platform.platform(),
        "processor": platform.machine(),
    }


def rank_hosts(comm) -> dict[str, list[int]]:
    """Collective over `comm` (one small allgather; none for one rank): {hostname: the ranks
    on it}, hosts in the order of their lowest rank."""
    names = comm.allgather_object(socket.gethostname()) if comm.size > 1 else \
        [socket.gethostname()]
    hosts: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        hosts.setdefault(name, []).append(rank)
    return hosts


def run_metadata(comm, hosts: dict | None = None, **extra) -> dict:
    """A JSON-serialisable record of the run: time, world size, git revision, environment,
    and the hosts: "hosts" ({hostname: its ranks}, `rank_hosts`) and "nodes" (how many),
    where `hosts` is given (a collective gathers them) or there is one rank."""
    if hosts is None and comm.size == 1:
        hosts = {socket.gethostname(): [0]}
    where = {} if hosts is None else {"nodes": len(hosts), "hosts": hosts}
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "world_size": comm.size, **where,
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


def _drop_rows_from(path: Path, first: int) -> int:
    """Rewrite the metrics.csv at `path` (atomically) without its rows for steps >= `first`
    and without rows a kill cut short (no line end, or not one field per column); returns
    how many rows it dropped (0: the file is left as it is). A header cut short empties it."""
    if not path.exists():
        return 0
    with open(path, newline="") as f:
        lines = f.read().splitlines(keepends=True)
    if not lines:
        return 0
    width = len(lines[0].rstrip("\r\n").split(","))
    keep = lines[:1] if lines[0].endswith("\n") else []
    for line in lines[1:] if keep else ():
        fields = line.rstrip("\r\n").split(",")
        try:
            if line.endswith("\n") and len(fields) == width and int(fields[0]) < first:
                keep.append(line)
        except ValueError:
            pass
    dropped = len(lines) - len(keep) - (0 if keep else 1)  # rows, not the header
    if len(keep) < len(lines):
        write_atomic(path, "".join(keep).encode())
    return dropped


def foreign_run(out: str | Path, run_id: str) -> str | None:
    """Why run `run_id` may not write its record into directory `out` (which exists): its
    run.json is another run's (it names another run id, or none: written before zmpi
    recorded them, or it does not read); it holds a metrics.csv but no run.json (another
    run's rows: a run writes run.json before its first row); or it is a checkpoint
    directory (`latest`, a checkpoint's manifest.json). None where `out` holds no record or
    run `run_id`'s, which a resumed run goes on with (the run id travels in its
    checkpoints' manifests: zmpi.checkpoint.ownership)."""
    from zmpi.checkpoint.ownership import complete_checkpoints
    from zmpi.checkpoint.store import LATEST

    out = Path(out)
    if (out / LATEST).exists() or next(complete_checkpoints(out), None) is not None:
        return (f"--out {out} is a checkpoint directory: give another directory for the "
                "run's record (run.json, metrics.csv); checkpoints go to --ckpt-dir")
    try:
        text = (out / "run.json").read_text()
    except FileNotFoundError:
        if (out / "metrics.csv").exists():
            return (f"--out {out} holds a metrics.csv but no run.json (another run's rows, "
                    "which this run's would be appended to): give another directory")
        return None
    except OSError as e:
        return f"--out {out}: {e.strerror}"
    try:
        owner = json.loads(text).get("run_id")
    except (ValueError, AttributeError, RecursionError):
        owner = None
    if owner == run_id:
        return None
    whose = (f"run {owner[:12]}" if isinstance(owner, str) and owner else
             "a run.json naming no run (unreadable, or written before zmpi recorded them)")
    return (f"--out {out} holds another run's record ({whose}; this run is "
            f"{run_id[:12]}): give another directory (a resumed run goes on in the --out of "
            "the run that saved its checkpoint)")


def claim_out(out: str | Path, run_id: str):
    """Rank 0's hold on `zmpi train`'s --out for run `run_id`: (lock, None), the directory
    made if missing and locked as a checkpoint directory is (zmpi.checkpoint.ownership.
    lock_directory: `out`/.zmpi-lock, held until the lock is closed or the process ends), so
    that two runs, or two resumes of one run, never write one metrics.csv at once; or
    (None, why not), one line: the directory cannot be made, another process holds it, or
    `foreign_run` refuses it."""
    from zmpi.checkpoint.ownership import lock_directory
    from zmpi.checkpoint.store import CheckpointError

    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = lock_directory(out, run_id, "writing its record (run.json, metrics.csv)")
    except OSError as e:
        return None, f"--out {out}: cannot be made: {e.strerror}"
    except CheckpointError as e:
        return None, f"--out {e}"
    refused = foreign_run(out, run_id)
    if refused:
        lock.close()
        return None, refused
    return lock, None


class RecordError(RuntimeError):
    """--out could not be written (a full disk, an I/O error): one line naming the file.
    Raised on rank 0 alone: `zmpi train` ends the job with it (zmpi.comm.faults.fail_alone)."""


class RunRecord:
    """A run's output directory, written as the run goes (rank 0; other ranks do nothing):
    run.json at the start (status "running") and again at the end (its final status and
    results), metrics.csv appended and flushed every step. A run that is killed keeps what it
    did. run.json names the run (`run_id` in `meta`, the engine's), so that no other run
    writes into the directory (`claim_out`, before: it locks the directory; `lock`, the lock
    it returned, is let go by `close`).

    metrics.csv has one row per step. A run that starts at step `first_step` (a resumed run:
    the checkpoint's step; else 0) in a directory that already has a metrics.csv first drops
    the rows for steps >= first_step, which the killed run did after its last checkpoint and
    this run does again (and a row a kill cut short), rewriting the file atomically; run.json
    then says so: "metrics_truncated_from": first_step, "metrics_rows_dropped": how many.
    The rows before first_step stay, and the new ones are appended after them. `columns`:
    the header a new metrics.csv gets (METRICS, and a run's own after them: zmpi train adds
    each MoE layer's expert load and drops: docs/moe.md).
    A write that fails (ENOSPC) is a RecordError naming the file, not the OSError of a
    buffered write surfacing later (from append, or from close). Constructing it is
    collective over `comm` (run.json's "hosts", `rank_hosts`)."""

    def __init__(self, out: str | Path, comm, first_step: int = 0, lock=None,
                 columns=METRICS, **meta):
        self.out, self.active, self.lock = Path(out), comm.rank == 0, lock
        self.columns = tuple(columns)
        self.meta = run_metadata(comm, rank_hosts(comm), first_step=first_step, **meta)
        self._metrics = None
        if self.active:
            try:
                self._start(first_step)
            except RecordError:
                with contextlib.suppress(RecordError):
                    self.close()  # the file and the lock let go; run.json as it could be
                raise

    def _start(self, first_step: int) -> None:
        path = self.out / "metrics.csv"
        with self._writing("metrics.csv"):
            self.out.mkdir(parents=True, exist_ok=True)
            dropped = _drop_rows_from(path, first_step)
        if dropped:
            self.meta.update(metrics_truncated_from=first_step, metrics_rows_dropped=dropped)
        self.write(status="running")
        with self._writing("metrics.csv"):
            fresh = not path.exists() or path.stat().st_size == 0
            self._metrics = open(path, "a", newline="")  # noqa: SIM115 (open for the run)
            self._writer = csv.writer(self._metrics)
            if fresh:
                self._writer.writerow(self.columns)

    @contextlib.contextmanager
    def _writing(self, name: str):
        """An OSError in the block as a RecordError: `--out OUT: NAME not written: why`."""
        try:
            yield
        except OSError as e:
            raise RecordError(f"--out {self.out}: {name} not written: {e.strerror or e}") \
                from None

    def write(self, **fields) -> None:
        """(Re)write run.json with the metadata and `fields` (atomically)."""
        if self.active:
            self.meta.update(fields)
            with self._writing("run.json"):
                write_atomic(self.out / "run.json",
                             json.dumps(self.meta, indent=2, default=str).encode())

    def append(self, row) -> None:
        if self.active:
            with self._writing("metrics.csv"):
                self._writer.writerow(row)
                self._metrics.flush()

    def close(self, **fields) -> None:
        """Write run.json with `fields`, close metrics.csv and let go of --out's lock."""
        metrics, self._metrics = self._metrics, None
        try:
            self.write(**fields)
        finally:  # the file closed and the lock let go even if run.json cannot be written
            try:
                if metrics is not None:
                    with self._writing("metrics.csv"):
                        metrics.close()
            finally:
                if self.lock is not None:
                    self.lock.close()
                    self.lock = None

    def __enter__(self) -> RunRecord:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """A run that raises before `close` ends with run.json's status "failed" (a failed
        save, a non-finite loss) or "interrupted" (Ctrl-C) and the error, not "running",
        where it can be written (after a RecordError, a full disk, the error goes on alone)."""
        if kind is not None and self._metrics is not None:
            with contextlib.suppress(RecordError):
                self.close(status="interrupted" if issubclass(kind, KeyboardInterrupt)
                           else "failed", error=f"{kind.__name__}: {error}")


class StepSummary:
    """What the end of a run reports about its steps, in constant memory however long the
    run: how many, the first and the last loss, and the mean loss (a running sum). The rows
    themselves go to metrics.csv (`RunRecord.append`), not into a list."""

    __slots__ = ("steps", "first_loss", "last_loss", "loss_sum")

    def __init__(self):
        self.steps, self.first_loss, self.last_loss, self.loss_sum = 0, None, None, 0.0

    def add(self, loss: float) -> None:
        loss = float(loss)
        if self.steps == 0:
            self.first_loss = loss
        self.steps += 1
        self.last_loss = loss
        self.loss_sum += loss

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.steps if self.steps else None

    def as_dict(self) -> dict:
        return {"steps_run": self.steps, "first_loss": self.first_loss,
                "last_loss": self.last_loss, "mean_loss": self.mean_loss}


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

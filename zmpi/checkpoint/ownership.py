"""A checkpoint directory belongs to one run: who may write it, and what its retention may delete.

A run is an Engine's `run_id` (a new one per Engine; loading a checkpoint continues the run
that saved it, so a resumed run keeps its id). Every manifest records the run that wrote it.
Before its first save into a directory (`zmpi train`: at start-up) a run claims it:

- rank 0 locks `DIR/.zmpi-lock` (an advisory `flock`) for as long as the engine lives, and
  writes who holds it there: a second writer is refused with one line naming the holder. The
  lock goes when the process does, however it ends;
- every rank looks for a file rank 0 has just created in DIR, so a directory that the nodes
  do not share (a node-local path) is found now, named as such;
- every rank creates and removes a file in DIR, so a directory that cannot be written is
  found now, not at the first save after training for nothing;
- if DIR holds complete checkpoints of another run, the claim is refused unless `overwrite`:
  then they are deleted once this run's first checkpoint is complete (never before);
- a re-save that a kill interrupted is put back in place (`store.repair`).

Retention (`keep_last`) counts and deletes only the claiming run's own checkpoints. This module
is the rules, run by one process; `sharded.Checkpointer.claim` runs them collectively.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from zmpi.checkpoint.manifest import read_manifest
from zmpi.checkpoint.store import MANIFEST, CheckpointError, repair

LOCK = ".zmpi-lock"


def complete_checkpoints(directory: Path):
    """(path, manifest) of every complete checkpoint in `directory` whose manifest reads; a
    damaged one is not ours to judge and is left out (and left alone), and so is one whose
    manifest cannot be read (another run pruning it now, its permissions): never an OSError,
    which on rank 0 alone would leave the other ranks waiting for its answer."""
    if not Path(directory).is_dir():
        return
    for path in sorted(Path(directory).iterdir()):
        if path.is_dir() and not path.name.startswith(".") and (path / MANIFEST).is_file():
            try:
                yield path, read_manifest(path)
            except (CheckpointError, OSError):
                continue


@dataclass
class Claim:
    """Rank 0's hold on a checkpoint directory (other ranks hold no lock: `lock` is None)."""

    directory: Path
    run_id: str
    lock: object | None  # the open lock file; closing it releases the lock
    replace_others: bool = False  # delete other runs' checkpoints at the next publish
    notes: list[str] = field(default_factory=list)  # what repair did

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def take(directory: Path, run_id: str, overwrite: bool = False) -> Claim:
    """Rank 0's part of a claim (Checkpointer.claim runs it collectively): create and lock the
    directory, check whose checkpoints it holds, repair an interrupted re-save."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{directory}: not writable: {e.strerror}") from None
    lock = lock_directory(directory, run_id, "writing checkpoints")
    try:
        others = sorted(p.name for p, m in complete_checkpoints(directory)
                        if m.get("run_id") != run_id)
        if others and not overwrite:
            raise CheckpointError(
                f"{directory}: mismatch: it holds checkpoints of another run "
                f"({_summary(others)}); resume that run (--resume), choose another "
                "directory, or start over with --overwrite-ckpt-dir (deletes them once "
                "this run's first checkpoint is complete)")
        return Claim(directory, run_id, lock, bool(others), repair(directory))
    except BaseException:
        lock.close()
        raise


MARKER_WAIT = 2.0  # seconds a rank looks for rank 0's marker (`probe`)


def shared_marker(directory: Path) -> str:
    """Rank 0's part of the check that `directory` is shared: a new empty file there (the
    name returned) for every rank to find (`probe`); the claim removes it."""
    name = f".zmpi-shared-{secrets.token_hex(8)}"
    try:
        (directory / name).write_bytes(b"")
    except OSError as e:
        raise CheckpointError(f"{directory}: not writable: {e.strerror}") from None
    return name


def probe(directory: Path, marker: str | None = None) -> None:
    """CheckpointError unless this process sees `marker` (rank 0's `shared_marker`) in
    `directory` within MARKER_WAIT seconds (a network file system's caches may show a new
    file late), which it does not where the nodes do not share the directory, and can
    create a file there."""
    deadline = time.monotonic() + MARKER_WAIT
    while marker is not None and not (directory / marker).is_file():
        if time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        raise CheckpointError(
            f"{directory}: not shared between the nodes: {socket.gethostname()} does not see "
            "the file rank 0 has just created there; a checkpoint directory must be on a "
            "file system every node mounts at that path (not a node-local drive)")
    path = directory / f".zmpi-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        path.write_bytes(b"")
        path.unlink()
    except OSError as e:
        raise CheckpointError(f"{directory}: not writable: {e.strerror}") from None


def lock_directory(directory: Path, run_id: str, doing: str):
    """The locked, open lock file `directory`/LOCK (an advisory `flock`, held until it is
    closed or the process ends), its content naming this process and run `run_id`; a
    CheckpointError, one line, if another process holds it (`{directory}: in use: run R (pid
    P on HOST, since T) is {doing} here; ...`) or it cannot be opened and locked (a lock
    file that is no regular file: a FIFO or a directory). Locks checkpoint directories
    (`take`) and `zmpi train`'s --out (zmpi.runinfo.claim_out)."""
    from zmpi.files import check_input

    if os.path.lexists(directory / LOCK):
        try:  # open() of a FIFO waits for a writer; flock of some files fails oddly
            check_input(directory / LOCK, "lock file")
        except ValueError as e:
            raise CheckpointError(f"{directory}: cannot be locked: {e}") from None
    try:
        f = open(directory / LOCK, "a+")  # noqa: SIM115 (held open while the run lives)
    except OSError as e:
        raise CheckpointError(f"{directory}: not writable: {e.strerror}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "{}"
        f.close()
        try:
            h = json.loads(holder)
            who = (f"run {h['run_id'][:12]} (pid {h['pid']} on {h['host']}, since "
                   f"{h['since']})")
        except (ValueError, KeyError, TypeError, RecursionError):
            who = "another process"
        raise CheckpointError(f"{directory}: in use: {who} is {doing} here; wait for it "
                              "to end or choose another directory") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(),
                        "since": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    f.flush()
    return f


def other_runs(directory: Path, manifest: dict) -> list[str]:
    """A note when `directory`, where the checkpoint of `manifest` lies, holds complete
    checkpoints of other runs too (one copied in from elsewhere): which run's checkpoint was
    read and which tags are another's, so that a resume (Checkpointer.load) or a verify
    (`zmpi ckpt verify`) of the wrong one is not silent."""
    others = sorted(p.name for p, m in complete_checkpoints(directory)
                    if m["run_id"] != manifest["run_id"])
    if not others:
        return []
    return [f"{directory} holds checkpoints of more than one run: read "
            f"{manifest['tag']} of run {manifest['run_id'][:12]}; {_summary(others)} "
            f"{'is' if len(others) == 1 else 'are'} another run's"]


def _summary(tags: list[str]) -> str:
    return ", ".join(tags[:4]) + (f" and {len(tags) - 4} more" if len(tags) > 4 else "")


def prune(held: Claim, newest: str, keep_last: int | None) -> None:
    """After checkpoint `newest` is complete: delete the other runs' checkpoints if the claim
    replaces them, and all but the `keep_last` newest (by global step, then time) of this
    run's own. Nothing else is touched."""
    ours, doomed = [], []
    for path, manifest in complete_checkpoints(held.directory):
        if path.name == newest:
            continue
        if manifest.get("run_id") == held.run_id:
            ours.append((manifest["global_steps"], path.stat().st_mtime, path))
        elif held.replace_others:
            doomed.append(path)
    if keep_last is not None:
        doomed += [path for *_, path in sorted(ours)[: max(0, len(ours) - (keep_last - 1))]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)

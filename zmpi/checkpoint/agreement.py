"""The ranks agreeing on a checkpoint operation's outcome (sharded.py's save and load, hf.py's
import): `agree` runs a step on every rank and raises the same CheckpointError on all of them
if it failed on any; `read_alike` also checks that every rank read the same checkpoint; and
`load_fallback` goes back to the newest older checkpoint that loads when the newest is damaged,
every rank trying the same tags in the same order.
"""
from __future__ import annotations

from pathlib import Path

from zmpi.checkpoint.ownership import complete_checkpoints
from zmpi.checkpoint.store import CheckpointError, resolve_tag


def agree(comm, what: str, fn, *args):
    """Run fn(*args) on every rank and return this rank's result; if it raised anywhere,
    raise a CheckpointError on every rank naming the first rank that failed (nobody is left
    waiting in a later collective). Only the error messages travel."""
    from zmpi.comm.agree import agreed_call  # here: importing zmpi.comm starts MPI

    def describe(e):
        return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"

    result, failed, error = agreed_call(comm, lambda: fn(*args), describe)
    if failed:
        rank, text = failed[0]
        where = "" if comm.size == 1 else f" (rank {rank})"
        raise CheckpointError(f"{what} failed{where}: {text}") from (
            error if rank == comm.rank else None)
    return result


class RanksReadDifferently(CheckpointError):
    """The ranks read different checkpoints (`read_alike`): their file systems disagree, so a
    load raises it on every rank and never falls back to an older checkpoint over it."""


def read_alike(comm, where: str, read, tag):
    """`agree` on read(tag) -> (path, manifest, states), and on every rank having read the
    same checkpoint (its manifest's checkpoint_id): each rank finds the directory itself
    (`latest`, or where an interrupted re-save left it), and a file system that shows the
    ranks different files (a stale cache, node-local copies) would otherwise have them
    train on from different states, or make different collectives as they restore."""
    result = agree(comm, where, read, tag)
    found = comm.allgather_object((str(result[0]), result[1]["checkpoint_id"]))
    if len({checkpoint_id for _, checkpoint_id in found}) > 1:
        said = "; ".join(f"rank {r}: {path} ({checkpoint_id[:8]})"
                         for r, (path, checkpoint_id) in enumerate(found))
        raise RanksReadDifferently(f"{where} failed: the ranks read different checkpoints "
                                   f"({said}): their file systems disagree on what this "
                                   "directory holds")
    return result


def fallback_tags(directory, exclude) -> list[str]:
    """The tags of the other complete checkpoints in `directory`, newest (global step, then
    time) first: what a load falls back to when the newest one is damaged."""
    found = [(m["global_steps"], path.stat().st_mtime, path.name)
             for path, m in complete_checkpoints(Path(directory)) if path != exclude]
    return [name for *_, name in sorted(found, reverse=True)]


def load_fallback(comm, directory, read, error):
    """load(fallback=True): the newest complete checkpoint that loads, after `error` on the
    one `latest` names; every rank tries the same tags in the same order."""
    try:
        newest = resolve_tag(directory, None)
    except CheckpointError:
        newest = None
    tags = comm.bcast_object(fallback_tags(directory, newest) if comm.rank == 0 else None)
    notes = [f"the newest checkpoint could not be loaded ({error})"]
    for candidate in tags:
        try:
            return (*read_alike(comm, f"load_checkpoint {directory} tag {candidate}", read,
                                candidate), notes + [f"fell back to {candidate}"])
        except RanksReadDifferently:
            raise
        except CheckpointError as e:
            notes.append(f"{candidate} could not be loaded either ({e})")
    raise CheckpointError(f"{error}; no other checkpoint in {directory} loads "
                          f"({len(tags)} tried)") from None

"""Saving and loading an Engine's whole training state, collectively (format: store.py).

Save (every rank): each rank writes its owned shard of the four model states to its own file
in a staging directory (with hybrid sharding one replica of each shard writes: a checkpoint
has as many shards as a shard group has ranks); the ranks agree that every write succeeded;
rank 0 writes the manifest, renames the staging directory to the tag, replaces `latest` and
applies `keep_last`.
With `async_` the shard is copied to host buffers and written by a background thread while
training goes on; the rest (the agreement, the manifest) runs at the first collective point
after every rank's write is done: a `train_step` (which polls with one scalar allreduce while
a save is in flight), the next save or load, or `close`.

Load (every rank): each rank reads the manifest, checks that it describes the engine's model,
and reads the elements of its own owned shard in the engine's layout, by parameter name, from
whichever saved shards hold them, so any saved world size and strategy loads into any other.
The ranks agree that every read succeeded before any engine state is touched: a failed load
raises the same CheckpointError on every rank and leaves the engine as it was. Then each state
is written into the strategy's buffers (an allgather where the strategy replicates it).
"""
from __future__ import annotations

import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zmpi import backend
from zmpi.checkpoint.store import (
    LATEST,
    MANIFEST,
    STATES,
    CheckpointError,
    ShardReader,
    check_tag,
    fsync_dir,
    owned_pieces,
    read_manifest,
    resolve_tag,
    shard_name,
    staging_dir,
    write_atomic,
    write_manifest,
    write_shard,
)


def agree(comm, what: str, fn, *args):
    """Run fn(*args) on every rank and return this rank's result; if it raised anywhere,
    raise a CheckpointError on every rank naming the first rank that failed (nobody is left
    waiting in a later collective). Only the error messages travel."""
    error, message, result = None, None, None
    try:
        result = fn(*args)
    except Exception as e:  # handed to every rank below
        error = e
        message = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
    for rank, text in enumerate(comm.allgather_object(message)):
        if text is not None:
            where = "" if comm.size == 1 else f" (rank {rank})"
            raise CheckpointError(f"{what} failed{where}: {text}") from (
                error if rank == comm.rank else None)
    return result


# ---- save -----------------------------------------------------------------------------------
@dataclass
class PendingSave:
    """A save whose shard file is being written (by `thread` if asynchronous)."""

    directory: Path
    tag: str
    body: dict  # the manifest, less its file list
    keep_last: int | None
    write: object  # () -> file entry
    buffers: list  # host snapshot buffers, in the ledger
    thread: threading.Thread | None = None
    outcome: dict = field(default_factory=dict)

    def start(self) -> None:
        def run():
            try:
                self.outcome["entry"] = self.write()
            except BaseException as e:  # raised by result() at the finishing collective
                self.outcome["error"] = e

        self.thread = threading.Thread(target=run, name="zmpi-checkpoint-writer", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def result(self) -> dict:
        if self.thread is None:
            return self.write()
        self.thread.join()
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["entry"]


def save(engine, directory, tag=None, keep_last=None, async_=False, client_state=None) -> Path:
    """engine.save_checkpoint: see its docstring. Returns the checkpoint's final directory."""
    comm = engine.comm
    finish_pending(engine)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    tag = check_tag(tag if tag is not None else f"step{engine.global_steps}")
    directory = Path(directory)
    tags = comm.allgather_object((str(directory), tag))
    if len(set(tags)) != 1:
        raise ValueError(f"save_checkpoint got different directories or tags on different "
                         f"ranks: {sorted(set(tags))}")
    engine.wait_update()  # a delayed update in flight finishes; its publication stays pending
    body = engine.checkpoint_state(client_state)
    staging = staging_dir(directory, tag)

    def prepare():
        if comm.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
            staging.mkdir()

    agree(comm, f"save_checkpoint {staging}", prepare)
    body["checkpoint_id"] = comm.bcast_object(uuid.uuid4().hex)
    body["tag"] = tag
    strategy, shards = engine.strategy, engine.layout.world_size
    states, buffers = {}, []
    for state in STATES if strategy.writes_checkpoint else ():  # one replica per shard writes
        shard = strategy.state_shard(state)
        if async_ or backend.is_device_array(shard):  # a host copy the writer owns
            host = engine.memory.allocate(shard.shape, shard.dtype, "checkpoint", "host",
                                          f"checkpoint {state}")
            backend.copy_(host, shard)
            buffers.append(host)
            shard = host
        states[state] = shard
    attrs = {"checkpoint_id": body["checkpoint_id"], "rank": strategy.rank,
             "world_size": shards, "tag": tag}
    path = staging / shard_name(strategy.rank, shards)
    pending = PendingSave(directory, tag, body, keep_last, buffers=buffers,
                          write=lambda: write_shard(path, engine.layout, strategy.rank, states,
                                                    attrs) if states else None)
    engine.pending_save = pending
    if async_:
        pending.start()
    else:
        finish_pending(engine)
    return directory / tag


def poll(engine) -> None:
    """Finish an asynchronous save once every rank's writer is done (one scalar allreduce)."""
    pending = engine.pending_save
    if pending is not None and engine.comm.allreduce_scalar(float(pending.done()), "min") == 1:
        finish_pending(engine)


def finish_pending(engine) -> None:
    """Complete the save in flight, if any (a collective): wait for every rank's shard, write
    the manifest, move the checkpoint into place, update `latest`, apply keep_last."""
    pending, engine.pending_save = engine.pending_save, None
    if pending is None:
        return
    comm = engine.comm
    staging = staging_dir(pending.directory, pending.tag)
    try:
        entries = comm.allgather_object(agree(comm, f"saving shard files in {staging}",
                                              pending.result))
        entries = sorted((e for e in entries if e is not None), key=lambda e: e["file"])
    finally:
        for buf in pending.buffers:
            engine.memory.release(buf)

    def publish():
        if comm.rank == 0:
            write_manifest(staging / MANIFEST, dict(pending.body, files=entries))
            fsync_dir(staging)
            final = pending.directory / pending.tag
            if final.exists():  # re-saving a tag: the old copy is removed once replaced
                old = staging.with_name(staging.name[:-len("partial")] + "old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                staging.rename(final)
                shutil.rmtree(old)
            else:
                staging.rename(final)
            fsync_dir(pending.directory)
            write_atomic(pending.directory / LATEST, (pending.tag + "\n").encode())
            if pending.keep_last is not None:
                _retain(pending.directory, pending.keep_last, pending.tag)

    agree(comm, f"writing the manifest of {pending.directory / pending.tag}", publish)


def _retain(directory: Path, keep_last: int, newest: str) -> None:
    """Delete all but the `keep_last` newest complete checkpoints (by global step, then time)."""
    complete = []
    for path in directory.iterdir():
        if path.is_dir() and (path / MANIFEST).is_file() and path.name != newest:
            try:
                step = read_manifest(path)["global_steps"]
            except CheckpointError:
                continue  # not ours to judge: leave it
            complete.append((step, path.stat().st_mtime, path))
    for _, _, path in sorted(complete)[: max(0, len(complete) - (keep_last - 1))]:
        shutil.rmtree(path)


# ---- load -----------------------------------------------------------------------------------
@dataclass
class Loaded:
    """What `load_checkpoint` restored: where from, the step, the saver's client state, and
    notes on what differs between the checkpoint and this engine (hyper-parameters, dtypes)."""

    path: Path
    tag: str
    world_size: int  # shards of the run that saved it: its world (or shard group) size
    strategy: str
    global_steps: int
    client_state: dict
    notes: list[str]


def check_same_model(manifest: dict, layout, where) -> None:
    """CheckpointError ("mismatch") unless the checkpoint has the same parameters and shapes."""
    saved, ours = manifest["layout_obj"].shapes(), layout.shapes()
    if saved == ours:
        return
    diffs = [f"{n}: checkpoint {saved.get(n, 'absent')}, model {ours.get(n, 'absent')}"
             for n in sorted(set(saved) | set(ours)) if saved.get(n) != ours.get(n)]
    raise CheckpointError(f"{where}: mismatch: the checkpoint is of a different model "
                          f"({len(diffs)} parameters differ; {'; '.join(diffs[:3])})")


def read_owned(reader: ShardReader, state: str, layout, rank: int, dtype) -> np.ndarray:
    """`state` in `layout`'s owned shard of `rank` (S,), padding zero, read by ranges."""
    out = np.zeros(layout.shard_numel, dtype)
    for name, start, at, n in owned_pieces(layout, rank):
        reader.read(state, name, start, out[at : at + n])
    return out


def load(engine, directory, tag=None, verify=True) -> Loaded:
    """engine.load_checkpoint: see its docstring."""
    comm = engine.comm
    finish_pending(engine)

    def read():
        ckpt = resolve_tag(directory, tag)
        manifest = read_manifest(ckpt)
        check_same_model(manifest, engine.layout, ckpt / MANIFEST)
        same_dtype = manifest["dtype"] == engine.dtype.name
        with ShardReader(ckpt, manifest, verify) as reader:
            states = {s: read_owned(reader, s, engine.layout, engine.strategy.rank,
                                    engine.dtype if s == "params" else engine.master_dtype)
                      for s in STATES if s != "params" or same_dtype}
        return ckpt, manifest, states

    where = f"load_checkpoint {directory}" + (f" tag {tag}" if tag else "")
    ckpt, manifest, states = agree(comm, where, read)
    notes = engine.restore_checkpoint_state(manifest, states)
    return Loaded(ckpt, manifest["tag"], manifest["world_size"], manifest["strategy"],
                  manifest["global_steps"], manifest["client_state"], notes)


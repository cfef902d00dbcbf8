"""Saving and loading an engine's whole training state, collectively (format: store.py).

`Checkpointer` is an engine's checkpoint side (`engine.checkpoints`): the run it saves as,
its claims on directories (ownership.py), the save in flight. It works on the `TrainState`
the engine hands each call (zmpi.engine.state), never on the engine.

Save (every rank): each rank writes its owned shard of the four model states to its own file
in a staging directory (with hybrid sharding one replica of each shard writes: a checkpoint
has as many shards as a shard group has ranks; under tensor parallelism, as many per tensor
rank, each of its local slices; at expert-parallel degree ep > 1, the expert strategy's shard
too, to a file per ep rank and expert-data-parallel shard: store.expert_section); the ranks
agree that every write succeeded;
rank 0 writes the manifest, renames the staging directory to the tag, replaces `latest` and
prunes (`keep_last`, the run's own checkpoints only).
With `async_` the shard is copied to host buffers and written by a background thread while
training goes on; the rest (the agreement, the manifest) runs at the first collective point
after every rank's write is done: a `train_step` (which polls with one scalar allreduce while
a save is in flight), the next save or load, or `close`.

Load (every rank): each rank reads the manifest, checks that it describes the engine's model,
and reads the elements of its own owned shard in the engine's layout, by parameter name, from
whichever saved shards hold them, so any saved world size, strategy, tensor-parallel size
and expert-parallel size loads into any other.
The ranks agree that every read succeeded before any engine state is touched: a failed load
raises the same CheckpointError on every rank and leaves the engine as it was. Then each state
is written into the strategy's buffers (an allgather where the strategy replicates it).
"""
from __future__ import annotations

import os
import shutil
import threading
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from zmpi import backend
from zmpi.checkpoint.agreement import RanksReadDifferently, agree, load_fallback, read_alike
from zmpi.checkpoint.manifest import read_manifest, state_crc, write_manifest
from zmpi.checkpoint.ownership import (
    Claim,
    other_runs,
    probe,
    prune,
    shared_marker,
    take,
)
from zmpi.checkpoint.store import (
    LATEST,
    MANIFEST,
    STATES,
    CheckpointError,
    ShardReader,
    check_tag,
    expert_shard_name,
    fsync_dir,
    moved_dir,
    resolve_tag,
    sections,
    shard_name,
    staging_dir,
    write_atomic,
    write_shard,
)
from zmpi.checkpoint.tensor import read_resliced
from zmpi.words import count


# ---- a save in flight, and what a load returns ------------------------------------------------
@dataclass
class PendingSave:
    """A save whose shard file is being written (by `thread` if asynchronous)."""

    claim: Claim  # of the directory it is saved in
    tag: str
    body: dict  # the manifest, less its file list
    keep_last: int | None
    write: object  # () -> [(the manifest's file list, file entry)] of this rank's files
    buffers: list  # (ledger, host snapshot buffer) pairs, released when it finishes
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
    run_id: str  # the run that saved it, which the loading engine continues
    mesh: dict  # {"dp", "pp", "tp"} of the run that saved it (and "ep" above 1)


def check_same_model(manifest: dict, layout, splits, where, experts=None) -> None:
    """CheckpointError ("mismatch") unless the checkpoint has the same parameters and whole
    shapes (`layout` split over the tensor ranks as `splits` says: a TensorSplits; with the
    expert section `experts` at ep > 1, its `layout` and `splits`: zmpi.engine.state's
    SavedExperts), in whichever sections."""
    saved = {name: shape for section in sections(manifest)
             for name, shape in section["splits_obj"].whole_shapes(
                 section["layout_obj"]).items()}
    ours = splits.whole_shapes(layout)
    if experts is not None:
        ours.update(experts.splits.whole_shapes(experts.layout))
    if saved == ours:
        return
    diffs = [f"{n}: checkpoint {saved.get(n, 'absent')}, model {ours.get(n, 'absent')}"
             for n in sorted(set(saved) | set(ours)) if saved.get(n) != ours.get(n)]
    raise CheckpointError(f"{where}: mismatch: the checkpoint is of a different model "
                          f"({count(len(diffs), 'parameter')} of another shape; "
                          f"{'; '.join(diffs[:3])})")


def _snapshot(strategy, memory, async_: bool, buffers: list) -> dict:
    """{state: `strategy`'s shard of it} to write: a host copy the writer owns (its ledger
    entry appended to `buffers`, released when the save finishes) when asynchronous or on a
    device."""
    states = {}
    for name in STATES:
        shard = strategy.state_shard(name)
        if async_ or backend.is_device_array(shard):
            host = memory.allocate(shard.shape, shard.dtype, "checkpoint", "host",
                                   f"checkpoint {name}")
            backend.copy_(host, shard)
            buffers.append((memory, host))
            shard = host
        states[name] = shard
    return states


def read_owned(reader, state: str, layout, rank: int, dtype, splits,
               tp_rank: int) -> np.ndarray:
    """`state` in `layout`'s owned shard of `rank` (S,), padding zero, read by ranges: the
    local slices of tensor rank `tp_rank` (split as `splits` says) from however the
    checkpoint's were split (zmpi.checkpoint.tensor). `reader`: a ShardReader (or one with
    its `read` and `manifest`), or a list of them, one per section of the checkpoint
    (store.sections: the expert parameters of a run at ep > 1 are a section of their own,
    split over the ep ranks as tensor parallelism splits its slices); each parameter is read
    from the section that holds it, whichever section holds it in `layout`."""
    readers = reader if isinstance(reader, list) else [reader]
    holder = {name: (r, r.manifest["splits_obj"], shape) for r in readers
              for name, shape in r.manifest["layout_obj"].shapes().items()}
    out = np.zeros(layout.shard_numel, dtype)
    shapes = layout.shapes()
    for name, start, at, n in layout.owned_pieces(rank):
        source, saved, saved_shape = holder[name]
        read_resliced(source, state, name, start, out[at : at + n], splits, tp_rank,
                      shapes[name], saved, saved_shape)
    return out


class Checkpointer:
    """An engine's checkpoints: the run it saves as (`run_id`), its claims on directories and
    the save in flight. Each call is handed the engine's `TrainState` (zmpi.engine.state) and
    never sees the engine itself. Every method is a collective."""

    def __init__(self, comm, run_id: str):
        self.comm, self.run_id = comm, run_id
        self.claims = {}  # absolute directory -> Claim, held until release()
        self.pending = None  # the PendingSave in flight

    # ---- directories ------------------------------------------------------------------------
    def claim(self, directory, overwrite: bool = False) -> Claim:
        """engine.claim_checkpoint_dir: lock `directory` for this run (rank 0), check that
        every rank sees rank 0's files there and can write there (ownership.py); once per
        directory. The same CheckpointError on every rank when it is another run's, in use,
        not shared between the nodes or not writable."""
        key = os.path.abspath(directory)
        if key not in self.claims:
            self.claims[key] = self._claim(Path(directory), overwrite)
        return self.claims[key]

    def _claim(self, directory: Path, overwrite: bool) -> Claim:
        comm, run_id = self.comm, self.run_id
        def take_and_mark():
            claim = take(directory, run_id, overwrite)
            try:
                return claim, shared_marker(directory)
            except CheckpointError:
                claim.release()
                raise

        held, marker = agree(comm, f"claiming checkpoint directory {directory}",
                             lambda: take_and_mark() if comm.rank == 0 else (None, None))
        marker = comm.bcast_object(marker)
        try:
            agree(comm, f"checking that {directory} is shared and writable", probe, directory,
                  marker)
        except CheckpointError:
            if held is not None:
                held.release()
            raise
        finally:
            if comm.rank == 0:  # every rank has looked for it (agree's allgather)
                (directory / marker).unlink(missing_ok=True)
            comm.barrier()  # gone before any rank goes on (and lists the directory)
        return held or Claim(directory, run_id, None)

    def release(self) -> None:
        """Let go of every directory (the lock files stay, unlocked)."""
        for held in self.claims.values():
            held.release()
        self.claims.clear()

    # ---- save -------------------------------------------------------------------------------
    def save(self, state, directory, tag=None, keep_last=None, async_=False,
             client_state=None) -> Path:
        """engine.save_checkpoint: see its docstring. Returns the checkpoint's directory."""
        comm = self.comm
        self.finish()
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        tag = check_tag(tag if tag is not None else f"step{state.global_steps}")
        directory = Path(directory)
        tags = comm.allgather_object((str(directory), tag))
        if len(set(tags)) != 1:
            raise ValueError(f"save_checkpoint got different directories or tags on different "
                             f"ranks: {sorted(set(tags))}")
        held = self.claim(directory)
        if comm.rank == 0 and (directory / tag).is_dir():  # as DeepSpeed does, but not silently
            warnings.warn(f"save_checkpoint: {directory / tag} exists (this step was saved "
                          "before); the new save replaces it, its client_state with it",
                          stacklevel=3)
        state.settle()
        body = state.manifest(client_state)
        staging = staging_dir(directory, tag)

        def prepare():
            if comm.rank == 0:  # the claim made the directory
                shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
                staging.mkdir()

        agree(comm, f"save_checkpoint {staging}", prepare)
        body.update(checkpoint_id=comm.bcast_object(uuid.uuid4().hex), tag=tag,
                    run_id=self.run_id)
        strategy, layout = state.strategy, state.layout
        buffers = []
        attrs = {"checkpoint_id": body["checkpoint_id"], "tag": tag,
                 "state_crc": comm.bcast_object(state_crc(body))}  # of rank 0's: the manifest
        # (the manifest's file list, the strategy, its layout, this rank's file and its
        # attributes, the names it skips): this rank's shard of each section
        parts = [("files", strategy, layout, staging / shard_name(
            strategy.rank, layout.world_size, state.tp_rank, state.splits.size, state.stage,
            state.stages), dict(attrs, tp_rank=state.tp_rank, pp_stage=state.stage),
            state.held)]
        if state.experts is not None:  # the ep (x tp) slice in the tensor rank's place
            ex = state.experts
            parts.append(("expert_files", ex.strategy, ex.layout, staging / expert_shard_name(
                ex.strategy.rank, ex.layout.world_size, ex.slice_rank, state.stage,
                state.stages), dict(attrs, tp_rank=ex.slice_rank, pp_stage=state.stage),
                frozenset()))
        writes = [(key, path, section_layout, dict(attrs_, rank=owner.rank,
                                                   world_size=section_layout.world_size),
                   _snapshot(owner, state.memory, async_, buffers), skip)
                  for key, owner, section_layout, path, attrs_, skip in parts
                  if owner.writes_checkpoint]  # one replica per shard

        def write():
            return [(key, write_shard(path, section_layout, attrs_["rank"], states, attrs_,
                                      skip))
                    for key, path, section_layout, attrs_, states, skip in writes]

        self.pending = PendingSave(held, tag, body, keep_last, buffers=buffers, write=write)
        if async_:
            self.pending.start()
        else:
            self.finish()
        return directory / tag

    def poll(self) -> None:
        """Finish an asynchronous save once every rank's writer is done (one scalar
        allreduce; train_step calls it while a save is in flight)."""
        if self.pending is not None and self.comm.allreduce_scalar(
                float(self.pending.done()), "min") == 1:
            self.finish()

    def finish(self) -> None:
        """Complete the save in flight, if any: wait for every rank's shard, write the
        manifest, move the checkpoint into place, update `latest`, prune. If any rank failed,
        the staging directory is removed and `latest` is left as it was."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        comm, directory = self.comm, pending.claim.directory
        staging = staging_dir(directory, pending.tag)

        def publish(files):
            if comm.rank == 0:
                write_manifest(staging / MANIFEST, dict(pending.body, **files))
                fsync_dir(staging)
                final = directory / pending.tag
                if final.exists():  # re-saving a tag: the old copy is removed once replaced
                    old = moved_dir(directory, pending.tag)
                    shutil.rmtree(old, ignore_errors=True)
                    final.rename(old)  # a kill from here to the next rename: store.repair
                    staging.rename(final)
                    shutil.rmtree(old)
                else:
                    staging.rename(final)
                fsync_dir(directory)
                write_atomic(directory / LATEST, (pending.tag + "\n").encode())
                prune(pending.claim, pending.tag, pending.keep_last)

        try:
            try:
                entries = comm.allgather_object(agree(comm, f"saving shard files in {staging}",
                                                      pending.result))
            finally:
                for ledger, buf in pending.buffers:
                    ledger.release(buf)
            files = {key: sorted((e for rank in entries for k, e in rank if k == key),
                                 key=lambda e: e["file"])
                     for key in ("files", "expert_files")[:1 + ("experts" in pending.body)]}
            agree(comm, f"writing the manifest of {directory / pending.tag}", publish, files)
        except CheckpointError:  # raised on every rank
            if comm.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            comm.barrier()  # gone before any rank goes on
            raise

    # ---- load -------------------------------------------------------------------------------
    def load(self, state, directory, tag=None, verify=True, fallback=False) -> Loaded:
        """engine.load_checkpoint: see its docstring. The run of the checkpoint becomes this
        Checkpointer's (claims made for another run are released)."""
        comm = self.comm
        self.finish()
        strategy, layout = state.strategy, state.layout

        def read(tag):
            ckpt = resolve_tag(directory, tag)
            manifest = read_manifest(ckpt)
            check_same_model(manifest, state.saved_layout, state.saved_splits,
                             ckpt / MANIFEST, state.saved_experts)
            state.check_model(manifest, ckpt / MANIFEST)
            same_dtype = manifest["dtype"] == state.dtype.name
            ex = state.experts
            ours = [(layout, strategy.rank, state.splits, state.tp_rank)] + (
                [] if ex is None else [(ex.layout, ex.strategy.rank, ex.splits, ex.slice_rank)])
            readers = [ShardReader(ckpt, section, verify) for section in sections(manifest)]
            try:
                states = [{s: read_owned(readers, s, section_layout, rank,
                                         state.dtype if s == "params" else state.master_dtype,
                                         splits, split_rank)
                           for s in STATES if s != "params" or same_dtype}
                          for section_layout, rank, splits, split_rank in ours]
            finally:
                for reader in readers:
                    reader.close()
            return ckpt, manifest, states

        where = f"load_checkpoint {directory}" + (f" tag {tag}" if tag else "")
        try:
            ckpt, manifest, states = read_alike(comm, where, read, tag)
            skipped = []
        except CheckpointError as error:
            if not fallback or tag is not None or isinstance(error, RanksReadDifferently):
                raise  # disagreeing file systems are not a damaged checkpoint: no fallback
            ckpt, manifest, states, skipped = load_fallback(comm, directory, read, error)
        dense, experts = states[0], (states[1] if len(states) > 1 else {})
        notes = skipped + state.restore(manifest, dense, experts) + \
            comm.bcast_object(other_runs(ckpt.parent, manifest) if comm.rank == 0 else None)
        if manifest["run_id"] != self.run_id:
            self.release()  # claimed for the run this engine no longer is
            self.run_id = manifest["run_id"]
        return Loaded(ckpt, manifest["tag"], manifest["world_size"], manifest["strategy"],
                      manifest["global_steps"], manifest["client_state"], notes,
                      manifest["run_id"], manifest.get("mesh") or
                      {"dp": manifest["world_size"], "pp": 1, "tp": 1})

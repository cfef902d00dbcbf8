"""The on-disk checkpoint format: names, atomic files, shard files, ranged reads.

This module is the format and nothing else: it knows files, layouts and bytes, not engines or
MPI (zmpi.checkpoint.sharded runs it collectively; zmpi.checkpoint.tools runs it offline).

    DIR/latest                           the newest complete tag (text), replaced last
    DIR/<tag>/manifest.json              written last: the checkpoint is complete iff present
    DIR/<tag>/rank00001-of-00004.h5      rank 1's shard file
    DIR/<tag>/tp001-rank00001-of-00004.h5  ... of tensor rank 1, under tensor parallelism
    DIR/.<tag>.partial/                  a save in progress (renamed to <tag> when complete)
    DIR/.zmpi-lock                       held by the run writing here (ownership.py)

A shard file holds rank r's *owned shard* of the flat layout (zero.flat: unit u's elements
[r P_u / N, (r+1) P_u / N)) for each of the four model states, whatever the stage: a stage
that replicates a state writes only its owned part, so the format does not depend on the
strategy and every rank writes 1/N of the bytes. The shard is stored per parameter piece:

    /params/<param name>   the piece of the parameter in this shard, 1-D, storage dtype
    /master/<param name>   fp32 master weights (fp64 for an fp64 model)
    /adam_m/<param name>   Adam first moment
    /adam_v/<param name>   Adam second moment

Each dataset has the attributes `start` (offset of the piece in the parameter's flattened
elements) and `shape` (the whole parameter's shape), is chunked with HDF5's Fletcher-32 filter,
and a parameter that has no element in this shard has no dataset. bfloat16 (not an HDF5 type)
is stored as its uint16 bit pattern with `dtype = "bfloat16"`. The file's root attributes say
which checkpoint (`checkpoint_id`), rank and world size it belongs to, and `state_crc` the
manifest state it was saved with (`state_crc()`). Padding is not stored.

Under tensor parallelism (tp = T > 1) every tensor rank writes its local slices' owned shards
to files of its own, named by its tensor rank; the manifest lists the T x N files tensor rank
by tensor rank, and records how the parameters are split (zmpi.checkpoint.tensor).

The manifest (manifest.py) is written last and read first. Every file is written under a
temporary name, flushed, fsync'ed and renamed (`write_atomic`).
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import zlib
from pathlib import Path

import numpy as np

from zmpi.files import fsync_dir, replacing, write_atomic  # noqa: F401  (the format's)
from zmpi.words import count
from zmpi.zero.flat import ModelLayout

FORMAT = "zmpi-checkpoint"
VERSION = 1
STATES = ("params", "master", "adam_m", "adam_v")
MANIFEST = "manifest.json"
LATEST = "latest"
_CHUNK_BYTES = 4 << 20  # HDF5 chunk (Fletcher-32 unit) and checksum read size


class CheckpointError(Exception):
    """A checkpoint that cannot be saved or loaded. The message names the file and says what
    is wrong with one of the words missing, truncated, corrupt or mismatch."""


# ---- names ----------------------------------------------------------------------------------
def shard_name(rank: int, world_size: int, tp_rank: int = 0, tp: int = 1, stage: int = 0,
               stages: int = 1) -> str:
    """The shard file of data-parallel shard `rank` of `world_size` (and, under tensor
    parallelism, of tensor rank `tp_rank` of `tp`; under pipeline parallelism, of pipeline
    stage `stage` of `stages`)."""
    name = f"rank{rank:05d}-of-{world_size:05d}.h5"
    name = name if tp == 1 else f"tp{tp_rank:03d}-{name}"
    return name if stages == 1 else f"pp{stage:03d}-{name}"


def expert_shard_name(rank: int, world_size: int, ep_rank: int, stage: int = 0,
                      stages: int = 1) -> str:
    """The shard file of the expert section (zmpi.engine.moe.ExpertStates, at ep > 1) of
    expert-data-parallel shard `rank` of `world_size`, on expert-parallel rank `ep_rank`
    (and, under pipeline parallelism, of pipeline stage `stage` of `stages`)."""
    name = f"ep{ep_rank:03d}-{shard_name(rank, world_size)}"
    return name if stages == 1 else f"pp{stage:03d}-{name}"


def expert_section(manifest: dict) -> dict | None:
    """The expert section of a checkpoint saved at ep > 1 (None otherwise) as a manifest of
    its own, for ShardReader, open_shard and file_pieces: its layout (over the
    expert-data-parallel shards), its split over the ep ranks in the place of tensor
    ranks, its files (`expert_files`), and saved under pipeline parallelism its own
    `pipeline` entry (the split points of its units between the stages)."""
    if "experts" not in manifest:
        return None
    section = {k: v for k, v in manifest.items() if k not in ("pipeline", "tensor")}
    if "pipeline" in manifest["experts"]:
        section["pipeline"] = manifest["experts"]["pipeline"]
    section.update(files=manifest["expert_files"], layout_obj=manifest["expert_layout_obj"],
                   splits_obj=manifest["expert_splits_obj"])
    return section


def sections(manifest: dict) -> list[dict]:
    """The manifest and, saved at ep > 1, its expert section (`expert_section`)."""
    experts = expert_section(manifest)
    return [manifest] if experts is None else [manifest, experts]


def saving_stage(manifest: dict) -> dict[str, int]:
    """{parameter name: the pipeline stage that saved it} (all 0 without pipelining): stage s
    saved the layout's units bounds[s]:bounds[s + 1] of the manifest's "pipeline" entry."""
    layout = manifest["layout_obj"]
    bounds = manifest.get("pipeline", {}).get("bounds") or [0, len(layout.units)]
    return {slot.name: s for s in range(len(bounds) - 1)
            for unit in layout.units[bounds[s]:bounds[s + 1]] for slot in unit.slots}


def file_coords(manifest: dict, index: int) -> tuple[int, int, int]:
    """(pipeline stage, tensor rank, data-parallel shard) of the manifest's file `index`: the
    files are listed stage-major, then by tensor rank, then by shard."""
    n, tp = manifest["layout_obj"].world_size, manifest["splits_obj"].size
    return index // (n * tp), index // n % tp, index % n


def file_pieces(manifest: dict, index: int):
    """The parameter pieces file `index` holds: (name, start, at, length) of its shard's
    owned pieces (ModelLayout.owned_pieces) in the units of its stage."""
    stage, _, rank = file_coords(manifest, index)
    saved_by = saving_stage(manifest)
    return [piece for piece in manifest["layout_obj"].owned_pieces(rank)
            if saved_by[piece[0]] == stage]


def check_tag(tag: str) -> str:
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST or len(tag) > 200:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain file name (no '/', not "
                         f"starting with '.', not {LATEST!r})")
    return tag


def staging_dir(directory: Path, tag: str) -> Path:
    return Path(directory) / f".{tag}.partial"


def resolve_tag(directory, tag: str | None) -> Path:
    """The directory of checkpoint `tag` in `directory` (tag None: the one `latest` names).

    A kill between the two renames that replace a re-saved tag (publish: `<tag>` to
    `.<tag>.old`, then `.<tag>.partial` to `<tag>`) leaves `<tag>` missing for a moment; the
    complete copy is then found where the save left it (the new one if its manifest was
    written, else the old one) and `repair` puts it back at the next save."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: missing: no such checkpoint directory")
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            if (directory / MANIFEST).is_file():  # a tag's own directory
                raise CheckpointError(f"{directory}: mismatch: this is one checkpoint (tag "
                                      f"{directory.name}), not a checkpoint directory: give "
                                      f"{directory.parent} with the tag {directory.name}")
            tags = sorted(p.name for p in directory.iterdir() if (p / MANIFEST).is_file())
            raise CheckpointError(f"{latest}: missing: no '{LATEST}' file, so no complete "
                                  f"checkpoint was saved here (complete tags: {tags or 'none'})")
        tag = latest.read_text(errors="replace").strip()
        try:
            check_tag(tag)
        except ValueError:
            raise CheckpointError(f"{latest}: corrupt: it names {tag[:60]!r}, not a checkpoint "
                                  "tag") from None
    path = directory / check_tag(tag)
    if not path.is_dir():
        for moved in (staging_dir(directory, tag), moved_dir(directory, tag)):
            if (moved / MANIFEST).is_file():
                return moved
        raise CheckpointError(f"{path}: missing: no checkpoint tagged {tag!r}")
    return path


def moved_dir(directory: Path, tag: str) -> Path:
    """Where publish moves the previous copy of a re-saved tag until the new one is in place."""
    return Path(directory) / f".{tag}.old"


def repair(directory: Path) -> list[str]:
    """Clean up after saves that a kill interrupted, run by the directory's single writer
    (the holder of its lock, ownership.py: the writers of those saves are gone). Finish the
    replacement of a re-saved tag (see resolve_tag): the complete copy goes back to its tag.
    Then remove every other staging directory: a save that never reached its rename is not a
    checkpoint (the tag it would have become is left as it was). Returns what it did, for
    the log."""
    done = []
    for old in sorted(Path(directory).glob(".*.old")):
        tag = old.name[1:-len(".old")]
        final, new = Path(directory) / tag, staging_dir(directory, tag)
        if not final.exists():
            source = new if (new / MANIFEST).is_file() else old
            source.rename(final)
            done.append(f"restored {final} from {source.name} (a re-save was interrupted)")
        if old.exists():
            shutil.rmtree(old)
    for partial in sorted(Path(directory).glob(".*.partial")):
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial)
            done.append(f"removed {partial}, left by a save that did not finish (its writer "
                        "is gone)")
    return done


# ---- checksums -----------------------------------------------------------------------------
def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


# ---- shard files ----------------------------------------------------------------------------
def _disk_view(arr: np.ndarray) -> np.ndarray:
    """What HDF5 stores for `arr`: bfloat16 as its uint16 bits, other dtypes as they are."""
    return arr.view(np.uint16) if arr.dtype.name == "bfloat16" else arr


def _chunk(n: int, itemsize: int) -> int:
    """Elements per HDF5 chunk: at most _CHUNK_BYTES, splitting n evenly (HDF5 stores every
    chunk whole, so a ragged last chunk would waste up to a chunk of disk)."""
    chunks = -(-n * itemsize // _CHUNK_BYTES)
    return -(-n // chunks)


class _GuardedFile(io.RawIOBase):
    """The file HDF5 writes a shard through (h5py's file-object driver). An OSError of the
    disk (ENOSPC, EFBIG, EIO) is kept in `error` instead of being handed to HDF5: HDF5 cannot
    recover from a failed write (h5py raises it from a destructor, or the process crashes),
    so the writes after it are dropped, HDF5 finishes on a file that is then discarded, and
    the caller raises `error`."""

    def __init__(self, path: Path):
        super().__init__()
        # unbuffered: a failed write surfaces in write(), not in a later seek's flush
        self.f, self.error = open(path, "w+b", buffering=0), None  # noqa: SIM115

    def readable(self):
        return True

    def writable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        return self.f.seek(pos, whence)

    def tell(self):
        return self.f.tell()

    def readinto(self, buffer):
        return self.f.readinto(buffer)

    def _guard(self, fn, *args):
        if self.error is None:
            try:
                return fn(*args)
            except OSError as e:
                self.error = e
        return None

    def write(self, data):
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view) and self.error is None:
            done += self._guard(self.f.write, view[done:]) or 0
        if done < len(view):
            self.f.seek(len(view) - done, os.SEEK_CUR)  # dropped: the file is discarded
        return len(view)

    def truncate(self, size=None):
        self._guard(self.f.truncate, size)
        return size

    def sync(self):
        self._guard(os.fsync, self.f.fileno())

    def close(self):
        super().close()
        self.f.close()


def write_shard(path: Path, layout: ModelLayout, rank: int, states: dict, attrs: dict,
                skip=frozenset()) -> dict:
    """Write rank's owned shard of each state in `states` (name -> host array (S,)) to an HDF5
    file at `path` atomically, but the parameters named in `skip` (a pipeline stage's held
    copies); returns {"file", "bytes", "crc32"} for the manifest. A failed write (a full
    disk, a file too large) raises CheckpointError and leaves no file."""
    pieces = [piece for piece in layout.owned_pieces(rank) if piece[0] not in skip]
    shapes = layout.shapes()
    try:
        with replacing(path) as tmp:
            with writing_hdf5(tmp) as f:
                f.attrs.update(attrs)
                for state, shard in states.items():
                    group = f.create_group(state)
                    for name, start, at, n in pieces:
                        data = _disk_view(shard[at : at + n])
                        ds = group.create_dataset(name, data=data, fletcher32=True,
                                                  chunks=(_chunk(n, data.itemsize),))
                        ds.attrs["start"] = start
                        ds.attrs["shape"] = list(shapes[name])
                        if data.dtype != shard.dtype:
                            ds.attrs["dtype"] = shard.dtype.name
            crc = file_crc32(tmp)  # read back from the page cache
    except OSError as e:
        raise CheckpointError(f"{path}: not written: {e.strerror or e}") from None
    return {"file": path.name, "bytes": path.stat().st_size, "crc32": crc}


@contextlib.contextmanager
def writing_hdf5(path: Path):
    """A new HDF5 file at `path` for the block to fill, written through a `_GuardedFile` and
    fsync'ed when the block ends. A disk error in any of its writes (ENOSPC, EFBIG, EIO) is
    raised then, as the OSError, once HDF5 has finished: never from a destructor, never as a
    crash. The caller discards the file."""
    import h5py

    sink = _GuardedFile(path)
    try:
        with h5py.File(sink, "w") as f:
            yield f
        sink.sync()
    finally:
        sink.close()
    if sink.error is not None:
        raise sink.error


# ---- reading --------------------------------------------------------------------------------
class ShardReader:
    """Ranged reads of a checkpoint's states by parameter name, opening (and verifying: size,
    CRC-32, checkpoint id) only the shard files that hold the requested elements.

    `read(state, name, start, out, tp_rank=0)` fills `out` (1-D) with elements [start,
    start + len(out)) of parameter `name`'s flattened `state` (in tensor rank `tp_rank`'s
    local slice under tensor parallelism). Use as a context manager (closes the files)."""

    def __init__(self, ckpt: Path, manifest: dict, verify: bool = True):
        self.ckpt, self.manifest, self.verify = Path(ckpt), manifest, verify
        layout = manifest["layout_obj"]
        self.world_size, self.tp = layout.world_size, manifest["splits_obj"].size
        self.stage = saving_stage(manifest)
        self.pieces = {}  # name -> [(source rank, start, length)]
        for r in range(layout.world_size):
            for name, start, _, n in layout.owned_pieces(r):
                self.pieces.setdefault(name, []).append((r, start, n))
        self._files = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def file(self, index: int):
        """The shard file at `index` of the manifest's list (`file_coords`)."""
        if index not in self._files:
            self._files[index] = open_shard(self.ckpt, self.manifest, index, self.verify)
        return self._files[index]

    def read(self, state: str, name: str, start: int, out: np.ndarray,
             tp_rank: int = 0) -> None:
        stop, filled = start + len(out), 0
        for r, lo, n in self.pieces[name]:
            a, b = max(start, lo), min(stop, lo + n)
            if a >= b:
                continue
            f = self.file((self.stage[name] * self.tp + tp_rank) * self.world_size + r)
            try:
                ds = f[state][name]
                ds.read_direct(_disk_view(out), np.s_[a - lo : b - lo],
                               np.s_[a - start : b - start])
            except (KeyError, OSError, TypeError, ValueError) as e:
                raise CheckpointError(f"{f.filename}: corrupt: cannot read {state}/{name} "
                                      f"[{a - lo}:{b - lo}] ({e})") from None
            filled += b - a
        if filled != len(out):
            raise CheckpointError(f"{self.ckpt}: corrupt: the shards hold {filled} of the "
                                  f"{count(len(out), 'element')} [{start}:{stop}] of "
                                  f"{state}/{name}")


def open_shard(ckpt: Path, manifest: dict, index: int, verify: bool = True):
    """Open the shard file at `index` of the manifest's list (`file_coords`) read-only after
    checking it against the manifest: it exists, has the recorded size and (if `verify`)
    CRC-32, and belongs to this checkpoint."""
    import h5py

    world_size = manifest["layout_obj"].world_size
    stage, tp_rank, rank = file_coords(manifest, index)
    entry = manifest["files"][index]
    path = Path(ckpt) / entry["file"]
    if not path.is_file():
        what = "is not there" if not path.exists() else "is not a regular file"
        raise CheckpointError(f"{path}: missing: shard file of rank {rank} {what}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        word = "truncated" if size < entry["bytes"] else "corrupt"
        raise CheckpointError(f"{path}: {word}: {count(size, 'byte')}, the manifest records "
                              f"{entry['bytes']:,}")
    if verify and file_crc32(path) != entry["crc32"]:
        raise CheckpointError(f"{path}: corrupt: CRC-32 checksum mismatch (bytes changed)")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CheckpointError(f"{path}: corrupt: not a readable HDF5 file ({e})") from None
    attrs = f.attrs
    if (attrs.get("checkpoint_id") != manifest["checkpoint_id"] or attrs.get("rank") != rank
            or attrs.get("world_size") != world_size or attrs.get("tp_rank", 0) != tp_rank
            or attrs.get("pp_stage", 0) != stage):
        f.close()
        raise CheckpointError(f"{path}: mismatch: this shard belongs to another checkpoint")
    if "state_crc" in attrs and attrs["state_crc"] != manifest["state_crc"]:
        f.close()  # (checkpoints written before shards recorded it have no attribute)
        raise CheckpointError(f"{path}: mismatch: the manifest does not describe the state "
                              "this shard was saved with (the manifest was edited after the "
                              "save)")
    return f

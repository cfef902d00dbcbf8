"""The on-disk checkpoint format: atomic files, shard files, the manifest, ranged reads.

This module is the format and nothing else: it knows files, layouts and bytes, not engines or
MPI (zmpi.checkpoint.sharded runs it collectively; zmpi.checkpoint.tools runs it offline).

    DIR/latest                           the newest complete tag (text), replaced last
    DIR/<tag>/manifest.json              written last: the checkpoint is complete iff present
    DIR/<tag>/rank00001-of-00004.h5      rank 1's shard file
    DIR/.<tag>.partial/                  a save in progress (renamed to <tag> when complete)

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
which checkpoint (`checkpoint_id`), rank and world size it belongs to. Padding is not stored.

The manifest (JSON) records the format version, the flat layout (`ModelLayout.to_dict`), the
engine state (steps, optimizer, loss scaler, config, the caller's client state) and, per shard
file, its size and CRC-32; a CRC-32 of the manifest's own body guards the manifest. Every file
is written under a temporary name, flushed, fsync'ed and renamed (`write_atomic`).
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

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
def shard_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.h5"


def check_tag(tag: str) -> str:
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST or len(tag) > 200:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain file name (no '/', not "
                         f"starting with '.', not {LATEST!r})")
    return tag


def staging_dir(directory: Path, tag: str) -> Path:
    return Path(directory) / f".{tag}.partial"


def resolve_tag(directory, tag: str | None) -> Path:
    """The directory of checkpoint `tag` in `directory` (tag None: the one `latest` names)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: missing: no such checkpoint directory")
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            tags = sorted(p.name for p in directory.iterdir() if (p / MANIFEST).is_file())
            raise CheckpointError(f"{latest}: missing: no '{LATEST}' file, so no complete "
                                  f"checkpoint was saved here (complete tags: {tags or 'none'})")
        tag = latest.read_text().strip()
    path = directory / check_tag(tag)
    if not path.is_dir():
        raise CheckpointError(f"{path}: missing: no checkpoint tagged {tag!r}")
    return path


# ---- atomic files ---------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


# ---- shard pieces ---------------------------------------------------------------------------
def owned_pieces(layout: ModelLayout, rank: int):
    """Every parameter piece of `rank`'s owned shard: (name, start in the parameter's flat
    elements, start in the rank's shard array, length), in shard order."""
    for u, unit in enumerate(layout.units):
        lo, hi = unit.shard_range(rank)
        base = layout.shard_offsets[u] - lo
        for slot in unit.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                yield slot.name, a - slot.offset, base + a, b - a


def _disk_view(arr: np.ndarray) -> np.ndarray:
    """What HDF5 stores for `arr`: bfloat16 as its uint16 bits, other dtypes as they are."""
    return arr.view(np.uint16) if arr.dtype.name == "bfloat16" else arr


def _chunk(n: int, itemsize: int) -> int:
    """Elements per HDF5 chunk: at most _CHUNK_BYTES, splitting n evenly (HDF5 stores every
    chunk whole, so a ragged last chunk would waste up to a chunk of disk)."""
    chunks = -(-n * itemsize // _CHUNK_BYTES)
    return -(-n // chunks)


def write_shard(path: Path, layout: ModelLayout, rank: int, states: dict, attrs: dict) -> dict:
    """Write rank's owned shard of each state in `states` (name -> host array (S,)) to an HDF5
    file at `path` atomically; returns {"file", "bytes", "crc32"} for the manifest."""
    import h5py

    tmp = path.with_name(path.name + ".tmp")
    pieces = list(owned_pieces(layout, rank))
    shapes = layout.shapes()
    with h5py.File(tmp, "w") as f:
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
        f.flush()
        os.fsync(f.id.get_vfd_handle())
    crc = file_crc32(tmp)  # read back from the page cache
    os.replace(tmp, path)
    return {"file": path.name, "bytes": path.stat().st_size, "crc32": crc}


# ---- manifest -------------------------------------------------------------------------------
def _body_crc(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def write_manifest(path: Path, body: dict) -> None:
    manifest = dict(body, format=FORMAT, version=VERSION)
    manifest["checksum"] = _body_crc(manifest)
    write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint directory `ckpt`, its format and checksum verified."""
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: the checkpoint is incomplete (its save did "
                              "not finish) or this is not a zmpi checkpoint")
    try:
        manifest = json.loads(path.read_text())
        checksum = manifest.pop("checksum")
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt: not a readable manifest ({e})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: mismatch: format {manifest.get('format')!r}, not "
                              f"{FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: mismatch: format version {manifest.get('version')!r}; "
                              f"this zmpi reads version {VERSION}")
    if _body_crc(manifest) != checksum:
        raise CheckpointError(f"{path}: corrupt: checksum mismatch (the manifest was changed)")
    manifest["layout_obj"] = ModelLayout.from_dict(manifest["layout"])
    return manifest


# ---- reading --------------------------------------------------------------------------------
class ShardReader:
    """Ranged reads of a checkpoint's states by parameter name, opening (and verifying: size,
    CRC-32, checkpoint id) only the shard files that hold the requested elements.

    `read(state, name, start, out)` fills `out` (1-D) with elements [start, start + len(out))
    of parameter `name`'s flattened `state`. Use as a context manager (closes the files)."""

    def __init__(self, ckpt: Path, manifest: dict, verify: bool = True):
        self.ckpt, self.manifest, self.verify = Path(ckpt), manifest, verify
        layout = manifest["layout_obj"]
        self.pieces = {}  # name -> [(source rank, start, length)]
        for r in range(layout.world_size):
            for name, start, _, n in owned_pieces(layout, r):
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

    def file(self, rank: int):
        if rank not in self._files:
            self._files[rank] = open_shard(self.ckpt, self.manifest, rank, self.verify)
        return self._files[rank]

    def read(self, state: str, name: str, start: int, out: np.ndarray) -> None:
        stop, filled = start + len(out), 0
        for r, lo, n in self.pieces[name]:
            a, b = max(start, lo), min(stop, lo + n)
            if a >= b:
                continue
            f = self.file(r)
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
                                  f"{len(out)} elements [{start}:{stop}] of {state}/{name}")


def open_shard(ckpt: Path, manifest: dict, rank: int, verify: bool = True):
    """Open rank's shard file read-only after checking it against the manifest: it exists,
    has the recorded size and (if `verify`) CRC-32, and belongs to this checkpoint."""
    import h5py

    entry = manifest["files"][rank]
    path = Path(ckpt) / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: shard file of rank {rank} is not there")
    size = path.stat().st_size
    if size != entry["bytes"]:
        word = "truncated" if size < entry["bytes"] else "corrupt"
        raise CheckpointError(f"{path}: {word}: {size} bytes, the manifest records "
                              f"{entry['bytes']}")
    if verify and file_crc32(path) != entry["crc32"]:
        raise CheckpointError(f"{path}: corrupt: CRC-32 checksum mismatch (bytes changed)")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CheckpointError(f"{path}: corrupt: not a readable HDF5 file ({e})") from None
    if f.attrs.get("checkpoint_id") != manifest["checkpoint_id"]:
        f.close()
        raise CheckpointError(f"{path}: mismatch: this shard belongs to another checkpoint")
    return f

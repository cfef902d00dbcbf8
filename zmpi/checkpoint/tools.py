"""Offline checkpoint tools, no MPI: inspect, verify, consolidate (`zmpi ckpt ...`).

    print(inspect("ckpt"))                          # manifest summary, files, sizes
    problems = verify("ckpt")                       # [] when every check passes
    consolidate("ckpt", "model.h5")                 # full fp32 tensors, one file
    consolidate("ckpt", "model.npz", npz=True)      # the same as a NumPy .npz

Consolidation reads one parameter at a time (never the whole model) from whichever shards
hold it, putting a tensor-parallel checkpoint's slices together (zmpi.checkpoint.tensor).
Tied weights are stored once; the alias is an HDF5 soft link to the owner (in .npz: absent)
and the root attribute / `__tied__` entry `tied` maps alias -> owner as JSON.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np

from zmpi.checkpoint.manifest import read_manifest
from zmpi.checkpoint.store import (
    STATES,
    CheckpointError,
    ShardReader,
    file_pieces,
    open_shard,
    resolve_tag,
    sections,
    writing_hdf5,
)
from zmpi.checkpoint.tensor import TensorSplits, read_resliced
from zmpi.files import check_output, replacing
from zmpi.words import count


def inspect(directory, tag=None) -> str:
    """A human-readable summary of a checkpoint (its manifest and files). The parameters are
    the whole model's, under tensor parallelism too (the manifest's num_params counts one
    tensor rank's slices)."""
    ckpt = resolve_tag(directory, tag)
    m = read_manifest(ckpt)
    opt = m["optimizer"]
    files = [f for section in sections(m) for f in section["files"]]
    total = sum(f["bytes"] for f in files)
    splits, layout = m["splits_obj"], m["layout_obj"]
    shapes = {name: shape for section in sections(m) for name, shape in
              section["splits_obj"].whole_shapes(section["layout_obj"]).items()}
    whole = sum(math.prod(shape) for shape in shapes.values())
    lines = [
        f"checkpoint {ckpt} (tag {m['tag']}, format {m['format']} v{m['version']})",
        f"  saved {m['saved_at']} by git {m['git_revision']}",
        f"  global step {m['global_steps']}, optimizer step {opt['step_count']} (lr {opt['lr']},"
        f" betas {opt['betas']}, eps {opt['eps']}, weight decay {opt['weight_decay']}"
        f"{', decoupled' if opt['decoupled'] else ''})",
        f"  {count(whole, 'parameter')} in {count(len(layout.units), 'unit')}, "
        f"{count(len(shapes), 'tensor')}; tied: {m['tied'] or 'none'}",
        f"  world size {m['world_size']}"
        + (f" x tensor-parallel {splits.size} ({count(len(splits.splits), 'split tensor')})"
           if splits.size > 1 else "")
        + (f" x pipeline {m['pipeline']['stages']} (stages split the units at "
           f"{m['pipeline']['bounds']})" if "pipeline" in m else "")
        + (f"; experts over expert-parallel {_expert_split(m['expert_splits_obj'])} x "
           f"expert-data-parallel {m['expert_layout_obj'].world_size} "
           f"({count(len(m['expert_splits_obj'].splits), 'expert tensor')})"
           if "experts" in m else "")
        + f", strategy {m['strategy']}, params {m['dtype']}, master and Adam "
        f"{m['master_dtype']}",
        f"  loss scaler: {m['loss_scaler'] or 'off'}; delayed update pending: "
        f"{m['unpublished_update']}",
        f"  client state: {json.dumps(m['client_state'])}",
        f"  {count(len(files), 'shard file')}, {total / 2**20:.2f} MiB:",
    ]
    lines += [f"    {f['file']}  {f['bytes']:>12,} bytes  crc32 {f['crc32']:08x}"
              for f in files]
    return "\n".join(lines)


def _expert_split(splits) -> str:
    """The expert section's split: "ep", or "ep x tensor-parallel tp" (an ExpertSplits)."""
    return str(splits.size) if not hasattr(splits, "ep") else \
        f"{splits.ep.size} x tensor-parallel {splits.tp.size}"


def runs_note(directory, tag=None) -> list[str]:
    """ownership.other_runs for the checkpoint `tag` (default: `latest`'s) of `directory`:
    a note if the directory holds checkpoints of another run too ([] if it does not, or the
    checkpoint does not read: `verify` names that)."""
    from zmpi.checkpoint.ownership import other_runs

    try:
        ckpt = resolve_tag(directory, tag)
        return other_runs(ckpt.parent, read_manifest(ckpt))
    except CheckpointError:
        return []


def verify(directory, tag=None) -> list[str]:
    """Every problem found in a checkpoint (empty: it is sound): the manifest's checksum,
    each shard's presence, size, CRC-32 and identity, every dataset read back through its
    Fletcher-32 filter, and every parameter piece the layout needs present with its shape."""
    try:
        ckpt = resolve_tag(directory, tag)
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for section, index in ((s, i) for s in sections(manifest) for i in range(len(s["files"]))):
        try:
            f = open_shard(ckpt, section, index)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        with f:
            for state in STATES:
                for name, start, _, n in file_pieces(section, index):
                    try:
                        ds = f[state][name]
                        ok = ds.shape == (n,) and ds.attrs["start"] == start
                        ds[...]  # every chunk through Fletcher-32
                    except (KeyError, OSError, ValueError) as e:
                        ok = False
                        problems.append(f"{f.filename}: corrupt: {state}/{name} ({e})")
                        continue
                    if not ok:
                        problems.append(f"{f.filename}: mismatch: {state}/{name} holds "
                                        f"{ds.shape} from {ds.attrs['start']}, the layout "
                                        f"says ({n},) from {start}")
    return problems


def check_outside(directory, out: Path, what: str) -> None:
    """ValueError if `out` is checkpoint directory `directory` or inside it, where it could
    replace the very shards being read or `latest` (`what`: what is written there)."""
    target, inside = Path(out).resolve(), Path(directory).resolve()
    if target == inside or inside in target.parents:
        raise ValueError(f"output {out}: inside the checkpoint directory {directory}; write "
                         f"{what} elsewhere")


def whole_masters(reader: ShardReader, manifest: dict):
    """(name, full master value) of every parameter of the checkpoint `reader` reads, one at
    a time, in layout order: a tensor-parallel checkpoint's slices put together, the
    vocabulary's padding dropped (fp32; fp64 for an fp64 model). `reader` may be a list, one
    ShardReader per section (store.sections: saved at ep > 1, the experts follow the rest,
    each expert parameter whole, (E, ...), its ep ranks' experts put together)."""
    dtype = np.dtype(manifest["master_dtype"])
    whole = TensorSplits()  # one rank holding every parameter whole
    for source in reader if isinstance(reader, list) else [reader]:
        saved, layout = source.manifest["splits_obj"], source.manifest["layout_obj"]
        local = layout.shapes()
        for name, shape in saved.whole_shapes(layout).items():
            flat = np.empty(math.prod(shape), dtype)
            read_resliced(source, "master", name, 0, flat, whole, 0, shape, saved, local[name])
            yield name, flat.reshape(shape)


def consolidate(directory, out, tag=None, npz=False) -> Path:
    """Write every parameter's full master value (fp32; fp64 for an fp64 model) to `out` as
    one HDF5 file (datasets named after the parameters) or, with npz, a NumPy .npz. Written
    under a temporary name and renamed. Returns the output path.

    A bad `out` is a ValueError before anything is read (inside the checkpoint directory, where
    it could replace the very shards being read or `latest`; or what `zmpi.files.check_output`
    refuses: a directory, a device, FIFO or socket, a directory that cannot be written); a
    failed write (a full disk) a CheckpointError, leaving no file behind."""
    ckpt = resolve_tag(directory, tag)
    manifest = read_manifest(ckpt)
    out = Path(out)
    check_outside(directory, out, "the consolidated file")
    check_output(out, "output")
    tied = manifest["tied"]
    readers = [ShardReader(ckpt, section) for section in sections(manifest)]
    try:
        with replacing(out) as tmp:
            if npz:
                _write_npz(tmp, whole_masters(readers, manifest), tied)
            else:
                _write_h5(tmp, whole_masters(readers, manifest), tied, manifest, ckpt)
    except OSError as e:
        raise CheckpointError(f"{out}: not written: {e.strerror or e}") from None
    finally:
        for reader in readers:
            reader.close()
    return out


def _write_h5(path, tensors, tied, manifest, ckpt) -> None:
    """Through store.writing_hdf5: a full disk is an OSError here, not an HDF5 crash."""
    import h5py

    with writing_hdf5(path) as f:
        for name, value in tensors:
            f.create_dataset(name, data=value)
        for alias, owner in tied.items():
            f[alias] = h5py.SoftLink("/" + owner)
        f.attrs.update({"tied": json.dumps(tied), "source": str(ckpt), "tag": manifest["tag"],
                        "global_steps": manifest["global_steps"],
                        "config": json.dumps(manifest["config"])})


def _write_npz(path, tensors, tied) -> None:
    """np.savez's format, one array at a time (np.savez needs them all in memory), fsync'ed."""
    with open(path, "wb") as fh:
        with zipfile.ZipFile(fh, "w", allowZip64=True) as z:
            for name, value in itertools.chain(tensors,
                                               [("__tied__", np.array(json.dumps(tied)))]):
                with z.open(name + ".npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, value)
        fh.flush()
        os.fsync(fh.fileno())

"""The manifest of a checkpoint: written last, read first, and never trusted.

    write_manifest(ckpt / MANIFEST, body)       # body + format, version and a checksum
    manifest = read_manifest(ckpt)              # every field checked; CheckpointError if not

The manifest is JSON: the format version, the flat layout (`ModelLayout.to_dict`; of the
whole model), the mesh and, under tensor parallelism, how the parameters are split
(`tensor`), under pipeline parallelism which units each stage saved (`pipeline`), at
expert-parallel degree > 1 the experts' own layout and split over the ep ranks (`experts`,
their shard files `expert_files`: store.expert_section), the engine state
(steps, optimizer, loss scaler, config, the caller's client state), the run that wrote it
(`run_id`, ownership.py) and, per shard file, its size and CRC-32, with a CRC-32 of its own
body. That checksum catches accidents only: it can be recomputed after an edit. So
`read_manifest` checks every field (types, ranges, the layout's structure, shard file names
confined to the checkpoint's directory), and each shard records `state_crc` of the state it
was saved with, which `store.open_shard` compares: an edited manifest no longer matches.
"""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

from zmpi.checkpoint.store import (
    FORMAT,
    MANIFEST,
    VERSION,
    CheckpointError,
    expert_shard_name,
    shard_name,
    write_atomic,
)
from zmpi.checkpoint.tensor import TensorSplits
from zmpi.words import count
from zmpi.zero.flat import ModelLayout

# unknown to the shards
_ENVELOPE = ("files", "expert_files", "format", "version", "checksum", "state_crc")


def _body_crc(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def state_crc(body: dict) -> int:
    """CRC-32 of a manifest's state (everything but its file list and envelope). Each shard
    file records it, so a manifest edited after the save (its own checksum recomputed, say a
    step changed) no longer matches its shards."""
    return _body_crc({k: v for k, v in body.items() if k not in _ENVELOPE})


def write_manifest(path: Path, body: dict) -> None:
    manifest = dict(body, format=FORMAT, version=VERSION)
    manifest["checksum"] = _body_crc(manifest)
    write_atomic(path, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint directory `ckpt`: format, checksum and every field checked
    (types, ranges, shard file names). The manifest is data from disk, not trusted: a field
    that is wrong raises one CheckpointError ("corrupt") naming it."""
    path = Path(ckpt) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: the checkpoint is incomplete (its save did "
                              "not finish) or this is not a zmpi checkpoint")
    try:
        manifest = json.loads(path.read_text())
        checksum = manifest.pop("checksum")
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt: not a readable manifest ({e})") from None
    except RecursionError:  # json.loads of a crafted nesting (5,000 levels)
        raise CheckpointError(f"{path}: corrupt: not a readable manifest (nested too "
                              "deeply)") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: mismatch: format {manifest.get('format')!r}, not "
                              f"{FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: mismatch: format version {manifest.get('version')!r}; "
                              f"this zmpi reads version {VERSION}")
    if _body_crc(manifest) != checksum:
        raise CheckpointError(f"{path}: corrupt: checksum mismatch (the manifest was changed)")
    try:
        check_fields(manifest)
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt: {e}") from None
    manifest["state_crc"] = state_crc(manifest)
    manifest["layout_obj"] = ModelLayout.from_dict(manifest["layout"])
    manifest["splits_obj"] = TensorSplits.from_dict(manifest.get("tensor"))
    try:
        manifest["splits_obj"].check_slices(manifest["layout_obj"])
        if "experts" in manifest:
            experts = manifest["experts"]  # (store.expert_section)
            manifest["expert_layout_obj"] = ModelLayout.from_dict(experts["layout"])
            manifest["expert_splits_obj"] = TensorSplits.from_dict(experts["tensor"])
            manifest["expert_splits_obj"].check_slices(manifest["expert_layout_obj"])
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt: {e}") from None
    manifest.setdefault("run_id", LEGACY_RUN)
    return manifest


# ---- field checks (ValueError naming the field) -------------------------------------------
def _int(lo=0):
    return lambda v: type(v) is int and v >= lo, f"an integer >= {lo}"


def _num(lo=-math.inf, hi=math.inf, open_lo=False):
    def ok(v):
        return (type(v) in (int, float) and math.isfinite(v)
                and (v > lo if open_lo else v >= lo) and v <= hi)
    return ok, f"a finite number {'>' if open_lo else '>='} {lo}" + (
        f" and <= {hi}" if hi < math.inf else "")


def _of(*types):
    return lambda v: type(v) in types, " or ".join(t.__name__ if t else "null" for t in types)


def _one_of(*values):
    return lambda v: v in values, f"one of {', '.join(map(repr, values))}"


_NONE = type(None)
FIELDS = {  # manifest key -> (test, what it must be)
    "world_size": _int(1), "num_params": _int(0), "global_steps": _int(0),
    "strategy": _of(str), "tag": _of(str), "saved_at": _of(str), "git_revision": _of(str, _NONE),
    "checkpoint_id": (lambda v: type(v) is str and len(v) == 32
                      and all(c in "0123456789abcdef" for c in v), "32 hex digits"),
    "run_id": _of(str), "dtype": _one_of("float16", "bfloat16", "float32", "float64"),
    "master_dtype": _one_of("float32", "float64"), "unpublished_update": _of(bool),
    "last_lr": _num(0), "config": _of(dict), "scheduler": _of(dict), "client_state": _of(dict),
    "tied": _of(dict), "optimizer": _of(dict), "loss_scaler": _of(dict, _NONE),
    "layout": _of(dict), "files": _of(list), "tensor": _of(dict), "pipeline": _of(dict),
    "mesh": (lambda m: type(m) is dict and set(m) - {"ep"} == {"dp", "pp", "tp"}
             and all(type(v) is int and v >= 1 for v in m.values()), "{dp, pp, tp[, ep]} sizes"),
    "experts": _of(dict), "expert_files": _of(list),
}
# run_id and mesh are absent from checkpoints written before zmpi recorded them, tensor from
# every checkpoint saved without tensor parallelism (zmpi.checkpoint.tensor);
# experts and expert_files from every checkpoint saved at ep 1 (zmpi.engine.moe)
OPTIONAL = {"run_id", "mesh", "tensor", "pipeline", "experts", "expert_files"}
LEGACY_RUN = "legacy"  # such checkpoints are read as one run of this id
OPTIMIZER = {"step_count": _int(0), "lr": _num(0), "eps": _num(0, open_lo=True),
             "weight_decay": _num(0), "decoupled": _of(bool),
             "betas": (lambda v: type(v) is list and len(v) == 2
                       and all(_num(0, 1)[0](b) and b < 1 for b in v), "two numbers in [0, 1)")}
LOSS_SCALER = {"scale": _num(0, open_lo=True), "hysteresis_left": _int(0),
               "clean_steps": _int(0), "skipped_steps": _int(0)}
FILE = {"file": _of(str), "bytes": _int(0),
        "crc32": (lambda v: type(v) is int and 0 <= v < 2**32, "a CRC-32 (0 <= n < 2**32)")}


def _check(section: dict, fields: dict, where: str, optional=()) -> None:
    for key, (ok, want) in fields.items():
        if key not in section:
            if key in optional:
                continue
            raise ValueError(f"{where}{key} is absent")
        if not ok(section[key]):
            raise ValueError(f"{where}{key} is {json.dumps(section[key])[:60]}, not {want}")


def check_fields(m: dict) -> None:
    """ValueError naming the first field of manifest `m` that is absent or wrong, including
    the layout's structure and the shard file names (each must be the one its rank writes,
    so no path leads outside the checkpoint's directory)."""
    _check(m, FIELDS, "", OPTIONAL)
    _check(m["optimizer"], OPTIMIZER, "optimizer.")
    if m["loss_scaler"] is not None:
        _check(m["loss_scaler"], LOSS_SCALER, "loss_scaler.")
    n = m["world_size"]
    names = _check_layout(m["layout"], n, m["num_params"])
    tp = TensorSplits.from_dict(m.get("tensor")).size
    if m.get("mesh", {"tp": 1})["tp"] != tp:
        raise ValueError(f"mesh has tp {m['mesh']['tp']}, the tensor splits are over {tp}")
    pp = _check_pipeline(m.get("pipeline"), len(m["layout"]["units"]))
    if m.get("mesh", {"pp": 1})["pp"] != pp:
        raise ValueError(f"mesh has pp {m['mesh']['pp']}, the pipeline has "
                         f"{count(pp, 'stage')}")
    if len(m["files"]) != n * tp * pp:
        raise ValueError(f"files lists {count(len(m['files']), 'shard')} for world_size {n}"
                         + (f" x tp {tp}" if tp > 1 else "") + (f" x pp {pp}" if pp > 1 else ""))
    _check_files(m["files"], "files", lambda i: shard_name(i % n, n, i // n % tp, tp,
                                                            i // (n * tp), pp))
    if ("experts" in m) != ("expert_files" in m):
        raise ValueError("experts and expert_files come together (a checkpoint saved at ep > 1)")
    if "experts" in m:
        names |= _check_experts(m)
    for alias, owner in m["tied"].items():
        if owner not in names or alias in names:
            raise ValueError(f"tied maps {alias[:60]!r} to {str(owner)[:60]!r}, not an alias to "
                             "a parameter of the layout")


def _check_files(files: list, key: str, want) -> None:
    """ValueError unless each entry of `files` (the manifest's `key`) is a file entry
    ({file, bytes, crc32}) naming want(i), the file its i-th shard is written to."""
    for i, entry in enumerate(files):
        if type(entry) is not dict:
            raise ValueError(f"{key}[{i}] is not an object")
        _check(entry, FILE, f"{key}[{i}].")
        if entry["file"] != want(i):
            raise ValueError(f"{key}[{i}] names {entry['file'][:80]!r}, not {want(i)!r}"
                             " (shard files are the checkpoint directory's own)")


def _check_experts(m: dict) -> set:
    """The expert section's parameter names (`experts`: {layout over the expert-data-parallel
    shards, tensor: its split over the ep ranks, and under pipeline parallelism pipeline:
    its units' split points between the stages}; `expert_files`, stage-major, then by ep
    rank), after checking it; ValueError otherwise."""
    experts = m["experts"]
    layout, tensor = experts.get("layout"), experts.get("tensor")
    if type(layout) is not dict or type(tensor) is not dict:
        raise ValueError("experts is not {layout, tensor}")
    n = layout.get("world_size")
    if type(n) is not int or n < 1:
        raise ValueError(f"experts.layout has world_size {n!r}, not a size")
    names = _check_layout(layout, n)
    splits = TensorSplits.from_dict(tensor)  # an ExpertSplits when split over tp too
    ep = getattr(splits, "ep", splits).size
    if m.get("mesh", {}).get("ep", 1) != ep:
        raise ValueError(f"mesh has ep {m.get('mesh', {}).get('ep', 1)}, the experts are split "
                         f"over {ep}")
    pp = _check_pipeline(experts.get("pipeline"), len(layout["units"]))
    if pp != m.get("mesh", {}).get("pp", 1):
        raise ValueError(f"experts.pipeline has {count(pp, 'stage')}, the mesh pp "
                         f"{m.get('mesh', {}).get('pp', 1)}")
    if len(m["expert_files"]) != n * splits.size * pp:
        raise ValueError(f"expert_files lists {count(len(m['expert_files']), 'shard')} for "
                         f"{n} expert-data-parallel shards x ep {ep}"
                         + (f" x tp {splits.tp.size}" if hasattr(splits, "tp") else "")
                         + (f" x pp {pp}" if pp > 1 else ""))
    _check_files(m["expert_files"], "expert_files", lambda i: expert_shard_name(
        i % n, n, i // n % splits.size, i // (n * splits.size), pp))
    if names & _names(m["layout"]):
        raise ValueError("experts.layout names parameters of the layout")
    return names


def _names(layout: dict) -> set:
    return {p["name"] for u in layout["units"] for p in u["params"]}


def _check_pipeline(pipeline, units: int) -> int:
    """The number of stages of a manifest's "pipeline" entry ({"stages": P, "bounds": the
    split points of the layout's `units`}; 1 without one); ValueError if it is not that."""
    if pipeline is None:
        return 1
    stages, bounds = pipeline.get("stages"), pipeline.get("bounds")
    if (type(stages) is not int or stages < 2 or type(bounds) is not list
            or len(bounds) != stages + 1 or not all(type(b) is int for b in bounds)
            or bounds[0] != 0 or bounds[-1] != units
            or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))):
        raise ValueError(f"pipeline is {json.dumps(pipeline)[:80]}, not {{stages: P >= 2, "
                         f"bounds: P + 1 increasing split points of the {units} units}}")
    return stages


def _check_layout(layout: dict, world_size: int, num_params: int | None = None) -> set:
    """The layout's parameter names, after checking its structure (and that it holds
    `num_params` elements, where given); ValueError otherwise."""
    if layout.get("world_size") != world_size or type(layout.get("units")) is not list:
        raise ValueError(f"layout has world_size {layout.get('world_size')!r} (the manifest "
                         f"says {world_size}) or no list of units")
    names, total = set(), 0
    for u, unit in enumerate(layout["units"]):
        where = f"layout.units[{u}]"
        params = unit.get("params") if type(unit) is dict else None
        padded = unit.get("padded_numel") if type(unit) is dict else None
        if type(params) is not list or type(padded) is not int or padded % world_size:
            raise ValueError(f"{where} is not a unit (params, padded_numel a multiple of "
                             f"{world_size})")
        offset = 0
        for p in params:
            shape = p.get("shape") if type(p) is dict else None
            if (type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape)
                    or type(p.get("name")) is not str or p["name"] in names
                    or p.get("offset") != offset):
                raise ValueError(f"{where} has a parameter entry that is not a unique name, "
                                 f"a shape and its offset {offset}: {json.dumps(p)[:80]}")
            names.add(p["name"])
            offset += math.prod(shape)
        if offset > padded:
            raise ValueError(f"{where} holds {count(offset, 'element')} in padded_numel "
                             f"{padded}")
        total += offset
    if num_params is not None and total != num_params:
        raise ValueError(f"layout holds {count(total, 'parameter')}, num_params says "
                         f"{num_params}")
    return names

"""Weights exchanged with the Hugging Face ecosystem: transformers' model directories read into
zmpi checkpoints and written from them, with the `safetensors` package (no torch).

    import_hf("gpt2-dir", "ckpt")            # a zmpi checkpoint (step 0) any layout loads
    export_hf("ckpt", "out-dir")             # config.json, generation_config.json,
                                             # model.safetensors: AutoModelForCausalLM loads it
    init_from(engine, "gpt2-dir")            # a collective: the weights alone, into any layout

A model directory is transformers' `save_pretrained` output: `config.json` and the weights in
`model.safetensors`, or in the shards a `model.safetensors.index.json` maps. Its `model_type`
picks an architecture (zmpi.checkpoint.hf_models: `ARCHITECTURES`, a class such as `GPT2`): a
table of (zmpi parameter, Hugging Face tensor, transposed?), the config keys that give zmpi's
model section and the values zmpi computes: GPT-2 (GPT2LMHeadModel) and Llama
(LlamaForCausalLM, its nn.Linear weights transposed; GQA and rope_scaling carried). Reading
a directory and writing safetensors files are zmpi.checkpoint.hf_files'; this module holds
the three commands.

Nothing here holds the whole model: the import writes a one-rank checkpoint tensor by tensor
(store.write_shard over `_LazyShard`), `init_from` reads only the tensors of a rank's owned
pieces (one at a time, through `HFSource`, ShardReader's interface), and the export reads
the checkpoint tensor by tensor (tools.whole_masters) and streams each into the safetensors
file, whose header is written first. Every problem of a directory (not a model directory,
another architecture, a key or shape that differs, a shape that differs from the run's) is
an HFError, one line naming what differs.
"""
from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from zmpi.checkpoint.hf_files import (
    CODES,
    CONFIG,
    GENERATION,
    INDEX,
    WEIGHTS,
    HFDirectory,
    np_dtype,
    write_safetensors,
)
from zmpi.checkpoint.hf_models import GPT2, HFError, Llama
from zmpi.checkpoint.manifest import read_manifest, state_crc, write_manifest
from zmpi.checkpoint.store import (
    LATEST,
    MANIFEST,
    CheckpointError,
    ShardReader,
    resolve_tag,
    shard_name,
    write_atomic,
    write_shard,
)
from zmpi.checkpoint.tensor import TensorSplits
from zmpi.checkpoint.tools import check_outside, whole_masters
from zmpi.files import check_output_dir, fsync_dir, replacing
from zmpi.words import count
from zmpi.zero.flat import ModelLayout, UnitLayout

__all__ = ["CONFIG", "GENERATION", "GPT2", "INDEX", "WEIGHTS", "HFError", "HFSource", "Llama",
           "TAG", "export_hf", "import_hf", "init_from"]

TAG = "step0"  # the tag of an imported checkpoint: the start of training


class HFSource:
    """ShardReader's `read` over a model directory, for `sharded.read_owned`: the checkpoint
    is the directory's model whole (one rank, no tensor split), and every state read is its
    weights (`master`). Holds one tensor at a time, in zmpi's layout and `dtype`."""

    def __init__(self, hf: HFDirectory, dtype):
        self.hf, self.dtype = hf, np.dtype(dtype)
        shapes = hf.arch.shapes(hf.model)
        self.manifest = {"splits_obj": TensorSplits(),
                         "layout_obj": ModelLayout([UnitLayout.build(shapes, 1)])}
        self.by_name = {t.zmpi: t for t in hf.table}
        self.by_name.update({alias: self.by_name[owner]
                             for alias, owner in hf.arch.tied(hf.model).items()})
        self._held = (None, None)

    def whole(self, name: str) -> np.ndarray:
        """Parameter `name`'s value, flat, in `dtype` (the last one asked for is kept)."""
        if self._held[0] != name:
            self._held = (name, self.hf.tensor(self.by_name[name]).astype(self.dtype).ravel())
        return self._held[1]

    def read(self, state, name, start, out, tp_rank=0) -> None:
        out[...] = self.whole(name)[start:start + len(out)]


# ---- import: a directory into a checkpoint ------------------------------------------------
class _LazyShard:
    """A one-rank checkpoint's shard of one state for store.write_shard, which slices it piece
    by piece ([at:at + n], each piece one whole parameter at world size 1): the parameter's
    value, made when it is sliced (zeros for Adam's moments)."""

    def __init__(self, source: HFSource, layout: ModelLayout, dtype, zeros=False):
        self.source, self.dtype, self.zeros = source, np.dtype(dtype), zeros
        self.at = {at: name for name, _, at, _ in layout.owned_pieces(0)}

    def __getitem__(self, piece: slice) -> np.ndarray:
        n = piece.stop - piece.start
        if self.zeros:
            return np.zeros(n, self.dtype)
        return self.source.whole(self.at[piece.start]).astype(self.dtype, copy=False)


def import_hf(directory, out, dtype=None) -> Path:
    """Write the model of transformers directory `directory` as a zmpi checkpoint in `out` (a
    new or empty directory): tag step0 at step 0 with fresh optimizer state, as one rank at
    stage 0 saves it, so any world size, mesh and strategy loads it (--resume). Parameters
    stored as `dtype` ("float16", "bfloat16", "float32", "float64"; default the directory's),
    master weights float32 (float64 for a float64 model). Returns the checkpoint's path. An
    HFError for a directory that is not a model zmpi has; a ValueError for an `out` that is
    not a new or empty directory."""
    out = Path(out)
    if dtype is not None and dtype not in CODES:
        raise ValueError(f"dtype {dtype!r}: give one of {', '.join(CODES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {out}: {'not a directory' if not out.is_dir() else 'not empty'};"
                         " give a new or empty checkpoint directory")
    check_output_dir(out, "output")
    with HFDirectory(directory) as hf:
        dtype = dtype or hf.dtype
        master = "float64" if dtype == "float64" else "float32"
        source = HFSource(hf, master)
        layout = ModelLayout([UnitLayout.build(shapes, 1) for shapes in (
            {t.zmpi: hf.arch.shapes(hf.model)[t.zmpi] for t in unit}
            for unit in hf.arch.units(hf.model))])
        body = _manifest_body(hf, layout, dtype, master)
        ckpt = out / TAG
        ckpt.mkdir(parents=True)
        states = {"params": _LazyShard(source, layout, np_dtype(dtype)),
                  "master": _LazyShard(source, layout, master),
                  "adam_m": _LazyShard(source, layout, master, zeros=True),
                  "adam_v": _LazyShard(source, layout, master, zeros=True)}
        attrs = {"checkpoint_id": body["checkpoint_id"], "rank": 0, "world_size": 1,
                 "tp_rank": 0, "pp_stage": 0, "tag": TAG, "state_crc": state_crc(body)}
        try:
            entry = write_shard(ckpt / shard_name(0, 1), layout, 0, states, attrs)
            write_manifest(ckpt / MANIFEST, dict(body, files=[entry]))
            write_atomic(out / LATEST, (TAG + "\n").encode())
        except (CheckpointError, OSError) as e:  # a full disk: no half checkpoint left
            shutil.rmtree(ckpt, ignore_errors=True)
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{out}: not written: {e.strerror or e}") from None
    return ckpt


def _manifest_body(hf: HFDirectory, layout: ModelLayout, dtype: str, master: str) -> dict:
    """The manifest of an imported checkpoint: what a fresh one-rank stage-0 run would save
    at step 0 (the optimizer's hyper-parameters are Config's defaults; a run's own win when
    it loads), its config the model section, its client state where it came from."""
    from zmpi.config import Config
    from zmpi.runinfo import git_revision

    config = Config.from_dict({"model": hf.arch.model_section(hf.model)})
    opt = config.optimizer
    return {
        "world_size": 1, "strategy": "stage0", "mesh": {"dp": 1, "pp": 1, "tp": 1},
        "dtype": dtype, "master_dtype": master, "num_params": layout.num_params,
        "layout": layout.to_dict(), "tied": hf.arch.tied(hf.model), "global_steps": 0,
        "optimizer": {"step_count": 0, "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                      "weight_decay": opt.weight_decay, "decoupled": opt.adam_w_mode},
        "scheduler": config.scheduler.to_dict(), "last_lr": opt.lr, "loss_scaler": None,
        "unpublished_update": False, "config": {"model": config.model.given()},
        "client_state": {"step": 0, "imported_from": str(hf.path)},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "git_revision": git_revision(),
        "checkpoint_id": uuid.uuid4().hex, "tag": TAG, "run_id": uuid.uuid4().hex,
    }


# ---- a run started from a directory ------------------------------------------------------
def init_from(engine, directory) -> str:
    """Put the weights of transformers directory `directory` into `engine` (a collective):
    each rank reads its owned shard of the master weights in its own layout (any world size,
    mesh and strategy), one tensor at a time; the parameters are those cast to the storage
    dtype. The optimizer state, steps and loss scaler stay as built: a fresh run from these
    weights. The same HFError on every rank if the directory is not the engine's model (its
    model section, one line naming each key that differs). Returns a line for the log."""
    from zmpi.checkpoint.agreement import agree
    from zmpi.checkpoint.sharded import read_owned
    from zmpi.engine.state import TrainState

    state = TrainState(engine)

    def read():
        with HFDirectory(directory) as hf:
            _check_run_model(hf, state, engine.config.model.given())
            source = HFSource(hf, state.master_dtype)
            master = read_owned(source, "master", state.layout, state.strategy.rank,
                                state.master_dtype, state.splits, state.tp_rank)
            return master, (hf.arch, hf.model)

    master, (arch, model) = agree(engine.comm, f"--init-from {directory}", read)
    state.restore_weights(master)
    n_layer, d, heads = (model[arch.KEYS[k]] for k in ("n_layer", "d_model", "n_head"))
    return (f"initialised from {directory} ({arch.model_type}, {count(n_layer, 'layer')}, "
            f"d_model {d}, {heads} heads, vocab {model['vocab_size']}): its weights, fresh "
            "optimizer state, step 0")


def _check_run_model(hf: HFDirectory, state, given: dict) -> None:
    """HFError unless the directory's model is the run's: every key of the architecture's
    run_model (n_head where the run's config gives it, as zmpi train's does; a Llama's heads
    and RoPE), and the same parameter names."""
    where = hf.path / CONFIG
    ours = state.saved_splits.whole_shapes(state.saved_layout)
    try:
        run = hf.arch.run_model(ours, given)
    except ValueError as e:
        raise HFError(f"{where}: mismatch: this run's model is not {hf.arch.model_type}'s: "
                      f"{e}") from None
    differ = [f"{k} {hf.model[k]} (this run {run[k]})" for k in hf.model
              if k in run and run[k] != hf.model[k]]
    if differ:
        raise HFError(f"{where}: mismatch: the model differs from this run's: "
                      f"{'; '.join(differ)}")
    want = hf.arch.shapes(hf.model)
    if ours != want:
        odd = sorted(n for n in set(ours) | set(want) if ours.get(n) != want.get(n))
        raise HFError(f"{where}: mismatch: this run's model is not {hf.arch.model_type}'s "
                      f"({count(len(odd), 'parameter')} differ: {', '.join(odd[:3])})")


# ---- export: a checkpoint into a directory ------------------------------------------------
def export_hf(directory, out, tag=None, dtype=None, n_head=None) -> Path:
    """Write checkpoint `tag` of `directory` (any world size, mesh and strategy) as a
    transformers model directory `out`: config.json, generation_config.json and
    model.safetensors, the parameters in `dtype` (default: the checkpoint's storage dtype),
    read from the shards one tensor at a time (the master weights, cast) and streamed into
    the file. The architecture is the model section's model_type (a Llama's parameter names
    otherwise). n_head: for a GPT-2 checkpoint whose config has no model section (saved
    outside zmpi train); it must agree with the config's otherwise (a Llama's heads and RoPE
    come from its model section, which it must have). Returns `out`.

    A ValueError for an `out` that is a file or inside the checkpoint directory; a
    CheckpointError for a checkpoint that is not of a model transformers has (parameters of
    another model, sparse attention, a Llama without its model section), or that does not
    read."""
    ckpt = resolve_tag(directory, tag)
    manifest = read_manifest(ckpt)
    out = Path(out)
    check_outside(directory, out, "the model directory")
    check_output_dir(out, "output")
    where = ckpt / MANIFEST
    config = manifest["config"]
    section = config.get("model") or {}
    shapes = manifest["splits_obj"].whole_shapes(manifest["layout_obj"])
    llama = section.get("model_type") == "llama" or "units.1.attn.q.weight" in shapes
    arch = Llama if llama else GPT2
    if n_head is not None and (type(n_head) is not int or n_head < 1):
        raise ValueError(f"--n-head {n_head}: give an integer >= 1")
    try:
        arch.model_of(shapes)
    except ValueError as e:
        raise CheckpointError(f"{where}: mismatch: not a {arch.model_type} checkpoint: "
                              f"{e}") from None
    model = arch.export_model(shapes, section, n_head, where)
    want = arch.shapes(model)
    if shapes != want:
        odd = sorted(n for n in set(shapes) | set(want) if shapes.get(n) != want.get(n))
        raise CheckpointError(f"{where}: mismatch: not a checkpoint of zmpi's "
                              f"{arch.model_type} ({count(len(odd), 'parameter')} differ: "
                              f"{', '.join(odd[:3])})")
    if config.get("sparse_attention"):
        raise CheckpointError(f"{where}: mismatch: its run used sparse attention, which "
                              f"transformers' {arch.model_type} does not compute (it attends "
                              "densely)")
    dtype = dtype or manifest["dtype"]
    table = {t.zmpi: t for unit in arch.units(model) for t in unit}
    hf_config = arch.hf_config(model, dtype)
    out.mkdir(parents=True, exist_ok=True)
    with ShardReader(ckpt, manifest) as reader:
        entries = [(table[name].stored(arch.prefix),
                    shape[::-1] if table[name].transpose else shape)
                   for name, shape in shapes.items()]
        values = ((np.ascontiguousarray(v.T) if table[n].transpose else v)
                  for n, v in whole_masters(reader, manifest))
        try:
            with replacing(out / WEIGHTS) as tmp:
                write_safetensors(tmp, entries, values, np_dtype(dtype))
            write_atomic(out / CONFIG, json.dumps(hf_config, indent=2).encode())
            write_atomic(out / GENERATION, json.dumps({"_from_model_config": True},
                                                      indent=2).encode())
            fsync_dir(out)
        except OSError as e:
            raise CheckpointError(f"{out}: not written: {e.strerror or e}") from None
    return out

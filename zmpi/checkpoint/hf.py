"""Weights exchanged with the Hugging Face ecosystem: transformers' model directories read into
zmpi checkpoints and written from them, with the `safetensors` package (no torch).

    import_hf("gpt2-dir", "ckpt")            # a zmpi checkpoint (step 0) any layout loads
    export_hf("ckpt", "out-dir")             # config.json, generation_config.json,
                                             # model.safetensors: AutoModelForCausalLM loads it
    init_from(engine, "gpt2-dir")            # a collective: the weights alone, into any layout

A model directory is transformers' `save_pretrained` output: `config.json` and the weights in
`model.safetensors`, or in the shards a `model.safetensors.index.json` maps. Its `model_type`
picks an architecture (`ARCHITECTURES`; a class such as `GPT2`): a table of (zmpi parameter,
Hugging Face tensor, transposed?), the config keys that give zmpi's model shape and the
values zmpi computes. GPT-2's table is here; GPT-2's Conv1D weights
are stored (in, out), as zmpi's Linear keeps them, so none is transposed (a Llama's nn.Linear
weights, (out, in), will be). Llama's layers exist (zmpi/nn/llama_layers.py) but its model
does not yet: a Llama directory is refused in one line until it does.

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
import math
import os
import re
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION = "generation_config.json"
_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_CODES = {v: k for k, v in _DTYPES.items()}
TAG = "step0"  # the tag of an imported checkpoint: the start of training


class HFError(CheckpointError):
    """A Hugging Face model directory that zmpi cannot read or write, or that is not the
    model asked for: one line naming the file and what differs."""


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of "float16", "bfloat16" (ml_dtypes), "float32" or "float64"."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ---- architectures ------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    """One parameter: its zmpi name, its Hugging Face name (without the base model's prefix)
    and whether Hugging Face stores it transposed."""

    zmpi: str
    hf: str
    transpose: bool = False


class GPT2:
    """transformers' GPT2LMHeadModel against zmpi's GPT (models/gpt.py): the same pre-LN
    blocks, tanh GELU, LayerNorm eps 1e-5 and tied LM head. HF's fused c_attn holds [q | k | v]
    with heads in order, as zmpi's qkv does, and Conv1D's (in, out) weights are zmpi's
    Linear's: no tensor is transposed or permuted."""

    model_type, hf_class, prefix = "gpt2", "GPT2LMHeadModel", "transformer."
    # config.json key -> zmpi's model section key
    SHAPE = {"n_layer": "n_layer", "n_embd": "d_model", "n_head": "n_head",
             "n_positions": "seq_len", "vocab_size": "vocab_size"}
    # what zmpi's GPT computes (config.json key: (the value, its default in transformers))
    FIXED = {"activation_function": (("gelu_new", "gelu_pytorch_tanh"), "gelu_new"),
             "layer_norm_epsilon": ((1e-5,), 1e-5), "scale_attn_weights": ((True,), True),
             "scale_attn_by_inverse_layer_idx": ((False,), False),
             "add_cross_attention": ((False,), False), "tie_word_embeddings": ((True,), True)}
    BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")  # causal masks, not weights
    HEAD = "lm_head.weight"  # tied to wte: absent from save_pretrained's files, or equal

    @staticmethod
    def units(n_layer: int) -> list[list[Tensor]]:
        """The table, unit by unit as zmpi's GPT builds them."""
        blocks = [[Tensor(f"units.{i + 1}.{z}.{w}", f"h.{i}.{h}.{w}")
                   for z, h in (("ln1", "ln_1"), ("attn.qkv", "attn.c_attn"),
                                ("attn.proj", "attn.c_proj"), ("ln2", "ln_2"),
                                ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))
                   for w in ("weight", "bias")] for i in range(n_layer)]
        head = [Tensor(f"units.{n_layer + 1}.ln_f.{w}", f"ln_f.{w}") for w in ("weight", "bias")]
        return [[Tensor("units.0.wte", "wte.weight"), Tensor("units.0.wpe", "wpe.weight")],
                *blocks, head]

    @staticmethod
    def shapes(m: dict) -> dict[str, tuple]:
        """zmpi's parameter shapes of model section `m`."""
        d, L = m["d_model"], m["n_layer"]
        block = {"ln1.weight": (d,), "ln1.bias": (d,), "attn.qkv.weight": (d, 3 * d),
                 "attn.qkv.bias": (3 * d,), "attn.proj.weight": (d, d), "attn.proj.bias": (d,),
                 "ln2.weight": (d,), "ln2.bias": (d,), "mlp.fc.weight": (d, 4 * d),
                 "mlp.fc.bias": (4 * d,), "mlp.proj.weight": (4 * d, d), "mlp.proj.bias": (d,)}
        out = {"units.0.wte": (m["vocab_size"], d), "units.0.wpe": (m["seq_len"], d)}
        for i in range(1, L + 1):
            out.update({f"units.{i}.{k}": s for k, s in block.items()})
        out.update({f"units.{L + 1}.ln_f.weight": (d,), f"units.{L + 1}.ln_f.bias": (d,)})
        return out

    @staticmethod
    def tied(m: dict) -> dict:
        return {f"units.{m['n_layer'] + 1}.wte": "units.0.wte"}  # GPT.tied_parameters

    @staticmethod
    def model_of(shapes: dict) -> dict:
        """The model section (less n_head, which no shape shows) of zmpi parameter shapes."""
        wte, wpe = shapes.get("units.0.wte"), shapes.get("units.0.wpe")
        if wte is None or wpe is None or len(wte) != 2:
            raise ValueError("it has no token and position embedding (units.0.wte, wpe)")
        n_layer = sum(1 for name in shapes if name.endswith(".attn.qkv.weight"))
        return {"n_layer": n_layer, "d_model": wte[1], "seq_len": wpe[0],
                "vocab_size": wte[0]}

    @classmethod
    def hf_config(cls, m: dict, dtype: str) -> dict:
        """config.json of model section `m` for transformers (no dropout: zmpi has none). The
        token ids are the tokenizer's, which a checkpoint does not record: null (transformers'
        GPT-2 would otherwise say 50256, outside a smaller vocabulary)."""
        out = {"architectures": [cls.hf_class], "model_type": cls.model_type,
               **{hf: m[z] for hf, z in cls.SHAPE.items()}, "n_inner": None,
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
               "initializer_range": 0.02, "scale_attn_weights": True,
               "tie_word_embeddings": True, "use_cache": True, "dtype": dtype,
               "bos_token_id": None, "eos_token_id": None}
        return out

    @classmethod
    def check(cls, config: dict, where) -> None:
        """HFError naming the first config.json key whose value zmpi's GPT does not compute."""
        n_inner, d = config.get("n_inner"), config.get("n_embd")
        if n_inner is not None and n_inner != (4 * d if type(d) is int else None):
            raise HFError(f"{where}: mismatch: n_inner {n_inner}: zmpi's GPT-2 MLP is 4 x "
                          f"n_embd ({d})")
        for key, (allowed, default) in cls.FIXED.items():
            value = config.get(key, default)
            if value not in allowed:
                raise HFError(f"{where}: mismatch: {key} {value!r}: zmpi's GPT-2 computes "
                              f"{' or '.join(map(repr, allowed))}")


# model_type -> Architecture, or why zmpi cannot take it yet
ARCHITECTURES = {"gpt2": GPT2}
NOT_BUILT = {"llama": "zmpi's Llama model is not built yet (its layers are in "
                      "zmpi/nn/llama_layers.py; models/llama.py is to come)"}


def architecture(model_type, where):
    """The architecture of config.json's model_type, or an HFError saying why there is none."""
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    if model_type in NOT_BUILT:
        raise HFError(f"{where}: model_type {model_type!r}: {NOT_BUILT[model_type]}")
    raise HFError(f"{where}: model_type {model_type!r}: zmpi has no such model (it reads "
                  f"{', '.join(map(repr, ARCHITECTURES))})")


# ---- reading a model directory ------------------------------------------------------------
class HFDirectory:
    """A transformers model directory, checked: config.json names an architecture zmpi has
    and every value it cannot compute is refused; the weights (one safetensors file or the
    shards of an index) hold exactly the architecture's tensors, of the shapes config.json
    gives, in a dtype zmpi stores. `model` is zmpi's model section (n_layer, d_model, n_head,
    seq_len, vocab_size), `dtype` the weights' dtype name (that of the token embedding),
    `tensor(t)` a Tensor's value in zmpi's layout (transposed where the table says). Use as a
    context manager (closes the files)."""

    def __init__(self, path):
        self.path = path = Path(path)
        if not path.is_dir():
            raise HFError(f"{path}: missing: no such Hugging Face model directory"
                          if not path.exists() else f"{path}: not a directory")
        self.config = _read_json(path / CONFIG, "the model's config (transformers' "
                                                "save_pretrained writes it)")
        where = path / CONFIG
        self.arch = arch = architecture(self.config.get("model_type"), where)
        model = {}
        for hf, z in arch.SHAPE.items():
            value = self.config.get(hf)
            if type(value) is not int or value < 1:
                raise HFError(f"{where}: corrupt: {hf} is {value!r}, not an integer >= 1")
            model[z] = value
        if model["d_model"] % model["n_head"]:
            raise HFError(f"{where}: corrupt: n_head {model['n_head']} does not divide n_embd "
                          f"{model['d_model']}")
        arch.check(self.config, where)
        self.model, self._handles = model, {}
        self.table = [t for unit in arch.units(model["n_layer"]) for t in unit]
        try:
            self.files = self._weight_files()  # stored tensor name -> file
            self._check_tensors()
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def _weight_files(self) -> dict:
        """{stored tensor name: its file} of model.safetensors or the index's shards."""
        path, index = self.path, self.path / INDEX
        if index.is_file():
            weight_map = _read_json(index, "").get("weight_map")
            if type(weight_map) is not dict or not weight_map:
                raise HFError(f"{index}: corrupt: no weight_map of tensor names to files")
            for name, file in weight_map.items():
                if type(file) is not str or Path(file).name != file or file.startswith("."):
                    raise HFError(f"{index}: corrupt: {name} is in {file!r}, not a file of "
                                  "the directory")
                if not (path / file).is_file():
                    raise HFError(f"{path / file}: missing: the shard {index.name} names for "
                                  f"{name}")
            files = {name: path / file for name, file in weight_map.items()}
        elif (path / WEIGHTS).is_file():
            files = dict.fromkeys(self._open(path / WEIGHTS).keys(), path / WEIGHTS)
        else:
            others = sorted(p.name for p in path.glob("*.bin")) + sorted(
                p.name for p in path.glob("*.h5")) + sorted(p.name for p in path.glob("*.msgpack"))
            raise HFError(f"{path}: missing: no {WEIGHTS} or {INDEX}" + (
                f" (only {', '.join(others[:3])}: zmpi reads safetensors weights; save them "
                "with save_pretrained(..., safe_serialization=True))" if others else ""))
        for file in set(files.values()):
            held = set(self._open(file).keys())
            listed = {n for n, f in files.items() if f == file}
            if not listed <= held:
                raise HFError(f"{file}: mismatch: it lacks {sorted(listed - held)[0]}, which "
                              f"{INDEX} places there")
        return files

    def _open(self, file: Path):
        if file not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                handle = safe_open(str(file), framework="np")
                self._handles[file] = handle.__enter__()
            except (SafetensorError, OSError) as e:
                raise HFError(f"{file}: corrupt: not a safetensors file ({e})") from None
        return self._handles[file]

    def _check_tensors(self) -> None:
        stored = set(self.files)
        prefix = self.arch.prefix
        self.prefix = prefix if any(n.startswith(prefix) for n in stored) else ""
        want = {self.prefix + t.hf: t for t in self.table}
        extra = sorted(n for n in stored - set(want) if not self._ignored(n))
        missing = sorted(set(want) - stored)
        where = self.path
        if missing or extra:
            said = [f"{count(len(names), 'tensor')} {what} ({', '.join(names[:3])}"
                    f"{', ...' if len(names) > 3 else ''})"
                    for names, what in ((missing, "missing"), (extra, "that zmpi's "
                                        f"{self.arch.model_type} has no place for"))
                    if names]
            raise HFError(f"{where}: mismatch: {'; '.join(said)}")
        expected = self.arch.shapes(self.model)
        for name, t in want.items():
            sliced = self._open(self.files[name]).get_slice(name)
            shape, code = tuple(sliced.get_shape()), sliced.get_dtype()
            hf_shape = expected[t.zmpi][::-1] if t.transpose else expected[t.zmpi]
            if shape != hf_shape:
                raise HFError(f"{self.files[name]}: mismatch: {name} is {shape}, config.json "
                              f"gives {hf_shape}")
            if code not in _DTYPES:
                raise HFError(f"{self.files[name]}: mismatch: {name} is {code}; zmpi reads "
                              f"{', '.join(_DTYPES)}")
        self.dtype = _DTYPES[self._code(self.prefix + self.table[0].hf)]

    def _ignored(self, name: str) -> bool:
        """A stored tensor that is no parameter (a buffer), or the LM head tied to wte."""
        bare = name[len(self.prefix):] if name.startswith(self.prefix) else name
        if self.arch.BUFFERS.match(bare):
            return True
        if name == self.arch.HEAD:
            wte = self.prefix + self.table[0].hf
            if not np.array_equal(self._raw(name), self._raw(wte)):
                raise HFError(f"{self.files[name]}: mismatch: {name} differs from {wte}; zmpi's "
                              f"{self.arch.model_type} ties its LM head to the embedding")
            return True
        return False

    def _code(self, name: str) -> str:
        return self._open(self.files[name]).get_slice(name).get_dtype()

    def _raw(self, name: str) -> np.ndarray:
        """The stored tensor as it is (bfloat16 through its bits: safetensors' NumPy API has
        no bfloat16)."""
        file = self.files[name]
        if self._code(name) != "BF16":
            return self._open(file).get_tensor(name)
        return _read_bf16(file, name)

    def tensor(self, t: Tensor) -> np.ndarray:
        value = self._raw(self.prefix + t.hf)
        return np.ascontiguousarray(value.T) if t.transpose else value


def _read_bf16(file: Path, name: str) -> np.ndarray:
    """A BF16 tensor of a safetensors file, from its header's offsets (the format: an 8-byte
    little-endian header length, the JSON header, then the data)."""
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        entry = json.loads(f.read(n))[name]
        begin, end = entry["data_offsets"]
        f.seek(8 + n + begin)
        bits = np.frombuffer(f.read(end - begin), "<u2")
    return bits.view(np_dtype("bfloat16")).reshape(entry["shape"])


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise HFError(f"{path}: missing: no {path.name}" + (f", {what}" if what else "")
                      + "; this is not a transformers model directory")
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise HFError(f"{path}: corrupt: not JSON ({str(e)[:80]})") from None
    if type(value) is not dict:
        raise HFError(f"{path}: corrupt: not a JSON object")
    return value


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
    if dtype is not None and dtype not in _CODES:
        raise ValueError(f"dtype {dtype!r}: give one of {', '.join(_CODES)}")
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
            for unit in hf.arch.units(hf.model["n_layer"]))])
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

    model = {"n_layer", "d_model", "n_head", "seq_len", "vocab_size"}
    config = Config.from_dict({"model": {k: hf.model[k] for k in sorted(model)}})
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
    from zmpi.checkpoint.sharded import agree, read_owned
    from zmpi.engine.state import TrainState

    state = TrainState(engine)

    def read():
        with HFDirectory(directory) as hf:
            _check_run_model(hf, state, engine.config.model.given())
            source = HFSource(hf, state.master_dtype)
            master = read_owned(source, "master", state.layout, state.strategy.rank,
                                state.master_dtype, state.splits, state.tp_rank)
            return master, hf.model

    master, model = agree(engine.comm, f"--init-from {directory}", read)
    state.restore_weights(master)
    return (f"initialised from {directory} ({count(model['n_layer'], 'layer')}, d_model "
            f"{model['d_model']}, {model['n_head']} heads, vocab {model['vocab_size']}): its "
            "weights, fresh optimizer state, step 0")


def _check_run_model(hf: HFDirectory, state, given: dict) -> None:
    """HFError unless the directory's model is the run's: every shape key (n_head where the
    run's config gives it, as zmpi train's does), and the same parameter names."""
    where = hf.path / CONFIG
    ours = state.saved_splits.whole_shapes(state.saved_layout)
    try:
        run = {**hf.arch.model_of(ours), **{k: v for k, v in given.items() if k == "n_head"}}
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
    the file. n_head: for a checkpoint whose config has no model section (saved outside zmpi
    train); it must agree with the config's otherwise. Returns `out`.

    A ValueError for an `out` that is a file or inside the checkpoint directory; a
    CheckpointError for a checkpoint that is not of a model transformers has (parameters of
    another model, sparse attention), or that does not read."""
    ckpt = resolve_tag(directory, tag)
    manifest = read_manifest(ckpt)
    out = Path(out)
    check_outside(directory, out, "the model directory")
    check_output_dir(out, "output")
    arch, where = GPT2, ckpt / MANIFEST
    config = manifest["config"]
    shapes = manifest["splits_obj"].whole_shapes(manifest["layout_obj"])
    try:
        model = arch.model_of(shapes)
    except ValueError as e:
        raise CheckpointError(f"{where}: mismatch: not a GPT-2 checkpoint: {e}") from None
    saved_heads = (config.get("model") or {}).get("n_head")
    if n_head is not None and (type(n_head) is not int or n_head < 1):
        raise ValueError(f"--n-head {n_head}: give an integer >= 1")
    if n_head is not None and saved_heads not in (None, n_head):
        raise ValueError(f"--n-head {n_head}: the checkpoint's model has n_head {saved_heads}")
    model["n_head"] = n_head or saved_heads
    if model["n_head"] is None:
        raise ValueError(f"{where}: its config has no model.n_head (saved outside zmpi train, "
                         "and no parameter's shape shows it): give --n-head")
    if model["d_model"] % model["n_head"]:
        raise ValueError(f"n_head {model['n_head']} does not divide d_model {model['d_model']}")
    want = arch.shapes(model)
    if shapes != want:
        odd = sorted(n for n in set(shapes) | set(want) if shapes.get(n) != want.get(n))
        raise CheckpointError(f"{where}: mismatch: not a checkpoint of zmpi's GPT-2 "
                              f"({count(len(odd), 'parameter')} differ: {', '.join(odd[:3])})")
    if config.get("sparse_attention"):
        raise CheckpointError(f"{where}: mismatch: its run used sparse attention, which "
                              "transformers' GPT-2 does not compute (it attends densely)")
    dtype = dtype or manifest["dtype"]
    table = {t.zmpi: t for unit in arch.units(model["n_layer"]) for t in unit}
    hf_config = arch.hf_config(model, dtype)
    out.mkdir(parents=True, exist_ok=True)
    with ShardReader(ckpt, manifest) as reader:
        entries = [(arch.prefix + table[name].hf,
                    shape[::-1] if table[name].transpose else shape)
                   for name, shape in shapes.items()]
        values = ((np.ascontiguousarray(v.T) if table[n].transpose else v)
                  for n, v in whole_masters(reader, manifest))
        try:
            with replacing(out / WEIGHTS) as tmp:
                _write_safetensors(tmp, entries, values, np_dtype(dtype))
            write_atomic(out / CONFIG, json.dumps(hf_config, indent=2).encode())
            write_atomic(out / GENERATION, json.dumps({"_from_model_config": True},
                                                      indent=2).encode())
            fsync_dir(out)
        except OSError as e:
            raise CheckpointError(f"{out}: not written: {e.strerror or e}") from None
    return out


def _write_safetensors(path: Path, entries, values, dtype: np.dtype) -> None:
    """A safetensors file of tensors `entries` ((name, shape), in order) whose values come one
    at a time from `values`, cast to `dtype`: the header (8-byte little-endian length, JSON
    padded to 8 bytes with spaces) first, then each tensor's bytes, so only one is held."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype.name], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for (name, shape), value in zip(entries, values, strict=True):
            value = np.ascontiguousarray(value, dtype=dtype)  # (little-endian hosts)
            if value.shape != tuple(shape):
                raise CheckpointError(f"{name}: mismatch: {value.shape}, the header says {shape}")
            f.write(value.tobytes())
        f.flush()
        os.fsync(f.fileno())

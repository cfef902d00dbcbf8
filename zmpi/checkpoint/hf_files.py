"""The files of a transformers model directory (zmpi.checkpoint.hf): `HFDirectory` reads and
checks one (config.json against an architecture of zmpi.checkpoint.hf_models, the weights of
model.safetensors or of the shards its index maps, through the `safetensors` package; no
torch), `write_safetensors` streams tensors into a safetensors file one at a time. Every
problem of a directory is an HFError, one line naming the file and what differs.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from zmpi.checkpoint.hf_models import HFError, Tensor, architecture
from zmpi.checkpoint.store import CheckpointError
from zmpi.words import count

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION = "generation_config.json"
DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
CODES = {v: k for k, v in DTYPES.items()}


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of "float16", "bfloat16" (ml_dtypes), "float32" or "float64"."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# ---- reading a model directory ------------------------------------------------------------
class HFDirectory:
    """A transformers model directory, checked: config.json names an architecture zmpi has
    and every value it cannot compute is refused; the weights (one safetensors file or the
    shards of an index) hold exactly the architecture's tensors, of the shapes config.json
    gives, in a dtype zmpi stores. `model` is the model zmpi reads from config.json (GPT-2's
    n_layer, d_model, n_head, seq_len, vocab_size; a Llama's LlamaConfig keys), `dtype` the
    weights' dtype name (that of the token embedding), `tensor(t)` a Tensor's value in zmpi's
    layout (transposed where the table says). Use as a context manager (closes the files)."""

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
            if value is None and hf in arch.DEFAULTS:
                value = model[arch.DEFAULTS[hf]]
            if type(value) is not int or value < 1:
                raise HFError(f"{where}: corrupt: {hf} is {value!r}, not an integer >= 1")
            model[z] = value
        d, heads = (model[arch.KEYS[k]] for k in ("d_model", "n_head"))
        if d % heads:
            raise HFError(f"{where}: corrupt: {arch.KEYS['n_head']} {heads} does not divide "
                          f"{arch.KEYS['d_model']} {d}")
        arch.check(self.config, where)
        arch.read(self.config, model, where)
        self.model, self._handles = model, {}
        self.table = [t for unit in arch.units(model) for t in unit]
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
        want = {t.stored(self.prefix): t for t in self.table}
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
            if code not in DTYPES:
                raise HFError(f"{self.files[name]}: mismatch: {name} is {code}; zmpi reads "
                              f"{', '.join(DTYPES)}")
        self.dtype = DTYPES[self._code(self.prefix + self.table[0].hf)]

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
        value = self._raw(t.stored(self.prefix))
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


# ---- writing a safetensors file -----------------------------------------------------------
def write_safetensors(path: Path, entries, values, dtype: np.dtype) -> None:
    """A safetensors file of tensors `entries` ((name, shape), in order) whose values come one
    at a time from `values`, cast to `dtype`: the header (8-byte little-endian length, JSON
    padded to 8 bytes with spaces) first, then each tensor's bytes, so only one is held."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype.name], "shape": list(shape),
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

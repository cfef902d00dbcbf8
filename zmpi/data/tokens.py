"""Binary token files for zmpi.data: `load_tokens` (nanoGPT's flat uint16 .bin files, or
uint32 ones where their meta.json says so, memory-mapped), `FileWatch` (the map's file
checked unchanged before each read), `check_vocab_size`, and `read_meta`, which reads
meta.json or nanoGPT's meta.pkl with a restricted unpickler that refuses every global, so a
crafted file cannot run code."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

__all__ = ["load_tokens", "check_vocab_size", "read_meta", "MAX_VOCAB", "DTYPES",
           "FileWatch", "DataChanged"]


def load_tokens(path, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """(tokens, vocab size) of a flat binary token file: uint16 ids, the format nanoGPT's
    prepare.py writes (e.g. OpenWebText's train.bin), or uint32 ids where a meta.json beside
    it says {"dtype": "uint32"} (`zmpi data prepare` for a vocabulary over 65536),
    memory-mapped, never read whole. The vocabulary size comes from `vocab_size`, else from
    meta.json ({"vocab_size": V}) or nanoGPT's meta.pkl beside the file (read by `read_meta`,
    which never runs code); ValueError otherwise, if `path` is no regular file (a FIFO, a
    device: zmpi.files.check_input), if the dtype is not one of DTYPES or the file's size not
    a multiple of it, if the vocabulary size is not an int in 1..65536 (1..2**32 for uint32),
    or if the first million ids do not fit it."""

    from zmpi.files import check_input

    path = check_input(path, "")  # a FIFO or a device would hang the memory map
    meta = next((path.parent / name for name in ("meta.json", "meta.pkl")
                 if (path.parent / name).exists()), None)
    d = read_meta(meta) if meta is not None else {}
    dtype = d.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise ValueError(f"{meta}: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    limit = int(np.iinfo(dtype).max) + 1
    if vocab_size is not None:
        check_vocab_size(vocab_size, "vocab_size", limit)
    elif meta is None:
        raise ValueError(f"{path}: give the vocabulary size (--vocab-size), or put a "
                         "meta.json {\"vocab_size\": V} beside the file")
    elif "vocab_size" not in d:
        raise ValueError(f"{meta}: has no \"vocab_size\" key")
    else:
        vocab_size = check_vocab_size(d["vocab_size"], f"{meta}: vocab_size", limit)
    if path.stat().st_size % np.dtype(dtype).itemsize:
        raise ValueError(f"{path}: {path.stat().st_size:,} bytes, not a whole number of "
                         f"{dtype} ids")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    head = tokens[: 1 << 20]
    if len(head) and int(head.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(head.max())} >= vocab size {vocab_size}")
    return tokens, int(vocab_size)


class DataChanged(RuntimeError):
    """A token file read in place changed while it was read (`FileWatch.check`)."""


class FileWatch:
    """What a memory-mapped file was when it was mapped (device, inode, size, modification
    time): `check()` before each read of the map raises DataChanged naming the file and how
    it changed: cut short (a page past its new end is a SIGBUS that kills the process with
    no word), rewritten in place, or replaced, or gone (the run would go on with other
    tokens than its data's)."""

    def __init__(self, path, what: str = "--data"):
        self.path, self.what = Path(path), what
        self.seen = self._identity()

    def _identity(self) -> tuple:
        st = os.stat(self.path)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def check(self) -> None:
        try:
            now = self._identity()
        except OSError as e:
            raise DataChanged(f"{self.what} {self.path}: gone while training reads it: "
                              f"{e.strerror}") from None
        if now == self.seen:
            return
        how = ("replaced by another file" if now[:2] != self.seen[:2] else
               f"cut from {self.seen[2]:,} to {now[2]:,} bytes" if now[2] < self.seen[2] else
               f"grown from {self.seen[2]:,} to {now[2]:,} bytes" if now[2] > self.seen[2]
               else "rewritten in place")
        raise DataChanged(f"{self.what} {self.path} changed while training reads it ({how}): "
                          "restore it (or give the new file) and --resume")


MAX_VOCAB = 1 << 16  # token files hold uint16 ids (uint32 where their meta.json says so)
DTYPES = ("uint16", "uint32")  # a token file's dtypes, smallest first


def check_vocab_size(value, what: str = "vocab_size", limit: int = MAX_VOCAB) -> int:
    """`value` if it is an int in 1..limit (bool is not an int); ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 1 <= value <= limit:
        ids = "uint16" if limit == MAX_VOCAB else "uint32"
        raise ValueError(f"{what} must be an int in 1..{limit} (the ids are {ids}), "
                         f"got {value!r}")
    return int(value)


class _PlainUnpickler(pickle.Unpickler):
    """Loads only dicts, lists, tuples, sets, strings, bytes, numbers, bools and None: every
    global (a class, a function: what a crafted pickle calls to run code) is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name} (only plain data is "
                                     "loaded)")


def read_meta(path) -> dict:
    """The vocabulary metadata object in `path`: meta.json, or nanoGPT's meta.pkl (a dict
    with vocab_size, itos, stoi) read by an unpickler that refuses every class and function,
    so a crafted file cannot run code. ValueError naming the file otherwise."""
    import json

    from zmpi.files import check_input

    path = check_input(path, "")  # a FIFO would wait for a writer
    try:
        if path.suffix == ".pkl":
            with open(path, "rb") as f:
                d = _PlainUnpickler(f).load()
        else:
            d = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except Exception as e:  # noqa: BLE001 - any malformed file; nothing in it ran
        kind = "a plain-data pickle" if path.suffix == ".pkl" else "valid JSON"
        raise ValueError(f"{path}: not {kind}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: holds a {type(d).__name__}, not a dict with vocab_size")
    return d

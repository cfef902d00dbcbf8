"""Binary token files for zmpi.data: `load_tokens` (nanoGPT's flat uint16 .bin files,
memory-mapped), `check_vocab_size`, and `read_meta`, which reads meta.json or nanoGPT's meta.pkl
with a restricted unpickler that refuses every global, so a crafted file cannot run code."""

from __future__ import annotations

import pickle

import numpy as np

__all__ = ["load_tokens", "check_vocab_size", "read_meta", "MAX_VOCAB"]


def load_tokens(path, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """(tokens, vocab size) of a flat binary token file: uint16 ids, the format nanoGPT's
    prepare.py writes (e.g. OpenWebText's train.bin), memory-mapped, never read whole. The
    vocabulary size comes from `vocab_size`, else from meta.json ({"vocab_size": V}) or
    nanoGPT's meta.pkl beside the file (read by `read_meta`, which never runs code); ValueError
    otherwise, if the vocabulary size is not an int in 1..65536, or if the first million ids
    do not fit it."""
    from pathlib import Path

    path = Path(path)
    if vocab_size is not None:
        check_vocab_size(vocab_size, "vocab_size")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if vocab_size is None:
        meta = next((path.parent / name for name in ("meta.json", "meta.pkl")
                     if (path.parent / name).exists()), None)
        if meta is None:
            raise ValueError(f"{path}: give the vocabulary size (--vocab-size), or put a "
                             "meta.json {\"vocab_size\": V} beside the file")
        d = read_meta(meta)
        if "vocab_size" not in d:
            raise ValueError(f"{meta}: has no \"vocab_size\" key")
        vocab_size = check_vocab_size(d["vocab_size"], f"{meta}: vocab_size")
    head = tokens[: 1 << 20]
    if len(head) and int(head.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(head.max())} >= vocab size {vocab_size}")
    return tokens, int(vocab_size)


MAX_VOCAB = 1 << 16  # token files hold uint16 ids


def check_vocab_size(value, what: str = "vocab_size") -> int:
    """`value` if it is an int in 1..65536 (bool is not an int); ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 1 <= value <= MAX_VOCAB:
        raise ValueError(f"{what} must be an int in 1..{MAX_VOCAB} (the ids are uint16), "
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
    from pathlib import Path

    path = Path(path)
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

"""Token files from a text corpus and a Hugging Face tokenizer file (`zmpi data prepare`).

    info = prepare("tokenizer.json", "corpus.txt", "data/train.bin")
    # info == {"tokens": N, "vocab_size": V, "dtype": "uint16", ...}; data/meta.json written

The tokenizer is a local `tokenizer.json` read by the `tokenizers` package (the `data` extra;
nothing is fetched). The corpus is read and encoded in pieces of about `chunk_bytes` that end
at a line end, so a corpus larger than memory streams through; the ids are written as a flat
array of the smallest unsigned dtype that holds every id (`token_dtype`), the format
`load_tokens` and `zmpi train --data` read, and the vocabulary size and dtype go into
meta.json beside the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from zmpi.files import check_input, check_output, fsync_dir, replacing, write_atomic

from .tokens import DTYPES

__all__ = ["prepare", "token_dtype", "load_tokenizer", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 20  # corpus bytes per piece encoded (and per progress-bar update)


def token_dtype(vocab_size: int) -> str:
    """The dtype name of a token file for `vocab_size` ids: "uint16" when every id (at most
    vocab_size - 1) fits in 16 bits, else "uint32"; ValueError beyond uint32."""
    for name in DTYPES:
        if vocab_size <= np.iinfo(name).max + 1:
            return name
    raise ValueError(f"vocabulary of {vocab_size:,} ids: more than a uint32 token file holds")


def load_tokenizer(path):
    """The `tokenizers.Tokenizer` saved in `path` (a tokenizer.json); ValueError, one line,
    if `tokenizers` is not installed, or `path` is missing, not a regular file, unreadable or
    not a tokenizer file."""
    path = check_input(path, "--tokenizer")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("the tokenizers package is not installed: pip install "
                         "'zmpi[data]'") from None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--tokenizer {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--tokenizer {path}: not a tokenizer.json (not UTF-8 text)") from None
    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the Rust side's error for any malformed file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--tokenizer {path}: not a tokenizer.json ({reason})") from None


def _pieces(f, chunk_bytes: int, said: str):
    """The bytes of binary file `f` in pieces of about `chunk_bytes`, each ending at a line end
    (or the file's end: a line is never split); a read error is a ValueError `said: ...`."""
    while True:
        try:
            piece = f.read(chunk_bytes)
            if piece and not piece.endswith(b"\n"):
                piece += f.readline()
        except OSError as e:
            raise ValueError(f"{said}: cannot read: {e.strerror}") from None
        if not piece:
            return
        yield piece


def _write(f, data: bytes | None, out: Path) -> None:
    """`data` written to `f`, or with None `f` flushed and fsynced; a write error (a full disk)
    is a ValueError naming `out`."""
    try:
        if data is None:
            f.flush()
            os.fsync(f.fileno())
        else:
            f.write(data)
    except OSError as e:
        raise ValueError(f"output {out}: cannot write: {e.strerror}") from None


def _check_meta(meta: Path, said: dict, overwrite: bool) -> bool:
    """Whether meta.json must be written: not if it is there and says the same vocab_size and
    dtype (train.bin and val.bin of one tokenizer share it); ValueError if it says otherwise,
    unless `overwrite`, or if it is not a regular file (a FIFO would block the read)."""
    check_output(meta, "meta.json")
    if not meta.exists() or overwrite:
        return True
    try:
        there = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta} is there and not readable JSON ({e}): give --overwrite to "
                         "replace it") from None
    there = {k: there.get(k) for k in ("vocab_size", "dtype")} if isinstance(there, dict) \
        else there
    if there != {k: said[k] for k in ("vocab_size", "dtype")}:
        raise ValueError(f"{meta} is there for other tokens ({there}, these are "
                         f"vocab_size {said['vocab_size']}, dtype {said['dtype']}): give "
                         "--overwrite to replace it, or write into another directory")
    return False


def prepare(tokenizer, corpus, out, overwrite: bool = False, chunk_bytes: int = CHUNK_BYTES,
            progress: bool = True) -> dict:
    """Encode the UTF-8 text file `corpus` with the tokenizer.json `tokenizer` into the token
    file `out`, and write meta.json ({"vocab_size", "dtype", "tokenizer"}) beside it.

    The ids are those of `Tokenizer.encode(text, add_special_tokens=False)` applied to pieces of
    the corpus that end at line ends (equal to encoding it whole for a tokenizer whose
    pre-tokenizer splits at whitespace); their dtype is `token_dtype(vocab_size)`, the
    vocabulary size counting added tokens. A tqdm bar on stderr follows the bytes read when
    the corpus is longer than one piece (and `progress`). `out` is written whole or not at all.

    ValueError, one line: a tokenizer problem (`load_tokenizer`), a corpus or output that is
    not a regular file (a FIFO, a device, a directory) or cannot be read or written, an
    existing `out` (or a meta.json there for another vocabulary) without `overwrite`, a corpus
    that is not UTF-8 (the byte offset named) or gives no tokens. Returns {"tokens",
    "vocab_size", "dtype", "out", "meta"}."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    tok = load_tokenizer(tokenizer)
    corpus = check_input(corpus, "corpus")
    out = check_output(out, "output")
    if out.exists() and not overwrite:
        raise ValueError(f"output {out} exists: give --overwrite to replace it")
    if out.resolve() == corpus.resolve():
        raise ValueError(f"output {out} is the corpus itself")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    said = {"vocab_size": vocab_size, "dtype": token_dtype(vocab_size),
            "tokenizer": os.path.abspath(tokenizer)}
    meta = out.parent / "meta.json"  # where load_tokens(out) looks
    write_meta = _check_meta(meta, said, overwrite)
    size = corpus.stat().st_size
    n = 0
    from tqdm import tqdm

    with replacing(out) as tmp, open(tmp, "wb") as dst:
        try:
            src = open(corpus, "rb")
        except OSError as e:
            raise ValueError(f"corpus {corpus}: cannot read: {e.strerror}") from None
        with src, tqdm(total=size, unit="B", unit_scale=True, desc="tokenizing",
                       disable=not progress or size <= chunk_bytes) as bar:
            offset = 0
            for piece in _pieces(src, chunk_bytes, f"corpus {corpus}"):
                try:
                    text = piece.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"corpus {corpus}: not UTF-8 text (byte "
                                     f"{offset + e.start:,})") from None
                ids = np.asarray(tok.encode(text, add_special_tokens=False).ids,
                                 dtype=said["dtype"])
                _write(dst, ids.tobytes(), out)
                n += len(ids)
                offset += len(piece)
                bar.update(len(piece))
        if n == 0:
            raise ValueError(f"corpus {corpus}: empty (no tokens)" if size else
                             f"corpus {corpus}: empty (0 bytes)")
        _write(dst, None, out)  # flushed and synced: a full disk is seen here, not later
    try:
        fsync_dir(out.resolve().parent)
        if write_meta:
            write_atomic(meta, (json.dumps(said, indent=1) + "\n").encode())
    except OSError as e:
        raise ValueError(f"{meta}: cannot write: {e.strerror} ({out} is written)") from None
    return {"tokens": n, "vocab_size": vocab_size, "dtype": said["dtype"], "out": str(out),
            "meta": str(meta)}

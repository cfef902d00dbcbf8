"""The packaged corpora and the character tokenizer of zmpi.data: `load_text` reads
`zmpi/data/<name>.txt` (tiny Shakespeare by default) through importlib.resources, and
`CharTokenizer` maps characters to int32 ids and back."""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["load_text", "CharTokenizer"]


def load_text(name: str = "tinyshakespeare") -> str:
    """The packaged corpus `zmpi/data/<name>.txt` as a string."""
    pkg = resources.files(__package__)  # zmpi.data: the .txt files sit beside us
    path = pkg.joinpath(f"{name}.txt")
    if not path.is_file():
        names = sorted(p.name[:-4] for p in pkg.iterdir() if p.name.endswith(".txt"))
        raise ValueError(f"no corpus named {name!r}; available: {', '.join(names)}")
    return path.read_text(encoding="utf-8")


class CharTokenizer:
    """Character-level tokenizer; the vocabulary is the sorted set of characters of `text`."""

    def __init__(self, text: str):
        if not text:
            raise ValueError("cannot build a vocabulary from empty text")
        self.chars = "".join(sorted(set(text)))
        self._codes = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted (V,)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> np.ndarray:
        """(len(s),) int32 token ids; ValueError naming the first character not in the vocab."""
        codes = np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self._codes, codes)
        ok = self._codes[np.minimum(ids, self.vocab_size - 1)] == codes
        if not ok.all():
            i = int(np.argmin(ok))
            raise ValueError(f"character {s[i]!r} (U+{ord(s[i]):04X}) at position {i} "
                             "is not in the vocabulary")
        return ids.astype(np.int32)

    def decode(self, ids) -> str:
        """Inverse of `encode`; ValueError for ids outside [0, vocab_size)."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got "
                             f"[{ids.min()}, {ids.max()}]")
        return self._codes[ids.astype(np.int64)].tobytes().decode("utf-32-le")

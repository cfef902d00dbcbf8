"""Training data: the packaged corpus, a character tokenizer and rank-sliced batch samplers.

    text = load_text()                                  # tiny Shakespeare, 1.1 MB
    tok = CharTokenizer(text)                           # tok.vocab_size == 65
    train, val = train_val_split(tok.encode(text))
    sampler = BatchSampler(train, seq_len=64, global_batch=12, rank=r, world_size=4)
    x, y = sampler.sample(step)                         # (3, 64) int64 each; y = x shifted by 1

Data parallelism contract: the global batch of a step depends only on (seed, step), and rank r
gets rows [r*b, (r+1)*b) of it with b = global_batch // world_size. So N ranks together see
exactly the batch a single-process reference sees (`global_sample(step)`), which is what the
multi-rank tests compare against. No global random state is used.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

__all__ = ["load_text", "CharTokenizer", "train_val_split", "BatchSampler", "SyntheticSource"]


def load_text(name: str = "tinyshakespeare") -> str:
    """The packaged corpus `zmpi/data/<name>.txt` as a string."""
    pkg = resources.files(__name__)
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


def load_tokens(path, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """(tokens, vocab size) of a flat binary token file: uint16 ids, the format nanoGPT's
    prepare.py writes (e.g. OpenWebText's train.bin), memory-mapped, never read whole. The
    vocabulary size comes from `vocab_size`, else from meta.json ({"vocab_size": V}) or
    nanoGPT's meta.pkl beside the file; ValueError otherwise, or if the first million ids do
    not fit it."""
    import json
    import pickle
    from pathlib import Path

    path = Path(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if vocab_size is None:
        if (path.parent / "meta.json").exists():
            vocab_size = json.loads((path.parent / "meta.json").read_text())["vocab_size"]
        elif (path.parent / "meta.pkl").exists():
            with open(path.parent / "meta.pkl", "rb") as f:
                vocab_size = pickle.load(f)["vocab_size"]
        else:
            raise ValueError(f"{path}: give the vocabulary size (--vocab-size), or put a "
                             "meta.json {\"vocab_size\": V} beside the file")
    head = tokens[: 1 << 20]
    if len(head) and int(head.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(head.max())} >= vocab size {vocab_size}")
    return tokens, int(vocab_size)


def train_val_split(tokens, val_fraction: float = 0.1):
    """(train, val): the first (1 - val_fraction) of `tokens` and the rest, as views."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_train = len(tokens) - int(round(len(tokens) * val_fraction))
    return tokens[:n_train], tokens[n_train:]


class _GlobalBatchSource:
    """Base of the samplers: validation, this rank's row slice and iteration.
    Subclasses implement `_rows(step, lo, hi)` -> rows [lo, hi) of the step's global batch."""

    def __init__(self, seq_len, global_batch, rank=0, world_size=1, seed=0):
        for k, v in (("seq_len", seq_len), ("global_batch", global_batch),
                     ("world_size", world_size)):
            if int(v) != v or v < 1:
                raise ValueError(f"{k} must be an int >= 1, got {v}")
        if global_batch % world_size:
            raise ValueError(f"global_batch ({global_batch}) must be divisible by world_size "
                             f"({world_size}); e.g. use {global_batch // world_size * world_size}"
                             f" or {(global_batch // world_size + 1) * world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seq_len, self.global_batch = int(seq_len), int(global_batch)
        self.rank, self.world_size, self.seed = int(rank), int(world_size), int(seed)
        self.local_batch = self.global_batch // self.world_size

    def _rng(self, step: int) -> np.random.Generator:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return np.random.default_rng((self.seed, int(step)))

    def sample(self, step: int):
        """(x, y) for this rank: rows [rank*b, (rank+1)*b) of the global batch, (b, T) int64."""
        lo = self.rank * self.local_batch
        return self._rows(step, lo, lo + self.local_batch)

    def global_sample(self, step: int):
        """(x, y) of the whole global batch, (global_batch, T) int64."""
        return self._rows(step, 0, self.global_batch)

    def __iter__(self):
        """Endless (x, y) for steps 0, 1, 2, ..."""
        step = 0
        while True:
            yield self.sample(step)
            step += 1


class BatchSampler(_GlobalBatchSource):
    """Random windows of a token stream: row i of a step's global batch starts at an offset
    drawn from default_rng((seed, step)); x = tokens[o:o+T], y = tokens[o+1:o+T+1]."""

    def __init__(self, tokens, seq_len, global_batch, rank=0, world_size=1, seed=0):
        super().__init__(seq_len, global_batch, rank, world_size, seed)
        self.tokens = np.asarray(tokens)
        if self.tokens.ndim != 1 or len(self.tokens) < self.seq_len + 1:
            raise ValueError(f"tokens must be 1-D with at least seq_len + 1 = {self.seq_len + 1}"
                             f" elements, got shape {self.tokens.shape}")

    def _rows(self, step, lo, hi):
        offsets = self._rng(step).integers(0, len(self.tokens) - self.seq_len,
                                           size=self.global_batch)[lo:hi]   # (b,)
        idx = offsets[:, None] + np.arange(self.seq_len + 1)                # (b, T+1)
        window = self.tokens[idx].astype(np.int64)
        return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


class SyntheticSource(_GlobalBatchSource):
    """Uniformly random tokens in [0, vocab_size), for tests; y is x shifted by one."""

    def __init__(self, vocab_size, seq_len, global_batch, rank=0, world_size=1, seed=0):
        super().__init__(seq_len, global_batch, rank, world_size, seed)
        if int(vocab_size) != vocab_size or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size}")
        self.vocab_size = int(vocab_size)

    def _rows(self, step, lo, hi):
        seq = self._rng(step).integers(0, self.vocab_size,
                                       size=(self.global_batch, self.seq_len + 1))[lo:hi]
        seq = seq.astype(np.int64)                                          # (b, T+1)
        return np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])

"""Batch sources for zmpi.data: `train_val_split`, and the rank-sliced samplers
`BatchSampler` (random windows of a token stream) and `SyntheticSource` (uniform random
tokens), built on `_GlobalBatchSource`. A step's global batch depends only on (seed, step);
rank r gets rows [r*b, (r+1)*b) of it (see the zmpi.data docstring)."""

from __future__ import annotations

import numpy as np

__all__ = ["train_val_split", "BatchSampler", "SyntheticSource"]


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

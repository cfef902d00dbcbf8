"""Block-sparse attention layouts: DeepSpeed's SparsityConfig family
(deepspeed/ops/sparse_attention/sparsity_config.py) as frozen dataclasses, and the
`sparse_attention` section of a DeepSpeed JSON config that names one.

    cfg = sparsity_from_dict({"mode": "fixed", "attention": "unidirectional"}, num_heads=12)
    layout = causal_layout(cfg.make_layout(1024))   # (12, 64, 64) bool
    check_layout(layout, 1024, cfg.block)           # every query block row keeps a key block

A layout is a (num_heads, T // block, T // block) bool array: layout[h, i, j] says whether
query block i of head h attends to key block j (the block x block scores are computed) or not
(they are -inf). Each mode's `make_layout` sets the same blocks as DeepSpeed's for the same
parameters; the rules are in each class's `_head_layout`, of the pieces in
zmpi.nn.sparsity_pieces. Random blocks (bigbird, variable) are
drawn, as DeepSpeed draws them, with Python's `random.sample`, row by row and head by head, but
from `random.Random(seed)` (a field, default 0) instead of the global stream: the same layout on
every rank and every run, and DeepSpeed's own after `random.seed(seed)`. No MPI, no torch here.
"""
import dataclasses
import functools
import random
from dataclasses import dataclass, field
from typing import ClassVar

import numpy

from zmpi.nn.checks import is_int
from zmpi.nn.sparsity_pieces import (
    global_groups,
    local_windows,
    random_blocks,
    set_global_,
    sliding_window,
)

ATTENTION = ("unidirectional", "bidirectional")


def _refuse(name: str, reason: str):
    raise ValueError(f"{name}: {reason}")


def _key(name: str) -> str:
    """How an error names a field: as its key of the JSON section (num_heads is the model's)."""
    return name if name == "num_heads" else f"sparse_attention.{name}"


def _integer(name, value, least: int) -> int:
    if not is_int(value, least):
        _refuse(_key(name), f"expected an integer >= {least}, got {value!r}")
    return int(value)


def _flag(name, value) -> bool:
    if not isinstance(value, bool):
        _refuse(_key(name), f"expected true or false, got {value!r}")
    return value


def _attention(name, value) -> str:
    if value not in ATTENTION:
        _refuse(_key(name), f"expected one of {', '.join(map(repr, ATTENTION))}, got {value!r}")
    return value


def _integers(name, value, least: int, nonempty: bool = False, optional: bool = False):
    """A list of integers >= least as a tuple (None passes when optional)."""
    if value is None and optional:
        return None
    if not isinstance(value, (list, tuple)) or (nonempty and not value):
        _refuse(_key(name), f"expected a {'non-empty ' if nonempty else ''}list of integers"
                f"{' or null' if optional else ''}, got {value!r}")
    return tuple(_integer(f"{name}[{i}]", v, least) for i, v in enumerate(value))


def _param(default, check, *, at_most_rows=False, init=True, **kw):
    """A field checked by check(name, value, **kw) on construction (default MISSING: required);
    at_most_rows: a count of blocks that make_layout refuses above the number of block rows."""
    return field(default=default, init=init, metadata={
        "check": functools.partial(check, **kw), "at_most_rows": at_most_rows})


def num_blocks(seq_len: int, block: int) -> int:
    """seq_len // block; ValueError unless seq_len is a positive multiple of block."""
    if not is_int(seq_len, 1) or seq_len % block:
        raise ValueError(f"sequence length {seq_len!r} is not a positive multiple of "
                         f"sparse_attention.block {block}")
    return int(seq_len) // block


@dataclass(frozen=True)
class SparsityConfig:
    """What every mode has (DeepSpeed's SparsityConfig): num_heads (the model's n_head), block
    (tokens per side of a square block), different_layout_per_head (else head 0's layout is
    copied to every head). Fields are checked on construction: ValueError naming the key."""
    mode: ClassVar[str]
    num_heads: int = _param(dataclasses.MISSING, _integer, least=1)
    block: int = _param(16, _integer, least=1)
    different_layout_per_head: bool = _param(False, _flag)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))

    def make_layout(self, seq_len: int) -> numpy.ndarray:
        """(num_heads, seq_len // block, seq_len // block) bool: the blocks each head keeps.
        ValueError if seq_len is not a multiple of block or a count of blocks (random,
        sliding window, global) exceeds the block rows."""
        n = num_blocks(seq_len, self.block)
        for f in dataclasses.fields(self):
            if f.metadata["at_most_rows"] and getattr(self, f.name) > n:
                _refuse(_key(f.name), f"{getattr(self, f.name)} blocks is more than the {n} "
                        f"block rows of sequence length {seq_len} at block {self.block}")
        rng = self._random_stream()
        heads = self.num_heads if self.different_layout_per_head else 1
        layouts = numpy.stack([self._head_layout(h, n, rng) for h in range(heads)])
        return numpy.broadcast_to(layouts, (self.num_heads, n, n)).copy()

    def notes(self) -> list[str]:
        """The keys set away from their defaults that leave every layout as it would be without
        them, one line each ("key: accepted without effect (why)"), as the config's notes."""
        out = []
        if self.different_layout_per_head and not self._heads_differ():
            out.append("different_layout_per_head: accepted without effect (every head gets "
                       f"the same {self.mode!r} layout with these keys)")
        if getattr(self, "seed", 0) and not self.num_random_blocks:
            out.append("seed: accepted without effect (num_random_blocks is 0)")
        return out

    def _heads_differ(self) -> bool:
        """Whether different_layout_per_head can give heads different layouts."""
        return False

    def _random_stream(self):
        """The source of random blocks, one stream over all heads (None: the mode has none)."""
        return None

    def _head_layout(self, h: int, n: int, rng) -> numpy.ndarray:
        """(n, n) bool: head h's layout over n block rows."""
        raise NotImplementedError


# -- the modes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DenseSparsityConfig(SparsityConfig):
    """Every block kept (DeepSpeed's reference pattern: sparse kernels, dense attention)."""
    mode: ClassVar[str] = "dense"

    def _head_layout(self, h, n, rng):
        return numpy.ones((n, n), bool)


@dataclass(frozen=True)
class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformers' fixed pattern (Child et al. 2019, section 4.2), as DeepSpeed
    customises it: windows of num_local_blocks blocks attend within themselves, and
    num_global_blocks blocks of each window, counted back from its end (head h shifts them back
    h % num_different_global_patterns groups), are attended by all later rows
    ("unidirectional": from the group's first row on) or all rows ("bidirectional"); with
    horizontal_global_attention they also attend to every key (bidirectional only)."""
    mode: ClassVar[str] = "fixed"
    num_local_blocks: int = _param(4, _integer, least=1)
    num_global_blocks: int = _param(1, _integer, least=1, at_most_rows=True)
    attention: str = _param("bidirectional", _attention)
    horizontal_global_attention: bool = _param(False, _flag)
    num_different_global_patterns: int = _param(1, _integer, least=1)

    def __post_init__(self):
        super().__post_init__()
        local, glob = self.num_local_blocks, self.num_global_blocks
        if local % glob:
            _refuse(_key("num_global_blocks"), f"{glob} does not divide num_local_blocks {local}")
        _check_horizontal(self)
        patterns = self.num_different_global_patterns
        if patterns > 1 and not self.different_layout_per_head:
            _refuse(_key("num_different_global_patterns"), f"{patterns} patterns need "
                    "different_layout_per_head true (one layout is shared by all heads)")
        if patterns > local // glob:
            _refuse(_key("num_different_global_patterns"), f"{patterns} is more than the "
                    f"{local // glob} groups of num_global_blocks {glob} in a window of "
                    f"num_local_blocks {local}")

    def _heads_differ(self):
        return self.num_different_global_patterns > 1

    def _head_layout(self, h, n, rng):
        local, size = self.num_local_blocks, self.num_global_blocks
        causal = self.attention == "unidirectional"
        layout = local_windows(n, [local], causal)
        first = local - (1 + h % self.num_different_global_patterns) * size  # in each window
        whole = n - n % local                                 # blocks in whole windows
        starts = list(range(first, whole, local))
        if whole < n:                                         # a short last window
            starts.append(min(whole + first, n - size))
        for start in starts:
            set_global_(layout, start, start + size, start if causal else 0,
                         self.horizontal_global_attention)
        return layout


class _RandomBlocks:
    """The modes with `num_random_blocks` drawn from random.Random(`seed`): heads differ only
    through their random blocks."""

    def _heads_differ(self):
        return self.num_random_blocks > 0

    def _random_stream(self):
        return random.Random(self.seed)


@dataclass(frozen=True)
class VariableSparsityConfig(_RandomBlocks, SparsityConfig):
    """Fixed's extension: local windows of local_window_blocks[0], [1], ... blocks (the last
    size repeated), global blocks at global_block_indices (or the ranges from there to
    global_block_end_indices, exclusive) attended as in fixed, and num_random_blocks random
    keys per row drawn from all blocks (in "unidirectional" too: DeepSpeed's rule)."""
    mode: ClassVar[str] = "variable"
    num_random_blocks: int = _param(0, _integer, least=0, at_most_rows=True)
    local_window_blocks: tuple = _param((4,), _integers, least=0, nonempty=True)
    global_block_indices: tuple = _param((0,), _integers, least=0)
    global_block_end_indices: tuple | None = _param(None, _integers, least=1, optional=True)
    attention: str = _param("bidirectional", _attention)
    horizontal_global_attention: bool = _param(False, _flag)
    seed: int = _param(0, _integer, least=0)

    def __post_init__(self):
        super().__post_init__()
        last = len(self.local_window_blocks) - 1
        if self.local_window_blocks[last] < 1:  # DeepSpeed: range(..., 0), a ValueError
            _refuse(_key(f"local_window_blocks[{last}]"), "the last window's size repeats to "
                    f"the end of the sequence: must be >= 1, got {self.local_window_blocks[last]}")
        _check_global_ranges(self)
        _check_horizontal(self)

    def _head_layout(self, h, n, rng):
        causal = self.attention == "unidirectional"
        layout = random_blocks(rng, n, self.num_random_blocks, causal=False)
        layout |= local_windows(n, self.local_window_blocks, causal)
        for start, stop in global_groups(self.global_block_indices,
                                          self.global_block_end_indices, n):
            set_global_(layout, start, stop, start if causal else 0,
                         self.horizontal_global_attention)
        return layout


@dataclass(frozen=True)
class BigBirdSparsityConfig(_RandomBlocks, SparsityConfig):
    """BigBird (Zaheer et al. 2020, section 2) in blocks: num_random_blocks random keys per row
    ("unidirectional": among the row's earlier blocks), a sliding window of
    num_sliding_window_blocks (2 (n // 2) + 1 blocks, DeepSpeed's rule), and the first
    num_global_blocks blocks attending and attended everywhere; "unidirectional" then keeps
    only the lower triangle."""
    mode: ClassVar[str] = "bigbird"
    num_random_blocks: int = _param(1, _integer, least=0, at_most_rows=True)
    num_sliding_window_blocks: int = _param(3, _integer, least=1, at_most_rows=True)
    num_global_blocks: int = _param(1, _integer, least=0, at_most_rows=True)
    attention: str = _param("bidirectional", _attention)
    seed: int = _param(0, _integer, least=0)

    def __post_init__(self):
        super().__post_init__()
        if self.attention == "unidirectional" and self.num_random_blocks > 1:
            _refuse(_key("num_random_blocks"), f"{self.num_random_blocks} random blocks with "
                    "attention 'unidirectional': block row 0 has 1 block to draw from "
                    "(DeepSpeed's random.sample fails there too)")

    def _head_layout(self, h, n, rng):
        causal = self.attention == "unidirectional"
        layout = random_blocks(rng, n, self.num_random_blocks, causal)
        layout |= sliding_window(n, self.num_sliding_window_blocks // 2, causal=False)
        set_global_(layout, 0, self.num_global_blocks, 0, horizontal=True)
        return numpy.tril(layout) if causal else layout


@dataclass(frozen=True)
class BSLongformerSparsityConfig(SparsityConfig):
    """Longformer (Beltagy et al. 2020) in blocks: a sliding window of
    num_sliding_window_blocks, and global blocks at global_block_indices (or the ranges to
    global_block_end_indices) attending and attended everywhere; "unidirectional" then keeps
    only the lower triangle."""
    mode: ClassVar[str] = "bslongformer"
    num_sliding_window_blocks: int = _param(3, _integer, least=1, at_most_rows=True)
    global_block_indices: tuple = _param((0,), _integers, least=0)
    global_block_end_indices: tuple | None = _param(None, _integers, least=1, optional=True)
    attention: str = _param("bidirectional", _attention)

    def __post_init__(self):
        super().__post_init__()
        _check_global_ranges(self)

    def _head_layout(self, h, n, rng):
        layout = sliding_window(n, self.num_sliding_window_blocks // 2, causal=False)
        for start, stop in global_groups(self.global_block_indices,
                                          self.global_block_end_indices, n):
            set_global_(layout, start, stop, 0, horizontal=True)
        return numpy.tril(layout) if self.attention == "unidirectional" else layout


@dataclass(frozen=True)
class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window alone: num_sliding_window_blocks // 2 blocks either side of the query
    ("unidirectional": the query's block and that many before it). One layout for all heads
    (DeepSpeed's constructor takes no different_layout_per_head)."""
    mode: ClassVar[str] = "local"
    different_layout_per_head: bool = _param(False, _flag, init=False)
    num_sliding_window_blocks: int = _param(3, _integer, least=1, at_most_rows=True)
    attention: str = _param("unidirectional", _attention)

    def _head_layout(self, h, n, rng):
        return sliding_window(n, self.num_sliding_window_blocks // 2,
                               causal=self.attention == "unidirectional")


def _check_horizontal(cfg):
    if cfg.horizontal_global_attention and cfg.attention != "bidirectional":
        _refuse(_key("horizontal_global_attention"),
                "only attention 'bidirectional' supports horizontal global attention")


def _check_global_ranges(cfg):
    starts, stops = cfg.global_block_indices, cfg.global_block_end_indices
    if stops is None:
        return
    if len(stops) != len(starts):
        _refuse(_key("global_block_end_indices"), f"{len(stops)} end indices for "
                f"{len(starts)} global_block_indices")
    for start, stop in zip(starts, stops, strict=True):
        if start >= stop:
            _refuse(_key("global_block_end_indices"), f"end {stop} is not after its start "
                    f"{start} in global_block_indices")


MODES: dict[str, type] = {cls.mode: cls for cls in (
    DenseSparsityConfig, FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig,
    BSLongformerSparsityConfig, LocalSlidingWindowSparsityConfig)}
DEFAULT_MODE = "fixed"  # DeepSpeed's, when the section names none


# DeepSpeed's config reader (deepspeed/runtime/config.py, get_sparse_bigbird_config) fills a
# key the section leaves out from its constants, SPARSE_NUM_RANDOM_BLOCKS_DEFAULT = 0 for
# bigbird, where BigBirdSparsityConfig's own default is 1
READER_DEFAULTS = {"bigbird": {"num_random_blocks": 0}}


def mode_keys(mode: str) -> dict:
    """{key: default} a mode's JSON section takes besides "mode" (its fields but num_heads),
    each default as DeepSpeed's config reader gives it (READER_DEFAULTS over the class's)."""
    return {**{f.name: f.default for f in dataclasses.fields(MODES[mode])
               if f.init and f.name != "num_heads"}, **READER_DEFAULTS.get(mode, {})}


def sparsity_from_dict(section: dict, num_heads: int) -> SparsityConfig:
    """The config a DeepSpeed `sparse_attention` section names, for a model of num_heads heads:
    "mode" (default "fixed") and that mode's keys, each defaulting as DeepSpeed's config
    reader defaults it (where that is not the class's: `bigbird`'s num_random_blocks is 0,
    READER_DEFAULTS). ValueError
    naming `sparse_attention.<key>` for an unknown key, a key of another mode, or a value of
    the wrong type or range, or that breaks DeepSpeed's rules between keys."""
    if not isinstance(section, dict):
        _refuse("sparse_attention", f"expected an object, got {type(section).__name__}")
    mode = section.get("mode", DEFAULT_MODE)
    if not isinstance(mode, str) or mode not in MODES:
        _refuse(_key("mode"), f"{mode!r} is not one of {', '.join(MODES)}")
    keys = mode_keys(mode)
    for key in section:
        if key != "mode" and key not in keys:
            owners = [m for m in MODES if key in mode_keys(m)]
            what = (f"a key of mode {' and '.join(map(repr, owners))}, not of {mode!r}"
                    if owners else "unknown key")
            _refuse(_key(key), f"{what}; mode {mode!r} takes {', '.join(keys)}")
    given = {**READER_DEFAULTS.get(mode, {}), **section}
    return MODES[mode](num_heads=num_heads, **{k: v for k, v in given.items() if k != "mode"})


def causal_layout(layout) -> numpy.ndarray:
    """The layout (..., n, n) intersected with the block-causal mask: key blocks at or before
    the query block only (bool). Inside a kept diagonal block the layer masks by token."""
    layout = numpy.asarray(layout, bool)
    return layout & numpy.tri(layout.shape[-1], dtype=bool)


def check_layout(layout, seq_len: int, block: int) -> None:
    """ValueError unless seq_len is a multiple of block, layout is (heads, seq_len // block,
    seq_len // block) and every query block row of every head keeps a key block (check the
    layout the layer runs: causal_layout's for a causal model)."""
    n = num_blocks(seq_len, block)
    layout = numpy.asarray(layout)
    if layout.ndim != 3 or layout.shape[1:] != (n, n):
        raise ValueError(f"a sparse layout of shape {layout.shape} for sequence length "
                         f"{seq_len} at block {block}: expected (heads, {n}, {n})")
    heads, rows = numpy.nonzero(~layout.astype(bool).any(axis=-1))
    if len(rows):
        h, r = heads[0], rows[0]
        more = f" (and {len(rows) - 1} more rows)" if len(rows) > 1 else ""
        raise ValueError(f"sparse attention: head {h}, query block row {r} (tokens "
                         f"{r * block}-{(r + 1) * block - 1}) keeps no key block{more}; "
                         "every query must attend to at least one key")


@functools.lru_cache(maxsize=8)
def model_layout(sparsity: SparsityConfig, seq_len: int) -> numpy.ndarray:
    """The layout a causal model runs at seq_len: `sparsity`'s intersected with the causal
    mask, checked (seq_len a multiple of the block, every query block row keeping a key
    block; ValueError otherwise), made once per (config, seq_len) and shared by its users."""
    if seq_len % sparsity.block:
        raise ValueError(f"sequence length {seq_len} is not a multiple of sparse_attention.block "
                         f"{sparsity.block}")
    layout = causal_layout(sparsity.make_layout(seq_len))
    check_layout(layout, seq_len, sparsity.block)
    return layout


def kept_blocks(layout) -> int:
    """Kept blocks summed over all heads (each block x block scores per sequence)."""
    return int(numpy.count_nonzero(layout))

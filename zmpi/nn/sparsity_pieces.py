"""The pieces zmpi.nn.sparsity's layouts are made of, over n block rows: each an (n, n) bool
array (layout[i, j]: query block i attends to key block j), or set in place in one. DeepSpeed's
sparsity_config.py builds its layouts from the same pieces, loop by loop; these are its rules
as array operations (and its random draws, from a given random.Random).
"""
import random

import numpy


def grid(n: int):
    """(rows (n, 1), cols (1, n)): block indices to compare."""
    return numpy.arange(n)[:, None], numpy.arange(n)[None, :]


def local_windows(n: int, sizes, causal: bool) -> numpy.ndarray:
    """Blocks in the same local window: consecutive windows of sizes[0], sizes[1], ... blocks,
    the last size repeated to the end; with causal, only keys at or before the query."""
    bounds = list(numpy.cumsum(sizes))
    while bounds[-1] < n:
        bounds.append(bounds[-1] + sizes[-1])
    window = numpy.searchsorted(bounds, numpy.arange(n), side="right")  # (n,) window of a block
    rows, cols = grid(n)
    return (window[:, None] == window[None, :]) & (cols <= rows if causal else True)


def sliding_window(n: int, half: int, causal: bool) -> numpy.ndarray:
    """Keys within `half` blocks of the query (2 half + 1 blocks); with causal, only before.
    (numpy.tri(n, k=d) keeps col <= row + d, made as bool with no (n, n) integer temporary.)"""
    after = numpy.tri(n, k=0 if causal else half, dtype=bool)   # col <= row (+ half)
    return after & ~numpy.tri(n, k=-half - 1, dtype=bool)      # col >= row - half


def set_global_(layout, start: int, stop: int, first_row: int, horizontal: bool):
    """Key blocks start:stop global: every query row from first_row attends to them; with
    horizontal, their own rows attend to every key too."""
    layout[first_row:, start:stop] = True
    if horizontal:
        layout[start:stop, :] = True


def global_groups(starts, stops, n: int):
    """(start, stop) of each global group of blocks that begins inside n blocks: single blocks
    `starts` when stops is None, else starts[i]:stops[i] cut at n."""
    stops = [s + 1 for s in starts] if stops is None else stops
    return [(start, min(stop, n)) for start, stop in zip(starts, stops, strict=True)
            if start < n]


def random_blocks(rng: random.Random, n: int, k: int, causal: bool) -> numpy.ndarray:
    """k distinct key blocks drawn for each query row in turn, from all n blocks or, with
    causal, from those at or before the row; DeepSpeed's draws, from rng."""
    layout = numpy.zeros((n, n), bool)
    for row in range(n):
        layout[row, rng.sample(range(row + 1 if causal else n), k)] = True
    return layout

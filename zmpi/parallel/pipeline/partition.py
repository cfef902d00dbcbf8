"""Which units each pipeline stage holds: P contiguous runs of a UnitModel's units.

    weights = unit_weights(model.units, "parameters")     # or "uniform", "type:Block"
    bounds = partition(weights, stages=4)                 # [0, 2, 3, 4, 6]: stage s holds
                                                          # units bounds[s]:bounds[s + 1]

The methods are DeepSpeed's `partition_method` values:

    parameters   each unit weighs its parameter count (the default)
    uniform      each unit weighs 1
    type:REGEX   a unit weighs 1 if its class name matches REGEX (case-insensitive), else 0:
                 "type:Block" balances the transformer blocks and lets the embedding and the
                 head ride along

`partition` minimises the heaviest stage (exactly, by dynamic programming over the split
points, each split found by bisection: O(stages n log n)), every stage holding at least one
unit; among equally heavy splits it takes the one whose stages fill from the front, so the
ties are the same on every rank.
"""
from __future__ import annotations

import bisect
import re


def check_method(method) -> None:
    """ValueError unless `method` is "parameters", "uniform" or "type:REGEX" (a valid
    regular expression)."""
    if method in ("parameters", "uniform"):
        return
    if isinstance(method, str) and method.startswith("type:"):
        try:
            re.compile(method[5:])
        except re.error as e:
            raise ValueError(f"partition method {method!r}: {e}") from None
        return
    raise ValueError(f"unknown partition method {method!r}: use 'parameters', 'uniform' or "
                     "'type:REGEX'")


def unit_weights(units, method: str = "parameters") -> list[int]:
    """Each unit's weight under `method` (see the module docstring). ValueError for an
    unknown method or a type pattern that matches no unit."""
    check_method(method)
    if method == "parameters":
        return [sum(int(p.data.size) for _, p in unit.named_parameters()) for unit in units]
    if method == "uniform":
        return [1] * len(units)
    pattern = re.compile(method[5:], re.IGNORECASE)  # "type:REGEX"
    weights = [int(bool(pattern.search(type(unit).__name__))) for unit in units]
    if not any(weights):
        names = sorted({type(u).__name__ for u in units})
        raise ValueError(f"partition method {method!r} matches none of the units "
                         f"({', '.join(names)})")
    return weights


def partition(weights: list[int], stages: int) -> list[int]:
    """Split points [0, b1, ..., n] of `weights` (one per unit, in order) into `stages`
    contiguous non-empty runs whose heaviest is as light as possible."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} units into {stages} pipeline stages: each stage "
                         "needs at least one unit")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][j]: the lightest heaviest stage splitting units [0, j) into k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        before, row, cuts = best[k - 1], best[k], cut[k]
        for j in range(k, n - (stages - k) + 1):
            # the last stage is [i, j), k - 1 <= i < j. max(before[i], its weight) falls with i
            # until the stages before weigh at least as much as it (before[i] never falls as i
            # grows, the last stage never grows): bisect for that first i, `cross`
            lo, hi = k - 1, j
            while lo < hi:
                mid = (lo + hi) // 2
                if before[mid] >= prefix[j] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            cross = lo
            left = prefix[j] - prefix[cross - 1] if cross > k - 1 else inf
            right = before[cross] if cross < j else inf
            if right <= left:  # ties go to the latest i: where before[] still equals it
                row[j], cuts[j] = right, bisect.bisect_right(before, right, cross, j) - 1
            else:
                row[j], cuts[j] = left, cross - 1
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]

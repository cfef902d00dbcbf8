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
points), every stage holding at least one unit; among equally heavy splits it takes the one
whose stages fill from the front, so the ties are the same on every rank.
"""
from __future__ import annotations

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
        for j in range(k, n - (stages - k) + 1):
            for i in range(j - 1, k - 2, -1):  # the last stage is [i, j); latest i first
                last = prefix[j] - prefix[i]
                if last >= best[k][j]:  # only grows as i falls: no earlier i can be lighter
                    break
                heaviest = max(best[k - 1][i], last)
                if heaviest < best[k][j]:
                    best[k][j], cut[k][j] = heaviest, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]

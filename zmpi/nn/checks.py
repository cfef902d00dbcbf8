"""The argument checks zmpi.nn's constructors share: what counts as an integer (an int or a
NumPy integer, never a bool) and as a number (a finite int or float, NumPy's included, never a
bool), and the one-line ValueError that names the argument:

    check_int("num_experts", 0, 1)
        ValueError: num_experts must be an integer >= 1, got 0
    check_number("rope_theta", 0.0, 0.0, strict=True)
        ValueError: rope_theta must be a finite number > 0, got 0.0

A module whose errors name keys of a config section in its own style (zmpi.nn.sparsity:
"sparse_attention.block: expected an integer >= 1, got 0") tests values with is_int.
"""

import math
import numbers


def is_int(value, least: int) -> bool:
    """Whether value is an integer (numbers.Integral, not a bool) >= least."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) \
        and bool(value >= least)


def check_int(what: str, value, least: int) -> int:
    """value as an int; ValueError naming `what` unless is_int(value, least)."""
    if not is_int(value, least):
        raise ValueError(f"{what} must be an integer >= {least}, got {value!r}")
    return int(value)


def check_number(what: str, value, least: float = 0.0, strict: bool = False) -> float:
    """value as a float; ValueError naming `what` unless it is a finite real number (an int or
    float, NumPy's too, not a bool) > least when `strict`, else >= least."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value) and (value > least if strict else value >= least)
    if not ok:
        raise ValueError(f"{what} must be a finite number {'>' if strict else '>='} {least:g}, "
                         f"got {value!r}")
    return float(value)

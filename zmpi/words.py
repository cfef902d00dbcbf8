"""Counts in messages, with the noun in the right number: "1 problem", "2 problems".

    count(3, "problem")                 # "3 problems"
    count(1, "shard file")              # "1 shard file"
    count(28576, "parameter")           # "28,576 parameters" (thousands separated)
    count(2, "copy", "copies")          # an irregular plural
"""
from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` (thousands separated) and `noun`, or `plural` (default noun + "s") unless n is 1."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"

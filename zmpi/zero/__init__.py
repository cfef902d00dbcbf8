"""ZeRO data parallelism: flat partitioned buffers and partition strategies (stages 0-3).

Importing this package registers the built-in strategies (stage0 ... stage3, hybrid,
hybrid_zero2, zeropp), so `get_strategy` finds them by name: Python runs this file before any
`zmpi.zero.*` module, so every user of the registry has imported them.
"""
from zmpi.zero import hybrid, stage0, stage1, stage2, stage3, zeropp  # noqa: F401  (@register)
from zmpi.zero.context import StrategyContext
from zmpi.zero.registry import (
    available_strategies,
    get_strategy,
    load_strategy_file,
    register,
)
from zmpi.zero.strategy import Strategy

__all__ = ["Strategy", "StrategyContext", "available_strategies", "get_strategy",
           "load_strategy_file", "register"]

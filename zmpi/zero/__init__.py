"""ZeRO data parallelism: flat partitioned buffers and partition strategies (stages 0-3)."""
from zmpi.zero.strategy import Strategy, available_strategies, get_strategy, register

__all__ = ["Strategy", "available_strategies", "get_strategy", "register"]

"""Models built from zmpi.nn: GPT (GPT-2 style, tied embeddings) and MLPModel (tiny classifier)."""

from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.mlp import MLPModel

__all__ = ["GPT", "GPTConfig", "MLPModel"]

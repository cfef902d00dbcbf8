"""How a model reaches its engine, and how a config reaches it.

    model.hooks = EngineHooks(engine)   each unit call runs the engine's hooks around it
    config = as_config(config)          a Config from a Config, a dict, a JSON path or None
"""
from __future__ import annotations

import weakref
from pathlib import Path

from zmpi.config import Config
from zmpi.nn.module import UnitHooks


class EngineHooks(UnitHooks):
    """The model's way to its engine's hooks: a weak reference, so that an engine and its model
    form no cycle and dropping the engine frees its buffers at once."""

    def __init__(self, engine):
        self._engine = weakref.ref(engine)

    def _live(self):
        engine = self._engine()
        if engine is None:
            raise RuntimeError("the Engine this model was given to is gone; its parameters "
                               "lived in that engine's buffers: build a new model")
        return engine

    def before_forward(self, unit):
        self._live().before_forward(unit)

    def after_forward(self, unit):
        self._live().after_forward(unit)

    def before_backward(self, unit):
        self._live().before_backward(unit)

    def after_backward(self, unit):
        self._live().after_backward(unit)

    def before_recompute(self, unit):
        self._live().before_recompute(unit)

    def after_recompute(self, unit):
        self._live().after_recompute(unit)


def as_config(config) -> Config:
    """A Config from a Config, a DeepSpeed-style dict, a JSON path, or None (defaults)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    return Config.from_json(Path(config).read_text())

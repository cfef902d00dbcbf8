"""The registry of partition strategies: name -> Strategy subclass.

A policy registers itself with `@register("name")` (zmpi.zero.register). `get_strategy` finds
a strategy by registered name, by module path ("package.module:ClassName", imported on every
rank) or by an installed entry point in the group "zmpi.strategies" (docs/strategies.md);
`load_strategy_file` imports a strategy file by its path (the test suite's --strategy-module).

This module imports no strategy. The built-in ones (stage0 ... stage3, hybrid) register when
`zmpi.zero` is imported, which Python does before any `zmpi.zero.*` module, this one included;
so `get_strategy` never has to import them itself. `Strategy` (strategy.py, which imports this
module) declares itself as the base class every strategy must derive from (`strategy_base`).
"""
from __future__ import annotations

ENTRY_POINT_GROUP = "zmpi.strategies"

_REGISTRY: dict[str, type] = {}
_BASE: list[type] = []  # [zmpi.zero.strategy.Strategy], declared by @strategy_base


def strategy_base(cls: type) -> type:
    """Class decorator of zmpi.zero.strategy.Strategy: what `get_strategy` checks that a class
    loaded by path or entry point derives from."""
    _BASE[:] = [cls]
    return cls


def register(name: str):
    """Class decorator: make a Strategy subclass available under `name`."""

    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"strategy {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_strategy(name: str) -> type:
    """The Strategy class called `name`: a registered name (the built-in "stage0".."stage3",
    anything imported that used @register, or a package's entry point in the group
    "zmpi.strategies"), or "package.module:ClassName", imported here (on every rank).
    ValueError naming what is available otherwise."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _from_path(name)
    entry = _entry_points().get(name)
    if entry is not None:
        return _checked(entry.load(), f"entry point {name!r} ({entry.value})", name)
    raise ValueError(f"unknown partition strategy {name!r}; available: "
                     f"{', '.join(available_strategies())}, or 'package.module:ClassName'")


def load_strategy_file(path) -> list[str]:
    """Import the Python file at `path` as the module named by its stem (so that "stem:Class"
    finds it afterwards), running its `@register` decorators, and return the names of the
    strategies it registered, sorted. A file already imported under that name is not run again
    (it registered then). ValueError, one line, for a missing file, a file that fails to
    import, or a stem that is already another module's name."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(path).resolve()
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"strategy module {str(path)!r} is not a Python file")
    loaded = sys.modules.get(path.stem)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() != path:
            raise ValueError(f"cannot load strategy module {str(path)!r}: a module named "
                             f"{path.stem!r} is already imported from {loaded.__file__}")
        return sorted(n for n, c in _REGISTRY.items() if c.__module__ == path.stem)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    before = set(_REGISTRY)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[path.stem]
        raise ValueError(f"cannot load strategy module {str(path)!r}: "
                         f"{type(e).__name__}: {e}") from e
    return sorted(set(_REGISTRY) - before)


def available_strategies() -> list[str]:
    """Registered names and installed entry points (loaded on first use)."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def _entry_points() -> dict:
    from importlib.metadata import entry_points

    return {e.name: e for e in entry_points(group=ENTRY_POINT_GROUP)}


def _from_path(path: str) -> type:
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load partition strategy {path!r}: {e}") from e
    return _checked(obj, path, path)


def _checked(obj, what: str, name: str) -> type:
    """obj if it is a Strategy subclass (registered under `name` if it was not yet)."""
    if not (isinstance(obj, type) and issubclass(obj, tuple(_BASE))):
        raise ValueError(f"partition strategy {what} is {obj!r}, not a subclass of "
                         "zmpi.zero.strategy.Strategy")
    if obj not in _REGISTRY.values():
        register(name)(obj)
    return obj

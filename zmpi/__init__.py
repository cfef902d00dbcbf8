"""zmpi: ZeRO stages 0-3 on MPI with an autograd-free NumPy/CuPy layer library.

    from zmpi import Engine, Config, Comm, Mesh   # imported on first use: `import zmpi.nn`
                                                  # alone never starts MPI
"""
from importlib import import_module

_EXPORTS = {"Engine": "zmpi.engine", "Config": "zmpi.config", "Comm": "zmpi.comm",
            "Mesh": "zmpi.parallel.mesh", "CheckpointError": "zmpi.checkpoint",
            "ConfigError": "zmpi.config"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    if name == "__version__":  # looked up when asked: importlib.metadata takes 50 ms a process
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("zmpi")
        except PackageNotFoundError:  # a source tree that was not installed
            return "0+unknown"
    raise AttributeError(f"module 'zmpi' has no attribute {name!r}")

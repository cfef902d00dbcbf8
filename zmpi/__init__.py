"""zmpi: ZeRO stages 0-3 on MPI with an autograd-free NumPy/CuPy layer library.

    from zmpi import Engine, Config, Comm, Mesh   # imported on first use: `import zmpi.nn`
                                                  # alone never starts MPI
"""
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("zmpi")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

_EXPORTS = {"Engine": "zmpi.engine", "Config": "zmpi.config", "Comm": "zmpi.comm",
            "Mesh": "zmpi.parallel.mesh", "CheckpointError": "zmpi.checkpoint",
            "ConfigError": "zmpi.config"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'zmpi' has no attribute {name!r}")

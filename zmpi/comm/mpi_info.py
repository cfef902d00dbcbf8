"""Which MPI library this process loaded, and whether it takes CUDA device buffers.

    cuda_support()   (CUDA-aware?, how that was decided): ZMPI_CUDA_AWARE=0|1, else the
                     library's own answer (MPIX_GPU_query_support / MPIX_Query_cuda_support
                     through ctypes, as mpi4py 4.1 wraps neither)
    mpi_flavour()    'Open MPI', 'MPICH' (and its derivatives) or 'other'
"""

from __future__ import annotations

import functools
import os

from mpi4py import MPI  # zmpi.comm imported zmpi.backend before this (MPI_Init)


@functools.lru_cache(maxsize=1)
def _libmpi():
    """The MPI library this process loaded (ctypes), found in /proc/self/maps; None if not.
    Looked up once: every Comm (sub-communicators included) asks."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libmpi" in line
                            and line.split()[-1].startswith("/")})
    except OSError:
        return None
    loaded = []
    for path in paths:
        try:
            loaded.append(ctypes.CDLL(path))
        except OSError:
            continue
    for lib in loaded:  # e.g. Cray's libmpi_gtl_cuda sorts before the MPI itself
        if hasattr(lib, "MPIX_GPU_query_support") or hasattr(lib, "MPIX_Query_cuda_support"):
            return lib
    return loaded[0] if loaded else None


def cuda_support() -> tuple[bool, str]:
    """(whether MPI takes CUDA device buffers, how that was decided). ZMPI_CUDA_AWARE=0|1
    overrides; else MPI's own answer: `MPIX_GPU_query_support(CUDA)` or
    `MPIX_Query_cuda_support()` from the loaded libmpi (MPICH, Open MPI; mpi4py 4.1 does not
    wrap them), or `MPI.Query_cuda_support` where mpi4py has it; else False."""
    import ctypes

    env = os.environ.get("ZMPI_CUDA_AWARE", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"ZMPI_CUDA_AWARE={env!r}: expected 0 or 1")
        return env == "1", "ZMPI_CUDA_AWARE"
    lib = _libmpi()
    if lib is not None and hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
            return bool(supported.value), "MPIX_GPU_query_support"
    if lib is not None and hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support()), "MPIX_Query_cuda_support"
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query()), "MPI.Query_cuda_support"
        except (MPI.Exception, NotImplementedError):
            pass
    return False, "no query available"


def mpi_flavour() -> str:
    """'Open MPI', 'MPICH' (and its derivatives: Intel MPI, Cray MPICH, MVAPICH) or 'other'."""
    version = MPI.Get_library_version()
    if "Open MPI" in version:
        return "Open MPI"
    if any(name in version for name in ("MPICH", "Intel(R) MPI", "MVAPICH", "CRAY MPICH")):
        return "MPICH"
    return "other"

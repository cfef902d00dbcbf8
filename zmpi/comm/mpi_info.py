"""Which MPI library this process loaded, and whether it takes CUDA device buffers.

    cuda_support()   (CUDA-aware?, how that was decided): ZMPI_CUDA_AWARE=0|1, else the
                     runtime switch of an MPI that has one (MVAPICH: MV2_USE_CUDA,
                     MVP_ENABLE_CUDA; Cray MPICH: MPICH_GPU_SUPPORT_ENABLED), else the
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


# MPIs whose CUDA support is switched on at run time by an environment variable (off unless
# set): (what MPI_Get_library_version says, the variables, first set wins)
RUNTIME_SWITCHES = (
    ("MVAPICH", ("MV2_USE_CUDA", "MVP_ENABLE_CUDA")),  # MVAPICH2(-GDR); MVAPICH 3 / -Plus
    ("CRAY MPICH", ("MPICH_GPU_SUPPORT_ENABLED",)),
)


def _runtime_switch() -> tuple[bool, str] | None:
    """(switched on, the variable) for the loaded MPI's CUDA switch if it has one and it is
    set: on for a non-zero integer (as the MPI reads it), off for 0; None otherwise (a
    variable of another MPI is not read). A value that is no integer raises ValueError."""
    version = MPI.Get_library_version()
    for marker, variables in RUNTIME_SWITCHES:
        if marker not in version:
            continue
        for var in variables:
            value = os.environ.get(var, "").strip()
            if value:
                try:
                    return int(value) != 0, var
                except ValueError:
                    raise ValueError(f"{var}={value!r}: expected an integer (1 switches "
                                     f"{marker}'s CUDA support on, 0 off)") from None
    return None


def cuda_support() -> tuple[bool, str]:
    """(whether MPI takes CUDA device buffers, how that was decided: the variable or query).
    ZMPI_CUDA_AWARE=0|1 overrides. Else, for MVAPICH (MV2_USE_CUDA, MVP_ENABLE_CUDA) and Cray
    MPICH (MPICH_GPU_SUPPORT_ENABLED), whose CUDA support is off unless that variable switches
    it on at run time, the variable when it is set (`RUNTIME_SWITCHES`; unset, the library
    is asked as any other). Else MPI's own
    answer: `MPIX_GPU_query_support(CUDA)` or `MPIX_Query_cuda_support()` from the loaded
    libmpi (MPICH, Open MPI; mpi4py 4.1 does not wrap them), or `MPI.Query_cuda_support`
    where mpi4py has it; else False."""
    import ctypes

    env = os.environ.get("ZMPI_CUDA_AWARE", "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"ZMPI_CUDA_AWARE={env!r}: expected 0 or 1")
        return env == "1", "ZMPI_CUDA_AWARE"
    switch = _runtime_switch()
    if switch is not None:
        return switch
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

"""A ctypes wrapper of NVRTC, CUDA's run-time compiler (the one CuPy's RawModule calls), for
compiling zmpi.kernels.SOURCE on a machine without a GPU, a driver or a CUDA toolkit
(tests/test_kernels_compile.py). Only NVRTC's documented C API (nvrtc.h) is used.

NVRTC comes from the pip wheel nvidia-cuda-nvrtc-cu12 (the dev extra, Linux x86_64), which
installs libnvrtc.so.12 under site-packages/nvidia/cuda_nvrtc/lib/; a CUDA toolkit's
libnvrtc.so.12 on the loader's path serves too. NVRTC 12.x has no cuda_fp16.h among its
builtin headers: it comes from nvidia-cuda-runtime-cu12 (nvidia/cuda_runtime/include/), as it
does for CuPy, or from a toolkit ($CUDA_PATH/include).

    lib = nvrtc.load()                      # None when NVRTC is not installed
    ok, log = nvrtc.compile_source(lib, source, ["--gpu-architecture=sm_90", ...])
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

NVRTC_SUCCESS = 0
NVRTC_ERROR_COMPILATION = 6  # the source did not compile: the log says why


def _wheel_dirs(package: str, sub: str) -> list[Path]:
    """`sub` of the pip wheel's namespace package nvidia.<package>, where it exists."""
    try:
        spec = importlib.util.find_spec(f"nvidia.{package}")
    except (ImportError, ValueError):
        return []
    roots = spec.submodule_search_locations if spec is not None else None
    return [Path(root, sub) for root in roots or () if Path(root, sub).is_dir()]


def load():
    """libnvrtc.so.12 as a ctypes.CDLL with the functions below declared, or None if none
    loads: the wheel's first, then whatever the loader finds (a toolkit's)."""
    candidates = [str(p) for d in _wheel_dirs("cuda_nvrtc", "lib")
                  for p in sorted(d.glob("libnvrtc.so.*")) if ".alt." not in p.name]
    for candidate in [*candidates, "libnvrtc.so.12"]:
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        _declare(lib)
        return lib
    return None


def crt_include_dir() -> str | None:
    """A directory holding crt/mma.h, which <mma.h> (warp matrix multiply-accumulate)
    includes: the wheel nvidia-cuda-nvcc-cu12's, else a toolkit's; None without one."""
    dirs = _wheel_dirs("cuda_nvcc", "include")
    dirs += [Path(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME") if v in os.environ]
    dirs.append(Path("/usr/local/cuda/include"))
    return next((str(d) for d in dirs if (d / "crt" / "mma.h").is_file()), None)


def cuda_include_dir() -> str | None:
    """A directory holding cuda_fp16.h (and the runtime headers it includes): the wheel
    nvidia-cuda-runtime-cu12's, else a toolkit's ($CUDA_PATH, $CUDA_HOME, /usr/local/cuda)."""
    dirs = _wheel_dirs("cuda_runtime", "include")
    dirs += [Path(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME") if v in os.environ]
    dirs.append(Path("/usr/local/cuda/include"))
    return next((str(d) for d in dirs if (d / "cuda_fp16.h").is_file()), None)


def _declare(lib) -> None:
    program_p = ctypes.POINTER(ctypes.c_void_p)  # nvrtcProgram: a pointer to an opaque struct
    strings = ctypes.POINTER(ctypes.c_char_p)
    signatures = {
        "nvrtcGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
        "nvrtcVersion": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int)] * 2),
        "nvrtcCreateProgram": (ctypes.c_int, [program_p, ctypes.c_char_p, ctypes.c_char_p,
                                              ctypes.c_int, strings, strings]),
        "nvrtcCompileProgram": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, strings]),
        "nvrtcGetProgramLogSize": (ctypes.c_int, [ctypes.c_void_p,
                                                  ctypes.POINTER(ctypes.c_size_t)]),
        "nvrtcGetProgramLog": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]),
        "nvrtcDestroyProgram": (ctypes.c_int, [program_p]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


def _check(lib, result: int, what: str) -> None:
    if result != NVRTC_SUCCESS:
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


def version(lib) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def compile_source(lib, source: str, options, name: str = "zmpi_kernels.cu") -> tuple[bool, str]:
    """Compile `source` with `options` (strings): (whether it compiled, NVRTC's log, stripped).
    A failure other than the source's (an unknown option, say) raises RuntimeError."""
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(),
                                       0, None, None), "nvrtcCreateProgram")
    try:
        encoded = [option.encode() for option in options]
        argv = (ctypes.c_char_p * max(1, len(encoded)))(*encoded)
        result = lib.nvrtcCompileProgram(program, len(encoded), argv)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)),
               "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(max(1, size.value))
        _check(lib, lib.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
        if result not in (NVRTC_SUCCESS, NVRTC_ERROR_COMPILATION):
            _check(lib, result, f"nvrtcCompileProgram {list(options)}")
        return result == NVRTC_SUCCESS, log.value.decode(errors="replace").strip()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))

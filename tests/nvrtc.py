"""A ctypes wrapper of NVRTC, CUDA's run-time compiler (the one CuPy's RawModule calls), for
compiling zmpi's kernels (zmpi/kernels/*.cu) on a machine without a GPU, a driver or a CUDA
toolkit (tests/test_kernels_compile.py, tests/test_flash_attention.py), in both pip-wheel
layouts CuPy compiles in. Only NVRTC's documented C API (nvrtc.h) is used.

A `Toolchain` is one layout as CuPy sees it: NVRTC, and CuPy's single CUDA include directory,
the one cuda.pathfinder's find_nvidia_header_directory("cudart") gives (its catalog: the first
of nvidia/cu13/include and nvidia/cuda_runtime/include holding cuda_runtime.h), which is all
CuPy 14 passes NVRTC with -I. NVRTC has no cuda_fp16.h among its builtin headers: it comes
from there.
- "cuda12": the venv's nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12 (the dev extra,
  Linux x86_64): libnvrtc.so.12 in nvidia/cuda_nvrtc/lib, headers in nvidia/cuda_runtime/include;
  crt/mma.h is elsewhere, in nvidia-cuda-nvcc-cu12's nvidia/cuda_nvcc/include.
- "cuda13": nvidia-cuda-nvrtc, -runtime and -crt 13.x, which `make install` puts in
  CUDA13_WHEELS (pip --target, off sys.path): everything in nvidia/cu13/ (crt/ included).

    chain = nvrtc.toolchain("cuda12")   # a Toolchain, or a string: why there is none here
    ok, log = nvrtc.compile_source(chain.lib, source, ["-arch=sm_90", f"-I{chain.include}"])
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple

NVRTC_SUCCESS = 0
NVRTC_ERROR_COMPILATION = 6  # the source did not compile: the log says why
# Where `make install` puts the CUDA 13 wheels (Makefile: CUDA13_WHEELS)
CUDA13_WHEELS = Path(os.environ.get("ZMPI_CUDA13_WHEELS", Path(sys.prefix, "cuda13")))
LAYOUTS = ("cuda12", "cuda13")


class Toolchain(NamedTuple):
    name: str  # one of LAYOUTS
    lib: ctypes.CDLL  # NVRTC, its functions declared
    include: str  # CuPy's one CUDA include directory in this layout
    root: str  # the folder holding the wheels' nvidia/ (what zmpi's crt lookup searches)


def _wheel_roots(package: str) -> list[Path]:
    """The folders (site-packages) holding the pip wheel's namespace package nvidia.<package>."""
    try:
        spec = importlib.util.find_spec(f"nvidia.{package}")
    except (ImportError, ValueError):
        return []
    roots = spec.submodule_search_locations if spec is not None else None
    return [Path(root).parent.parent for root in roots or ()]


def cupy_include_dir(root) -> str | None:
    """CuPy's CUDA include directory under `root` (cuda.pathfinder's lookup of cudart's
    headers), or None."""
    dirs = (Path(root, "nvidia", sub, "include") for sub in ("cu13", "cuda_runtime"))
    return next((str(d) for d in dirs if (d / "cuda_runtime.h").is_file()), None)


def toolchain(name: str) -> Toolchain | str:
    """The layout `name` (LAYOUTS) where it is installed, else why not (a sentence)."""
    if name == "cuda12":
        roots, lib_dir, soname = _wheel_roots("cuda_nvrtc"), ("cuda_nvrtc", "lib"), "so.12"
        missing = "pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 (the dev extra)"
    elif name == "cuda13":
        roots, lib_dir, soname = [CUDA13_WHEELS], ("cu13", "lib"), "so.13"
        missing = (f"the CUDA 13 wheels are not in {CUDA13_WHEELS}: `make install` puts them "
                   "there (a step that needs PyPI)")
    else:
        raise ValueError(f"no layout {name!r}: one of {LAYOUTS}")
    for root in roots:
        library = Path(root, "nvidia", *lib_dir, f"libnvrtc.{soname}")
        include = cupy_include_dir(root)
        if library.is_file() and include is not None:
            for builtins in sorted(library.parent.glob("libnvrtc-builtins.so.*")):
                # NVRTC 13 dlopens this by name, which the loader does not find beside it
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            lib = ctypes.CDLL(str(library))
            _declare(lib)
            return Toolchain(name, lib, include, str(root))
    return f"no NVRTC with CUDA headers for {name}: {missing}"


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

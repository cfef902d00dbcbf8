"""The kernels' CUDA C++, read from this package's .cu files, and how NVRTC compiles it.

    from zmpi.kernels import source
    code = source.module_source(source.FAMILIES)        # common.cuh + every op family
    options = source.compile_options("__half", "float")  # what CuPy's RawModule is given

One .cu file per op family (llm.c's dev/cuda layout: one op a file, its launcher and NumPy twin
named in zmpi.kernels.OPS): layernorm, gelu, softmax and the loss, adam, a bias's gradient,
the Llama family's RMSNorm, rotary embeddings and SwiGLU gating, flash attention (SIMT) and
flash attention on tensor cores. common.cuh holds what they share
(the T and ACC types, conversions, reductions). A module's source is common.cuh followed by its
families, joined here rather than #included: CuPy's RawModule keys its on-disk cache on the code
and the options, so an edit to an included file would go unseen. The CPU executor
(tests/cuda_cpu.py) compiles the same text with g++.
"""
from __future__ import annotations

import functools
import os
import sys
from importlib import resources
from pathlib import Path

COMMON = "common.cuh"
# The fused ops' families, in the order a module holds them (zmpi.kernels' module)
FAMILIES = ("layernorm.cu", "gelu.cu", "softmax_loss.cu", "adam.cu", "bias_grad.cu",
            "rmsnorm.cu", "rope.cu", "swiglu.cu")
FLASH = "flash.cu"  # flash attention, SIMT: compiled after FAMILIES
FLASH_TC = "flash_tc.cu"  # flash attention on tensor cores (<mma.h>): after FLASH
CU_FILES = (COMMON, *FAMILIES, FLASH, FLASH_TC)


@functools.cache
def read(name: str) -> str:
    """The text of the package's .cu (or .cuh) file `name` (package data)."""
    if name not in CU_FILES:
        raise ValueError(f"no CUDA file {name!r} in zmpi.kernels: one of {', '.join(CU_FILES)}")
    return resources.files(__package__).joinpath(name).read_text()


def module_source(families=FAMILIES) -> str:
    """The source of a module holding `families` (.cu names, in order): common.cuh first."""
    return "".join(read(name) for name in (COMMON, *families))


def compile_options(t: str, acc: str, fmad: bool = True, paths=None) -> tuple[str, ...]:
    """NVRTC's options for a module on C types t (the arrays') and acc (the accumulator's): the
    two types as -D, and the directory holding crt/mma.h where `crt_include_dir(paths)` finds
    one (CuPy passes NVRTC only the CUDA runtime's headers, whose <mma.h> includes crt/mma.h,
    shipped in another wheel). fmad False adds --fmad=false (no multiply-add contraction), which
    only tests ask for, to bit-match a kernel against its NumPy twin; CuPy adds -arch and
    -ftz=true itself."""
    crt = crt_include_dir(paths)
    return ("--std=c++14", *(() if fmad else ("--fmad=false",)), f"-DZMPI_T={t}",
            f"-DZMPI_ACC={acc}", *((f"-I{crt}",) if crt else ()))


def crt_include_dir(paths=None) -> str | None:
    """The first directory holding crt/mma.h among: nvidia/cu13/include (CUDA 13's wheels,
    nvidia-cuda-crt) and nvidia/cuda_nvcc/include (CUDA 12's nvidia-cuda-nvcc-cu12) under each
    entry of `paths` (sys.path when None), then $CUDA_PATH/include, $CUDA_HOME/include and
    /usr/local/cuda/include (a toolkit's); None when none has it."""
    wheels = [Path(entry or ".", "nvidia", sub, "include") for entry in
              (sys.path if paths is None else paths) for sub in ("cu13", "cuda_nvcc")]
    toolkits = [Path(os.environ[v], "include") for v in ("CUDA_PATH", "CUDA_HOME")
                if os.environ.get(v)]
    return next((str(d) for d in (*wheels, *toolkits, Path("/usr/local/cuda/include"))
                 if (d / "crt" / "mma.h").is_file()), None)

"""zmpi.kernels' CUDA source, checked without a GPU: SOURCE compiles with NVRTC, warning-free,
for every (T, ACC) a launcher can ask for and for the oldest and a recent architecture; and
each CUDA launcher passes its kernel the arguments, in order and in C type, that the kernel's
signature in SOURCE declares.

NVRTC is a pip wheel (nvidia-cuda-nvrtc-cu12, with nvidia-cuda-runtime-cu12 for cuda_fp16.h
and cuda_bf16.h: the dev extra installs both on Linux x86_64); the compile tests skip where it
is missing. The options are what CuPy's RawModule passes NVRTC on a GPU:
zmpi.kernels.compile_options, the architecture as -arch=sm_XX (CuPy compiles to a cubin),
-ftz=true (CuPy always adds it) and the CUDA include directory.
"""
import re
import time

import cuda_cpu
import numpy as np
import nvrtc
import pytest

from zmpi import backend, kernels
from zmpi.optim.adam import AdamCoefficients

# (T, ACC): each dtype with its own accumulator, and the mixed pairs of adam and
# sum_of_squares, which accumulate in the master dtype (float32 or float64).
OPTION_SETS = [(t, acc) for t in ("__half", "__nv_bfloat16", "float", "double")
               for acc in ("float", "double")]
# Volta, the oldest architecture CUDA 12 compiles for, and Hopper.
ARCHITECTURES = ("sm_70", "sm_90")
# NVRTC 12.9 warns about the option (not the source) for architectures before sm_75.
_ARCH_DEPRECATED = re.compile(r"^nvrtc: warning: Architectures prior to .* are deprecated.*$",
                              re.MULTILINE)


@pytest.fixture(scope="module")
def nvrtc_lib():
    lib = nvrtc.load()
    if lib is None:
        pytest.skip("NVRTC (libnvrtc.so.12) is not installed: pip install nvidia-cuda-nvrtc-cu12 "
                    "nvidia-cuda-runtime-cu12 (the dev extra does on Linux x86_64)")
    include = nvrtc.cuda_include_dir()
    if include is None:
        pytest.skip("cuda_fp16.h not found (NVRTC 12 has no builtin copy): pip install "
                    "nvidia-cuda-runtime-cu12, or set CUDA_PATH to a CUDA toolkit")
    crt = nvrtc.crt_include_dir()  # for <mma.h>: the tensor-core flash kernels
    return lib, [include] + ([crt] if crt else [])


def _compile(nvrtc_lib, source, t, acc, arch):
    lib, includes = nvrtc_lib
    options = [*kernels.compile_options(t, acc), f"-arch={arch}", "-ftz=true",
               *(f"-I{d}" for d in includes)]
    ok, log = nvrtc.compile_source(lib, source, options)
    return ok, _ARCH_DEPRECATED.sub("", log).strip()


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("t, acc", OPTION_SETS)
def test_source_compiles_without_warnings(nvrtc_lib, t, acc, arch):
    started = time.perf_counter()
    ok, log = _compile(nvrtc_lib, kernels.SOURCE, t, acc, arch)
    assert ok, f"NVRTC {nvrtc.version(nvrtc_lib[0])}, T={t}, ACC={acc}, {arch}:\n{log}"
    assert log == "", f"T={t}, ACC={acc}, {arch}: NVRTC warns:\n{log}"
    assert time.perf_counter() - started < 60


def test_warnings_reach_the_log(nvrtc_lib):
    """The empty-log assertion above means something: NVRTC reports a warning by default."""
    source = kernels.SOURCE + "\n__device__ int zmpi_unused() { int unused; return 0; }\n"
    ok, log = _compile(nvrtc_lib, source, "float", "float", ARCHITECTURES[-1])
    assert ok and "warning" in log and "unused" in log, log


def test_a_macro_named_T_breaks_nvrtc(nvrtc_lib):
    """Why compile_options defines ZMPI_T and ZMPI_ACC: NVRTC's builtin header, read before the
    source, names template parameters T."""
    lib, (include, *_) = nvrtc_lib
    ok, log = nvrtc.compile_source(lib, "__global__ void k() {}\n",
                                   ["-DT=float", f"-arch={ARCHITECTURES[-1]}", f"-I{include}"])
    assert not ok and "__nv_nvrtc_builtin_header" in log, log


# -- each launcher's arguments against its kernel's signature (no GPU, no NVRTC) --------------

def _signatures(t="float", acc="float"):
    """{kernel: [cuda_cpu.Parameter, ...]} of SOURCE's extern "C" kernels for (T, ACC)."""
    return cuda_cpu.signatures(kernels.SOURCE, {"ZMPI_T": t, "ZMPI_ACC": acc})


def test_signatures_parse():
    signatures = _signatures()
    assert set(signatures) == {
        "layernorm_forward", "layernorm_backward", "column_sums", "column_sums_total",
        "gelu_forward", "gelu_backward", "causal_softmax", "softmax_backward",
        "cross_entropy_forward", "cross_entropy_backward", "adam", "sum_of_squares",
        "bias_grad"}
    count = signatures["adam"][4]
    assert (count.declaration, count.pointer, count.dtype) == ("const long long n", False,
                                                               np.dtype(np.int64))


def _launches(dtype, master):
    """Each CUDA launcher called on NumPy arrays of `dtype` (the optimizer's state in
    `master`): the ops the twins' contracts describe."""
    rng = np.random.default_rng(0)

    def a(*shape, d=dtype):
        return rng.standard_normal(shape).astype(d)

    acc = kernels.acc_dtype(dtype)
    x, w, b = a(2, 3, 8), a(8), a(8)
    kernels.cuda_layernorm_forward(x, w, b, 1e-5)
    for grads in ((None, None), (a(8), a(8))):  # the parameters' gradients, or new arrays
        kernels.cuda_layernorm_backward(a(2, 3, 8), (a(2, 3, 8, d=acc), a(2, 3, 1, d=acc), w),
                                        *grads)
    kernels.cuda_gelu_forward(a(4, 33))
    kernels.cuda_gelu_backward(a(4, 33), (a(4, 33), a(4, 33, d=acc)))
    kernels.cuda_causal_softmax(a(2, 2, 4, 9), 5)
    kernels.cuda_softmax_backward(a(2, 2, 4, 9), a(2, 2, 4, 9))
    z, targets = a(6, 11), rng.integers(0, 11, 6).astype(np.int64)
    for ignore in (None, -100):
        kernels.cuda_cross_entropy_rows(z, targets, ignore, 0.25)
        kernels.cuda_cross_entropy_grad(z, a(6, d=acc), targets, ignore, 0.5)
    param, m, v = a(100, d=master), a(100, d=master), a(100, d=master) ** 2
    kernels.cuda_adam(param, a(100), m, v, AdamCoefficients.of(
        master, 3, 1e-3, (0.9, 0.999), 1e-8, 0.01, True, 0.5))
    kernels.cuda_sum_of_squares(a(100), 0.5, np.dtype(master))
    kernels.cuda_bias_grad(a(300, 40), None)
    kernels.cuda_bias_grad(a(3, 40), a(40))


@pytest.mark.parametrize("dtype, master", [(np.float16, np.float32),
                                           (backend.BFLOAT16, np.float32),
                                           (np.float32, np.float32), (np.float32, np.float64),
                                           (np.float64, np.float64)])
def test_launchers_pass_what_the_kernels_declare(monkeypatch, dtype, master):
    signatures, calls = _signatures(), []

    def function(name, dtype, acc):
        def launch(grid, block, args):
            calls.append((name, dtype, acc, grid, block, args))
        return launch

    monkeypatch.setattr(backend, "xp", np)
    monkeypatch.setattr(kernels, "_function", function)
    with np.errstate(all="ignore"):  # the launchers sum np.empty partials here
        _launches(np.dtype(dtype), np.dtype(master))
    assert {c[0] for c in calls} == set(signatures)
    for name, t_dtype, acc_dtype, grid, block, args in calls:
        t = kernels._C_TYPES[t_dtype]
        acc = kernels._C_TYPES[acc_dtype]
        assert (t, acc) in OPTION_SETS, (name, t, acc)
        assert block == (kernels.THREADS,) and kernels.THREADS % 32 == 0
        assert isinstance(grid, tuple) and all(isinstance(g, int) and g >= 1 for g in grid)
        parameters = _signatures(t, acc)[name]
        assert len(args) == len(parameters), name
        for i, (arg, p) in enumerate(zip(args, parameters, strict=True)):
            if p.pointer:
                assert isinstance(arg, np.ndarray) and arg.flags.c_contiguous, (name, i)
                assert arg.dtype == p.dtype, f"{name} argument {i}: {arg.dtype} array, wants " \
                                             f"{p.dtype}"
            else:
                assert type(arg) is p.dtype.type, f"{name} argument {i}: {type(arg)}, wants " \
                                                  f"{p.dtype}"

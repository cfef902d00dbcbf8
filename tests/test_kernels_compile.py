"""zmpi.kernels' CUDA, checked without a GPU: the fused ops' module (common.cuh and the op
families' .cu files) compiles with NVRTC, warning-free, for every (T, ACC) a launcher can ask for
and for the oldest and a recent architecture, in both pip-wheel layouts CuPy compiles in (CUDA 12
and 13: tests/nvrtc.py); zmpi.kernels.source finds crt/mma.h as on the device; `OPS` names every
kernel, launcher and twin; and each CUDA launcher passes its kernel the arguments, in order and
in C type, that the kernel's signature declares.

The options are what CuPy's RawModule passes NVRTC on a GPU and nothing more: CuPy's one CUDA
include directory (nvrtc.Toolchain.include), zmpi.kernels.compile_options (with its crt lookup
searching the layout's folder, as it searches sys.path on the device), the architecture as
-arch=sm_XX (CuPy compiles to a cubin) and -ftz=true (CuPy always adds it). A layout that is not
installed skips (fails where CI=true).
"""
import importlib
import os
import re
import time

import cuda_cpu
import numpy as np
import nvrtc
import pytest

from zmpi import backend, kernels
from zmpi.kernels import llama as llama_kernels
from zmpi.kernels import source
from zmpi.optim.adam import AdamCoefficients

# (T, ACC): each dtype with its own accumulator, and the mixed pairs of adam and
# sum_of_squares, which accumulate in the master dtype (float32 or float64).
OPTION_SETS = [(t, acc) for t in ("__half", "__nv_bfloat16", "float", "double")
               for acc in ("float", "double")]
# The oldest architecture each layout compiles for (Volta for CUDA 12, Turing for 13), and Hopper
ARCHITECTURES = {"cuda12": ("sm_70", "sm_90"), "cuda13": ("sm_75", "sm_90")}
# NVRTC warns about the option (not the source) for architectures it deprecates.
_ARCH_DEPRECATED = re.compile(r"^nvrtc: warning: Architectures prior to .* are deprecated.*$",
                              re.MULTILINE)


def toolchain_or_skip(name: str) -> nvrtc.Toolchain:
    chain = nvrtc.toolchain(name)
    if isinstance(chain, str):
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(chain)
        pytest.skip(chain)
    return chain


@pytest.fixture(scope="module", params=nvrtc.LAYOUTS)
def toolchain(request):
    """Each wheel layout's NVRTC and CuPy include directory (a skip where it is missing)."""
    return toolchain_or_skip(request.param)


def _compile(chain, code, t, acc, arch, fmad=True):
    """Compile `code` as CuPy would in `chain`'s layout: (ok, the log less the option's
    deprecation warning)."""
    options = [*source.compile_options(t, acc, fmad, paths=[chain.root]), f"-arch={arch}",
               "-ftz=true", f"-I{chain.include}"]
    ok, log = nvrtc.compile_source(chain.lib, code, options)
    return ok, _ARCH_DEPRECATED.sub("", log).strip()


def _archs(chain):
    return ARCHITECTURES[chain.name]


@pytest.mark.parametrize("arch_index", [0, 1], ids=["oldest", "hopper"])
@pytest.mark.parametrize("t, acc", OPTION_SETS)
def test_source_compiles_without_warnings(toolchain, t, acc, arch_index):
    arch = _archs(toolchain)[arch_index]
    started = time.perf_counter()
    ok, log = _compile(toolchain, source.module_source(), t, acc, arch)
    where = f"{toolchain.name} (NVRTC {nvrtc.version(toolchain.lib)}), T={t}, ACC={acc}, {arch}"
    assert ok, f"{where}:\n{log}"
    assert log == "", f"{where}: NVRTC warns:\n{log}"
    assert time.perf_counter() - started < 60


def test_warnings_reach_the_log(toolchain):
    """The empty-log assertion above means something: NVRTC reports a warning by default."""
    code = source.module_source() + "\n__device__ int zmpi_unused() { int unused; return 0; }\n"
    ok, log = _compile(toolchain, code, "float", "float", _archs(toolchain)[-1])
    assert ok and "warning" in log and "unused" in log, log


def test_a_macro_named_T_breaks_nvrtc(toolchain):
    """Why compile_options defines ZMPI_T and ZMPI_ACC: NVRTC's builtin header, read before the
    source, names template parameters T."""
    ok, log = nvrtc.compile_source(toolchain.lib, "__global__ void k() {}\n",
                                   ["-DT=float", f"-arch={_archs(toolchain)[-1]}",
                                    f"-I{toolchain.include}"])
    assert not ok and "__nv_nvrtc_builtin_header" in log, log


def test_cupys_include_directory_alone_has_no_crt_in_cuda_12():
    """Issue 55's defect: CuPy's include directory holds <mma.h> but not the crt/mma.h it
    includes (CUDA 12: nvidia-cuda-nvcc-cu12's; CUDA 13: nvidia-cuda-crt's, in the same
    directory only when that wheel is installed), so the tensor-core module compiles only with
    the directory compile_options adds."""
    chain = toolchain_or_skip("cuda12")
    code = "#include <mma.h>\n__global__ void k() {}\n"
    ok, log = nvrtc.compile_source(chain.lib, code, ["-arch=sm_90", f"-I{chain.include}"])
    assert not ok and "crt/mma.h" in log, log
    ok, log = _compile(chain, code, "float", "float", "sm_90")
    assert ok, log


def test_crt_include_dir_searches_as_documented(tmp_path, monkeypatch):
    """nvidia/cu13/include, then nvidia/cuda_nvcc/include, of each path in order; then
    $CUDA_PATH/include and $CUDA_HOME/include; a directory without crt/mma.h never counts."""

    def with_crt(*parts):
        d = tmp_path.joinpath(*parts)
        (d / "crt").mkdir(parents=True)
        (d / "crt" / "mma.h").write_text("")
        return str(d)

    first, second = tmp_path / "a", tmp_path / "b"
    nvcc = with_crt("a", "nvidia", "cuda_nvcc", "include")
    (tmp_path / "a" / "nvidia" / "cu13" / "include").mkdir(parents=True)  # no crt/ in it
    cu13 = with_crt("b", "nvidia", "cu13", "include")
    assert source.crt_include_dir([first, second]) == nvcc
    assert source.crt_include_dir([second, first]) == cu13
    assert source.crt_include_dir([str(tmp_path / "a" / "nvidia")]) is None or \
        os.path.isfile("/usr/local/cuda/include/crt/mma.h")
    home, path = with_crt("home", "include"), with_crt("path", "include")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    assert source.crt_include_dir([]) == home
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "path"))
    assert source.crt_include_dir([]) == path
    assert source.crt_include_dir([second]) == cu13
    assert f"-I{cu13}" in source.compile_options("float", "float", paths=[second])


def test_production_modules_contract_multiply_adds():
    """--fmad=false only where a test asks for it (bit-matching a twin); every module zmpi
    compiles takes NVRTC's default, contraction on."""
    assert not any("fmad" in o for o in kernels.compile_options("__half", "float"))
    assert "--fmad=false" in source.compile_options("float", "float", fmad=False)


def test_the_cu_files_are_package_data():
    """Every .cu file loads through importlib.resources, and an unknown name is refused."""
    for name in source.CU_FILES:
        assert source.read(name).strip(), name
    with pytest.raises(ValueError, match="no CUDA file 'nope.cu'"):
        source.read("nope.cu")


def _resolve(dotted):
    module, name = dotted.split(":")
    return getattr(importlib.import_module(module), name)


def test_ops_names_every_kernel_launcher_and_twin():
    """kernels.OPS: each op's kernels are the extern "C" kernels of the files it names, every
    kernel of every .cu file belongs to exactly one op, and the launcher and twin it names are
    the pair kernels.fused made for it."""
    found = {}
    for name in (*source.FAMILIES, source.FLASH, source.FLASH_TC):
        for kernel in cuda_cpu.signatures(source.read(name), {"ZMPI_T": "float",
                                                              "ZMPI_ACC": "float"}):
            found[kernel] = name
    listed = [k for op in kernels.OPS.values() for k in op.kernels]
    assert sorted(listed) == sorted(found)
    pairs = set()
    for module in ("zmpi.nn.functional", "zmpi.nn.attention", "zmpi.optim.adam",
                   "zmpi.kernels.flash_attention", "zmpi.nn.llama_functional"):
        pairs |= {(op.__wrapped__, op.launcher)
                  for op in vars(importlib.import_module(module)).values()
                  if callable(op) and hasattr(op, "launcher")}
    for name, op in kernels.OPS.items():
        assert all(found[k] in op.files for k in op.kernels), name
        assert (_resolve(op.twin), _resolve(op.launcher)) in pairs, name
    assert len(pairs) == len(kernels.OPS)


# -- each launcher's arguments against its kernel's signature (no GPU, no NVRTC) --------------

def _signatures(t="float", acc="float"):
    """{kernel: [cuda_cpu.Parameter, ...]} of the fused ops' extern "C" kernels for (T, ACC)."""
    return cuda_cpu.signatures(source.module_source(), {"ZMPI_T": t, "ZMPI_ACC": acc})


def test_signatures_parse():
    signatures = _signatures()
    assert set(signatures) == {
        "layernorm_forward", "layernorm_backward", "column_sums", "column_sums_total",
        "gelu_forward", "gelu_backward", "causal_softmax", "softmax_backward",
        "cross_entropy_forward", "cross_entropy_backward", "adam", "sum_of_squares",
        "bias_grad", "rmsnorm_forward", "rmsnorm_backward", "rmsnorm_dw_partials",
        "rmsnorm_dw_total", "rope_forward", "rope_backward", "swiglu_forward",
        "swiglu_backward"}
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
    y, cache = llama_kernels.cuda_rmsnorm_forward(x, w, 1e-6)
    for dw in (None, a(8)):
        llama_kernels.cuda_rmsnorm_backward(a(2, 3, 8), cache, dw)
    cos, sin = a(3, 4), a(3, 4)
    heads = a(2, 3, 5, 8).reshape(2, 3, 5, 8).transpose(0, 2, 1, 3)  # (B, n, T, hd) as a view
    llama_kernels.cuda_rope_forward(heads, cos, sin)
    llama_kernels.cuda_rope_backward(a(2, 5, 3, 8), cos, sin,
                                     np.empty((2, 3, 5, 8), dtype).transpose(0, 2, 1, 3))
    y, cache = llama_kernels.cuda_swiglu_forward(a(4, 33), a(4, 33))
    llama_kernels.cuda_swiglu_backward(a(4, 33), cache)


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

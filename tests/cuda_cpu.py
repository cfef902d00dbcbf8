"""zmpi's CUDA C++ kernels run on the CPU, for tests on a machine without a GPU: the real source
(zmpi/kernels/*.cu, the modules zmpi.kernels.source.module_source joins), compiled by g++
against the CUDA builtins in tests/cuda_cpu_include/ and launched through zmpi's own launchers.

    import cuda_cpu
    monkeypatch.setattr(backend, "xp", cuda_cpu.DEVICE)    # zmpi.kernels' launchers now run
    y, cache = kernels.cuda_layernorm_forward(x, w, b, 1e-5)  # layernorm_forward on the CPU

`DEVICE` stands in for the cupy module where zmpi.kernels and its flash_attention use it:
its `RawModule(code=..., options=...)` compiles the source for the options' -D types (once per
source and options, cached in the temp directory) and `get_function(name)` gives a kernel
called as CuPy's are, `kernel(grid, block, args, shared_mem=0)`; its arrays are NumPy arrays,
and `empty` fills them with NaN (an output a kernel leaves unwritten shows). Each launch runs
every block of the grid, one after another, each block's threads as fibers that switch at
__syncthreads() and warp shuffles (zmpi_cuda_cpu.h), so the kernels' indexing, tiling,
barriers and reductions run as written, on IEEE float32/float64 arithmetic without FMA
contraction (NVRTC's --fmad=false), with the libm's expf/logf/tanhf in place of CUDA's.

The schedule: ordered (`DEVICE.shuffle_seed = None`, the default), the blocks run in grid
order and a block's runnable threads in ascending index until each reaches its next barrier;
shuffled (`DEVICE.shuffle_seed = SEED`), both in orders drawn anew for every launch and every
round between barriers from SEED and the launch's number, so a result that depends on which
block or thread runs first (a race: a thread reading what another writes between the same
two barriers, a block reading another's output) differs from the ordered run's or fails, and
the same seed repeats it. Denormals: `DEVICE.RawModule` adds -ftz=true to the options as
CuPy 14.2 does to every module (cupy/cuda/compiler.py), and a module compiled with it runs
its launches with denormal inputs and results flushed to zero (x86's FTZ and DAZ; unlike
CUDA's -ftz, float64's too). Dynamic shared memory: a launch gets at most 48 KiB unless the
kernel's `max_dynamic_shared_size_bytes` (CuPy's RawKernel attribute, CUDA's
cudaFuncAttributeMaxDynamicSharedMemorySize) was raised first, which is refused past the
device's opt-in limit (`cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]`, by
compute capability: 227 KiB on sm_90, 163 KiB on sm_80, ...).

What a launch checks that a GPU would not say: each argument's type against the kernel's
declaration (an array of the pointer's element type, C-contiguous; a NumPy scalar of the
parameter's exact type); no two arrays overlapping; no write outside an array (guard bytes
around each, checked after the launch), nor to a `const` one; barriers every live thread of a
block (or lane of a warp) reaches, with full masks (a partial mask is legal CUDA, which this
executor does not model: an error); wmma tiles loaded and stored 32-byte aligned with a
leading dimension of a multiple of 16 bytes (mma.h); grids and blocks within CUDA's limits;
dynamic shared memory within the kernel's limit (above). What it cannot: timing, static
shared memory's size and bank conflicts (static `__shared__` arrays are C++ statics that keep
the previous block's values, not NaN), registers, the device's own libm, two blocks running
at once (a shuffled grid still runs one block at a time, each to its end, so it shows races
of order, not of interleaving between blocks), a thread switching anywhere but at a barrier,
cuBLAS.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import ml_dtypes
import numpy as np

INCLUDE = Path(__file__).with_name("cuda_cpu_include")
COMPILER = shutil.which(os.environ.get("CXX", "g++"))
GUARD = 256  # bytes of 0xff around each array, and the arrays' alignment (cudaMalloc's)

_SIGNATURE = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')
_DYNAMIC_SHARED = re.compile(r"extern __shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+)\[\];")
_DTYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16, "float": np.float32,
           "double": np.float64, "int": np.int32, "long long": np.int64,
           "unsigned int": np.uint32, "unsigned char": np.uint8}
_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.float64): ctypes.c_double}
SHARED_BYTES = 48 << 10  # dynamic shared memory a launch gets without an opt-in
# the most a kernel may opt in to, by compute capability (CUDA C++ Programming Guide, Table
# "Technical Specifications per Compute Capability"), bytes
SHARED_OPTIN = {"70": 96 << 10, "72": 96 << 10, "75": 64 << 10, "80": 163 << 10,
                "86": 99 << 10, "87": 163 << 10, "89": 99 << 10, "90": 227 << 10,
                "100": 227 << 10, "120": 99 << 10}


class Parameter:
    """One kernel parameter: its declaration, whether it is a pointer (and const), and the
    NumPy dtype of its value or of the array it points to."""

    def __init__(self, declaration: str, defines: dict[str, str]):
        self.declaration = " ".join(declaration.split())
        *type_words, self.name = self.declaration.replace("*", " * ").split()
        self.const = type_words[0] == "const"
        self.pointer = "*" in type_words
        base = " ".join(w for w in type_words if w not in ("const", "*"))
        base = {"T": defines.get("ZMPI_T"), "ACC": defines.get("ZMPI_ACC")}.get(base, base)
        if base not in _DTYPES:
            raise TypeError(f"cuda_cpu: no NumPy dtype for parameter {self.declaration!r}")
        self.dtype = np.dtype(_DTYPES[base])


def signatures(code: str, defines: dict[str, str]) -> dict[str, list[Parameter]]:
    """{kernel: its parameters} of the source's extern "C" kernels, T and ACC as `defines`
    give them (ZMPI_T, ZMPI_ACC: zmpi.kernels.compile_options' -D options)."""
    return {name: [Parameter(p, defines) for p in params.split(",")]
            for name, params in _SIGNATURE.findall(code)}


class Kernel:
    """A compiled kernel, called as CuPy's RawKernel: kernel(grid, block, args, shared_mem),
    with its `max_dynamic_shared_size_bytes` (48 KiB until raised; kept by the module, as CUDA
    keeps it on the function)."""

    def __init__(self, module: RawModule, name: str, parameters: list[Parameter]):
        self.name, self.parameters, self._module = name, parameters, module
        library = module.library
        self._launch = getattr(library, f"zmpi_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t] + [
            ctypes.c_void_p if p.pointer else _CTYPES[p.dtype] for p in parameters]
        self._error = library.zmpi_error
        self._error.restype = ctypes.c_char_p
        self._schedule = library.zmpi_schedule
        self._schedule.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int]

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._module.shared_limits.get(self.name, SHARED_BYTES)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n):
        capability = DEVICE.compute_capability
        most = SHARED_OPTIN.get(capability, SHARED_BYTES)  # as cuda.Device().attributes says
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= most:
            raise RuntimeError(f"{self.name}: max_dynamic_shared_size_bytes {n!r}: "
                               f"CUDA_ERROR_INVALID_VALUE (compute capability {capability} "
                               f"opts in to at most {most} bytes)")
        self._module.shared_limits[self.name] = int(n)

    def __call__(self, grid, block, args, shared_mem=0):
        if len(args) != len(self.parameters):
            raise TypeError(f"{self.name}: {len(args)} arguments for "
                            f"{len(self.parameters)} parameters")
        limit = self.max_dynamic_shared_size_bytes
        if shared_mem > limit:
            raise RuntimeError(
                f"{self.name}: {shared_mem} bytes of dynamic shared memory: the kernel's limit "
                f"is {limit} (48 KiB unless max_dynamic_shared_size_bytes is raised, up to the "
                f"device's MaxSharedMemoryPerBlockOptin)")
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        for i, a in enumerate(arrays):
            if any(np.shares_memory(a, b) for b in arrays[i + 1:]):
                raise ValueError(f"{self.name}: two arguments share memory")
        copies = [self._argument(p, a) for p, a in zip(self.parameters, args, strict=True)]
        dims = [np.array((*d, 1, 1)[:3], np.uint32) for d in (tuple(grid), tuple(block))]
        DEVICE.launches += 1
        seed = DEVICE.shuffle_seed
        self._schedule(int(seed is not None),
                       0 if seed is None else hash((seed, DEVICE.launches)) % 2**64,
                       int(self._module.flush_to_zero))
        status = self._launch(dims[0].ctypes.data, dims[1].ctypes.data, shared_mem,
                              *[c.pointer if isinstance(c, _Guarded) else c for c in copies])
        if status:
            raise RuntimeError(f"{self.name}: {self._error().decode()}")
        for p, a, c in zip(self.parameters, args, copies, strict=True):
            if isinstance(c, _Guarded):
                c.check(f"{self.name}, {p.declaration}")
                data = c.data()
                if p.const and data.tobytes() != a.tobytes():
                    raise RuntimeError(f"{self.name} wrote to {p.declaration}")
                a[...] = data

    def _argument(self, p: Parameter, a):
        where = f"{self.name}, {p.declaration}"
        if p.pointer:
            if not isinstance(a, np.ndarray) or a.dtype != p.dtype or not a.flags.c_contiguous:
                got = (type(a).__name__ if not isinstance(a, np.ndarray) else
                       f"a {a.dtype} array{'' if a.flags.c_contiguous else ', not contiguous'}")
                raise TypeError(f"{where}: wants a C-contiguous {p.dtype} array, got {got}")
            return _Guarded(a)
        if not isinstance(a, np.generic) or a.dtype != p.dtype:
            raise TypeError(f"{where}: wants a NumPy {p.dtype} scalar, got {type(a).__name__}")
        return a.item()


class _Guarded:
    """A copy of an array between GUARD bytes of 0xff, aligned as cudaMalloc aligns."""

    def __init__(self, a: np.ndarray):
        self.nbytes, self.dtype, self.shape = a.nbytes, a.dtype, a.shape
        self.buffer = np.full(a.nbytes + 3 * GUARD, 0xff, np.uint8)
        self.start = GUARD + (-(self.buffer.ctypes.data + GUARD)) % GUARD
        self.buffer[self.start:self.start + a.nbytes] = np.frombuffer(a.tobytes(), np.uint8)
        self.pointer = self.buffer.ctypes.data + self.start

    def data(self) -> np.ndarray:
        raw = self.buffer[self.start:self.start + self.nbytes].copy()
        return raw.view(self.dtype).reshape(self.shape)

    def check(self, where: str):
        before, after = self.buffer[:self.start], self.buffer[self.start + self.nbytes:]
        if (before != 0xff).any() or (after != 0xff).any():
            raise RuntimeError(f"{where}: written outside the array")


class RawModule:
    """NVRTC's module for the CPU, as CuPy's RawModule(code=..., options=...) without CuPy's
    own options (DEVICE.RawModule adds them): -D options define the types, -ftz=true flushes
    denormals in its launches, --fmad=false is g++'s -ffp-contract=off (always on), the rest
    are NVRTC's and ignored."""

    def __init__(self, code: str, options=()):
        if COMPILER is None:
            raise RuntimeError("cuda_cpu: no C++ compiler (g++, or $CXX)")
        defines = dict(o[2:].split("=", 1) for o in options if o.startswith("-D"))
        self.flush_to_zero = "-ftz=true" in options
        self.shared_limits = {}  # {kernel: its max_dynamic_shared_size_bytes, once raised}
        self.kernels = signatures(code, defines)
        self.library = ctypes.CDLL(str(_compile(_translation_unit(code, self.kernels),
                                                [f"-D{k}={v}" for k, v in defines.items()])))

    def get_function(self, name: str) -> Kernel:
        if name not in self.kernels:
            raise AttributeError(f"cuda_cpu: no kernel {name!r} in the module")
        return Kernel(self, name, self.kernels[name])


def _translation_unit(code: str, kernels: dict[str, list[Parameter]]) -> str:
    """The source with its `extern __shared__` arrays pointed at the launch's dynamic shared
    memory, and an extern "C" launcher per kernel."""
    code = _DYNAMIC_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(zmpi_dynamic_shared);", code)
    launchers = [
        f'extern "C" int zmpi_launch_{name}(const unsigned int* zmpi_grid, '
        f"const unsigned int* zmpi_block, size_t zmpi_shared, "
        f"{', '.join(p.declaration for p in params)}) {{\n"
        f"    return zmpi_cpu::launch(zmpi_grid, zmpi_block, zmpi_shared, [=] {{ "
        f"{name}({', '.join(p.name for p in params)}); }});\n}}"
        for name, params in kernels.items()]
    return "\n".join([code, *launchers,
                      'extern "C" const char* zmpi_error() { return zmpi_cpu::error.c_str(); }'])


def _compile(source: str, defines: list[str]) -> Path:
    """The shared library of `source`, built once per (source, defines, headers)."""
    headers = "".join(p.read_text() for p in sorted(INCLUDE.glob("*.h")))
    key = hashlib.sha256("\0".join([source, *defines, headers]).encode()).hexdigest()[:20]
    out = Path(tempfile.gettempdir(), f"zmpi-cuda-cpu-{key}.so")
    if not out.exists():
        cpp = out.with_suffix(f".{os.getpid()}.cpp")
        cpp.write_text(source)
        partial = out.with_suffix(f".{os.getpid()}.so")
        built = subprocess.run([COMPILER, "-std=c++17", "-O1", "-fPIC", "-shared",
                                "-ffp-contract=off", "-Wl,-Bsymbolic", "-I", str(INCLUDE),
                                "-include", "zmpi_cuda_cpu.h", *defines, str(cpp), "-o",
                                str(partial)], capture_output=True, text=True)
        if built.returncode:
            raise RuntimeError(f"cuda_cpu: {COMPILER} failed on {cpp}:\n{built.stderr}")
        cpp.unlink()
        partial.replace(out)
    return out


class _Device:
    """The cupy module as zmpi's launchers use it, over NumPy (see the module docstring);
    `compute_capability` is what its cuda.Device() says, with the attributes that follow from
    it (a test may set another); `shuffle_seed` the schedule of every launch (None: ordered);
    `launches` counts them."""

    ndarray = np.ndarray
    compute_capability = "90"
    shuffle_seed = None
    launches = 0

    @staticmethod
    def RawModule(code: str, options=()):  # noqa: N802 (CuPy's name)
        """CuPy's RawModule: compiled with -ftz=true added, as CuPy adds it to every module."""
        return RawModule(code, (*options, "-ftz=true"))

    @property
    def cuda(self):
        device = types.SimpleNamespace(
            compute_capability=self.compute_capability,
            attributes={"MaxSharedMemoryPerBlock": SHARED_BYTES,
                        "MaxSharedMemoryPerBlockOptin": SHARED_OPTIN.get(self.compute_capability,
                                                                     SHARED_BYTES)})
        return types.SimpleNamespace(Device=lambda *_: device)

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=np.float32):
        dtype = np.dtype(dtype)
        return np.full(shape, np.nan if dtype.kind == "f" or dtype == _BF16 else 0, dtype)

    def empty_like(self, a, dtype=None):
        return self.empty(a.shape, a.dtype if dtype is None else dtype)

    @staticmethod
    def asarray(a, dtype=None):
        return np.array(a, dtype, copy=True, order="C")

    @staticmethod
    def asnumpy(a):
        return np.asarray(a)


_BF16 = np.dtype(ml_dtypes.bfloat16)
DEVICE = _Device()

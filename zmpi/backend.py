"""The array backend: NumPy on a CPU, CuPy on a GPU. The only module that knows which.

Everything else in zmpi allocates through `xp` (or `empty`/`zeros` here) and moves data across
the host/device boundary only through `to_host`, `to_device` and `pinned_empty`, so that an
offload policy is a choice of where buffers live, not a rewrite.

The backend is picked once, at import:

    ZMPI_BACKEND=numpy   always NumPy
    ZMPI_BACKEND=cupy    CuPy (fails loudly if it cannot be imported)
    (unset)              CuPy if it imports and a CUDA device is visible, else NumPy

Precision: NumPy has no fast float16 matmul (~250x slower than float32), so under NumPy
float16/bfloat16 are *storage and communication* dtypes and arithmetic runs in float32
(`compute_dtype`). On CuPy both stay 16-bit: GEMMs on tensor cores with float32
accumulation, everything else float32 inside zmpi's kernels. bfloat16 is `ml_dtypes.bfloat16`,
which CuPy supports from version 14 (`CUPY_BFLOAT16`); an older CuPy refuses it
(`dtype_from_name`, `cupy_bfloat16_refusal`).

Device choice: at import, under CuPy, from the launcher's node-local rank variable
(`LOCAL_RANK_VARIABLES`: OMPI_COMM_WORLD_LOCAL_RANK, MV2_COMM_WORLD_LOCAL_RANK,
MPI_LOCALRANKID, PMI_LOCAL_RANK, PALS_LOCAL_RANKID, SLURM_LOCALID), before MPI is initialised
(`zmpi.comm` imports this module first); the engine falls back to the local rank of a
shared-memory split.

This module imports no MPI; `zmpi.comm` hands a device buffer to MPI only once the work
that wrote it is done (`StreamPoint`, `HostCopy`: CUDA events, no device-wide sync).
"""

from __future__ import annotations

import functools
import os
import re
import sys

import ml_dtypes
import numpy as np

_DTYPES = {
    "float64": np.dtype(np.float64),
    "fp64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "fp32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "fp16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _cuda_device_visible(cupy) -> bool:
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, broken install: all mean "no GPU"
        return False


def _choose():
    """Return (array module, name) according to ZMPI_BACKEND."""
    want = os.environ.get("ZMPI_BACKEND", "").strip().lower()
    if want not in ("", "numpy", "cupy"):
        raise ValueError(f"ZMPI_BACKEND={want!r}: expected 'numpy' or 'cupy'")
    if want == "numpy":
        return np, "numpy"
    try:
        import cupy
    except ImportError:
        if want == "cupy":
            raise
        return np, "numpy"
    if want == "cupy" or _cuda_device_visible(cupy):
        return cupy, "cupy"
    return np, "numpy"


xp, name = _choose()
is_gpu = name == "cupy"


def _cupy():
    """The cupy module if something imported it, else None.

    No array can be a CuPy array unless cupy was imported, so we never import it just to ask.
    """
    return sys.modules.get("cupy")


def array_module(*arrays):
    """numpy or cupy, whichever the arrays belong to (like `cupy.get_array_module`)."""
    cupy = _cupy()
    if cupy is not None:
        return cupy.get_array_module(*arrays)
    return np


def is_device_array(arr) -> bool:
    """True for a CuPy array (device memory), False for anything else."""
    cupy = _cupy()
    return cupy is not None and isinstance(arr, cupy.ndarray)


# What CuPy needs for ml_dtypes.bfloat16 arrays, ufuncs and matmul (cupy#9494, its upgrade
# guide's "Minimal support for bfloat16"): CuPy 14, NumPy 2.1.2 (CuPy enables its bfloat16
# loops only from there), and a CUDA runtime of 12.2 or later (CuPy's bfloat16 header fails
# to compile before: cupy#9630; CuPy skips its own bfloat16 tests there); and a GPU of
# compute capability 8.0 or later, the first with bfloat16 tensor cores (cuBLAS's bfloat16
# GEMMs fail before: pytorch#57773).
CUPY_BFLOAT16 = {"cupy": (14,), "numpy": (2, 1, 2), "cuda": 12020, "capability": 80}


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "14.2.0-standin" -> (14, 2, 0)."""
    return tuple(int(n) for n in re.findall(r"\d+", text)[:3])


@functools.cache
def cupy_bfloat16_refusal() -> str | None:
    """Why this process's CuPy cannot compute in bfloat16 (`CUPY_BFLOAT16`), in one line, or
    None when it can. Asked once, of the versions and the current device's compute
    capability: no kernel runs."""
    cuda = xp.cuda.get_local_runtime_version()  # e.g. 12020 for CUDA 12.2
    if not (_version(xp.__version__) >= CUPY_BFLOAT16["cupy"]
            and _version(np.__version__) >= CUPY_BFLOAT16["numpy"]
            and cuda >= CUPY_BFLOAT16["cuda"]):
        return (f"bfloat16 on the cupy backend needs CuPy >= 14, NumPy >= 2.1.2 and CUDA >= "
                f"12.2 (ml_dtypes.bfloat16); this process has CuPy {xp.__version__}, NumPy "
                f"{np.__version__}, CUDA {cuda // 1000}.{cuda % 1000 // 10}: use fp16, or "
                "ZMPI_BACKEND=numpy")
    capability = int(xp.cuda.Device().compute_capability)  # e.g. "90" for an H100
    if capability < CUPY_BFLOAT16["capability"]:
        return (f"bfloat16 on a GPU needs compute capability 8.0 or later (bfloat16 tensor "
                f"cores: an A100, H100 or newer); this GPU's is {capability // 10}."
                f"{capability % 10}: use fp16")
    return None


def dtype_from_name(dtype_name: str) -> np.dtype:
    """'float32'|'fp32'|'float16'|'fp16'|'bfloat16'|'bf16'|'float64'|'fp64' -> numpy dtype.
    NotImplementedError for bfloat16 on a CuPy that cannot hold it (`cupy_bfloat16_refusal`)."""
    key = str(dtype_name).strip().lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype_name!r}; valid names: {', '.join(_DTYPES)}")
    dtype = _DTYPES[key]
    if dtype == BFLOAT16 and is_gpu and cupy_bfloat16_refusal() is not None:
        raise NotImplementedError(cupy_bfloat16_refusal())
    return dtype


def compute_dtype(data) -> np.dtype:
    """The dtype matmuls run in for `data` (an array, or a dtype: then the backend decides).

    On the host (NumPy): float16/bfloat16 -> float32 (NumPy has no fast float16 matmul). On
    the device (CuPy): float16 and bfloat16 stay as they are (tensor cores, float32
    accumulation). Everything else unchanged. Normalisation, softmax, GELU and the loss run
    in float32 whatever this says (zmpi.nn.functional), on both backends.
    """
    if isinstance(data, np.ndarray) or is_device_array(data):
        on_device, dtype = is_device_array(data), np.dtype(data.dtype)
    else:
        on_device, dtype = is_gpu, np.dtype(data)
    if dtype in (np.float16, BFLOAT16) and not on_device:
        return np.dtype(np.float32)
    return dtype


LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK",
                        "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "SLURM_LOCALID")
device_source = None  # how the device was chosen: a launcher variable, or "local rank"
device_id = None  # the GPU select_device made current (other threads bind it: zmpi.comm)


def launcher_local_rank() -> tuple[int, str] | None:
    """(this process's rank on its node, the variable it came from), as set by the launcher
    (Open MPI, MVAPICH, MPICH/Hydra, PMI, PALS, SLURM), or None."""
    for var in LOCAL_RANK_VARIABLES:
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value), var
    return None


def select_device(local_rank: int | None = None, source: str = "local rank"):
    """Bind this process to GPU `local_rank % device_count` (CuPy); returns its id, or None.
    At import (below) zmpi does this from the launcher's local-rank variable, before MPI is
    initialised (some transports bind to the current device in MPI_Init); the engine falls
    back to the node-local rank of a shared-memory split when no variable was set. The
    device is current in the calling thread only (CuPy's current device is per host thread):
    the id is kept in `device_id` for zmpi's other threads to bind (the MPI progress
    thread)."""
    global device_source, device_id
    if not is_gpu or local_rank is None:
        return None
    chosen = local_rank % xp.cuda.runtime.getDeviceCount()
    xp.cuda.Device(chosen).use()
    device_source, device_id = source, chosen
    return chosen


def device_count() -> int:
    return xp.cuda.runtime.getDeviceCount() if is_gpu else 0


def device_name() -> str | None:
    """The current GPU's name as CUDA gives it (e.g. "NVIDIA H100 80GB HBM3"); None on NumPy."""
    if not is_gpu:
        return None
    name = xp.cuda.runtime.getDeviceProperties(xp.cuda.runtime.getDevice())["name"]
    return name.decode() if isinstance(name, bytes) else name


if is_gpu and launcher_local_rank() is not None:
    select_device(*launcher_local_rank())


def use_tf32() -> None:
    """Run float32 matmuls on TensorFloat-32 tensor cores (10-bit mantissa inputs, float32
    accumulation; NVIDIA Ampere and later): CuPy's CUPY_TF32, which it reads at a process's
    first float32 matmul, so this must come before it (the engine calls it while it is built).
    ConfigError on NumPy: there is no TF32 on a CPU."""
    if not is_gpu:
        from zmpi.config import ConfigError

        raise ConfigError("tf32", "TensorFloat-32 matmuls need CuPy on an NVIDIA GPU; this "
                                  "process computes with NumPy")
    os.environ["CUPY_TF32"] = "1"


def empty(shape, dtype):
    """Uninitialised array in the backend's memory."""
    return xp.empty(shape, dtype=dtype)


def zeros(shape, dtype):
    """Zero-filled array in the backend's memory."""
    return xp.zeros(shape, dtype=dtype)


def synchronize():
    """Wait for all work queued on the current CUDA stream (no-op under NumPy).

    Call before handing a device buffer to MPI: MPI does not see the stream.
    """
    cupy = _cupy()
    if cupy is not None and is_gpu:
        cupy.cuda.get_current_stream().synchronize()


def to_host(arr, out=None):
    """Copy `arr` (device or host) into a NumPy array; `out` (NumPy, same shape/dtype) if given.

    Returns only once the data is on the host (blocking copy), so the result is safe to read
    or to hand to MPI. A NumPy `arr` without `out` is returned as is (no copy).
    """
    if is_device_array(arr):
        # blocking=True (the default) waits for the copy on the current stream.
        return arr.get(out=out)
    if out is None:
        return np.asarray(arr)
    np.copyto(out, arr)
    return out


def read_scalars(*values) -> list[float]:
    """`values` (0-d arrays or numbers) as Python floats, those on the device in one
    device -> host transfer (a sync on a GPU), so that a step reads its loss and its
    gradients' norm at once."""
    on_device = [i for i, v in enumerate(values) if is_device_array(v)]
    out = [None if i in on_device else float(v) for i, v in enumerate(values)]
    if on_device:
        both = xp.stack([values[i].reshape(()).astype(np.float64, copy=False)
                         for i in on_device])
        for i, value in zip(on_device, to_host(both).tolist(), strict=True):
            out[i] = value
    return out


def to_device(arr, out=None):
    """Copy host array `arr` into backend memory; into `out` (same shape/dtype) if given.

    Under NumPy this is `np.asarray` / `np.copyto`. Under CuPy the copy is queued on the
    current stream: call `synchronize()` before overwriting the source host buffer.
    """
    if out is None:
        return xp.asarray(arr)
    if not is_device_array(out):
        return to_host(arr, out=out)
    if is_device_array(arr):
        out[...] = arr
    else:
        out.set(np.ascontiguousarray(arr, dtype=out.dtype).reshape(out.shape))
    return out


def to_device_async(host, device):
    """Queue the copy of host array `host` into device array `device` (same shape and dtype)
    on the current stream, so GPU work queued after it sees the data. Returns a StreamPoint
    that is ready once the copy has landed: `host` must not change before. Under NumPy (or
    a host `device`) the copy is done at once and None is returned."""
    if not is_device_array(device):
        np.copyto(device, host)
        return None
    stream = xp.cuda.get_current_stream()
    device.set(host, stream=stream)  # with a stream given, CuPy copies asynchronously
    return StreamPoint()


class StreamPoint:
    """The current CUDA stream's position now: ready() once the GPU has finished every piece
    of work queued on it so far (an event), wait() blocks until then. Always ready under
    NumPy. MPI reading a device buffer waits for this instead of a full synchronize."""

    def __init__(self):
        self._event = xp.cuda.get_current_stream().record() if is_gpu else None

    def ready(self) -> bool:
        return self._event is None or self._event.done

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


def copy_(dst, src):
    """dst[...] = src, cast to dst's dtype, whichever memory (host or device) each lives in.

    Host -> device casts on the host, then copies (only dst.nbytes cross the bus: what
    ZeRO-Offload sends back after the host update is fp16 parameters). Device -> host casts
    on the device, then copies. Returns once dst holds the values."""
    from zmpi.kernels import host as host_kernels  # here: zmpi.kernels imports this module

    if is_device_array(dst) == is_device_array(src):
        host_kernels.cast_(dst, src)
    elif is_device_array(dst):
        to_device(host_kernels.astype(np.asarray(src), dst.dtype), out=dst)
        synchronize()
    else:
        to_host(src.astype(dst.dtype, copy=False), out=dst)
    return dst


class HostCopy:
    """A device -> host copy in flight: `wait()` returns the host array once it holds the data.

    Under CuPy the copy runs on a side stream after the work already queued on the current
    stream (an event orders them), so it overlaps whatever the current stream does next;
    `keep` holds the device source alive until then. Under NumPy the copy is done at once."""

    _stream = None  # the side stream, created on first use

    def __init__(self, src, out):
        self.out = out
        self._event = None
        if not is_device_array(src):
            np.copyto(out, src)
            return
        if HostCopy._stream is None:
            HostCopy._stream = xp.cuda.Stream(non_blocking=True)
        ready = xp.cuda.get_current_stream().record()
        HostCopy._stream.wait_event(ready)
        src.get(out=out, stream=HostCopy._stream, blocking=False)
        self._event = HostCopy._stream.record()
        self._keep = src

    def ready(self) -> bool:
        """True once the data has landed (never blocks)."""
        return self._event is None or self._event.done

    def wait(self):
        if self._event is not None:
            self._event.synchronize()
            self._event = self._keep = None
        return self.out


def pinned_empty(shape, dtype) -> np.ndarray:
    """NumPy array in page-locked host memory under CuPy (fast, async-capable copies);
    a plain `np.empty` under NumPy."""
    if not is_gpu:
        return np.empty(shape, dtype=dtype)
    import cupyx

    if hasattr(cupyx, "empty_pinned"):
        return cupyx.empty_pinned(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mem = xp.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
    return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape)


def device_memory_in_use() -> dict:
    """CuPy's default memory pool: {"used": bytes in live arrays, "held": bytes the pool
    holds, cached blocks included (what the device sees as allocated)}; zeros under NumPy."""
    if not is_gpu:
        return {"used": 0, "held": 0}
    pool = xp.get_default_memory_pool()
    return {"used": int(pool.used_bytes()), "held": int(pool.total_bytes())}


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS tells, else all)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
host_memory_kept = False  # whether keep_freed_host_memory() took effect in this process


def keep_freed_host_memory() -> bool:
    """Ask glibc's malloc to keep freed host memory for reuse rather than hand it back to the
    kernel: every block comes from the heap (none from a fresh mmap of its own, which glibc
    otherwise uses for blocks of 32 MiB or more and unmaps on free), and the heap is trimmed
    only of free memory beyond 2 GiB. A training step frees its activations and
    temporaries and allocates them again in the next step; memory handed back costs a page
    fault per 4 KiB page when it is touched again, 10-19% of a CPU step of the benchmark's
    GPT. The price: the process keeps the heap at its peak. Process-wide (every library's
    NumPy arrays, PyTorch's too); CuPy's device pool is not affected.
    ZMPI_KEEP_HOST_MEMORY=0 leaves malloc as it is. Returns whether it took effect (never
    off glibc)."""
    global host_memory_kept
    setting = os.environ.get("ZMPI_KEEP_HOST_MEMORY", "1").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"ZMPI_KEEP_HOST_MEMORY must be 0 or 1, got {setting!r}")
    if setting == "1" and not host_memory_kept:
        import ctypes
        import platform

        if platform.libc_ver()[0] == "glibc":
            mallopt = ctypes.CDLL(None).mallopt
            host_memory_kept = bool(mallopt(_M_MMAP_MAX, 0)
                                    and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))  # C int
    return host_memory_kept

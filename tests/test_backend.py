"""Tests for zmpi.backend on NumPy (always) and CuPy (marked gpu; skipped without a device).

    .venv/bin/python -m pytest tests/test_backend.py -q
"""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from zmpi import backend

BF16 = np.dtype(ml_dtypes.bfloat16)


def _cupy_with_device():
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    _cupy_with_device() is None or not backend.is_gpu,
    reason="needs CuPy, a CUDA device and the cupy backend",
)


def test_chosen_backend_is_consistent():
    assert backend.name in ("numpy", "cupy")
    assert backend.is_gpu == (backend.name == "cupy")
    assert backend.xp.__name__ == backend.name


def test_choose_follows_env(monkeypatch):
    monkeypatch.setenv("ZMPI_BACKEND", "numpy")
    assert backend._choose() == (np, "numpy")
    monkeypatch.setenv("ZMPI_BACKEND", "tensorflow")
    with pytest.raises(ValueError, match="numpy' or 'cupy"):
        backend._choose()
    monkeypatch.delenv("ZMPI_BACKEND")
    expected = "cupy" if _cupy_with_device() is not None else "numpy"
    assert backend._choose()[1] == expected


def test_import_pulls_in_neither_mpi_nor_cupy_under_numpy():
    code = ("import sys, zmpi.backend as b; "
            "assert b.name == 'numpy'; "
            "assert 'mpi4py' not in sys.modules and 'cupy' not in sys.modules")
    env = {"ZMPI_BACKEND": "numpy", "PYTHONPATH": str(Path(backend.__file__).parents[1])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_array_module_on_numpy():
    assert backend.array_module(np.zeros(2)) is np
    assert backend.array_module(np.zeros(2), np.ones(1)) is np
    assert backend.is_device_array(np.zeros(2)) is False


@pytest.mark.parametrize("name, dtype", [
    ("float32", np.float32), ("fp32", np.float32), ("float16", np.float16), ("fp16", np.float16),
    ("float64", np.float64), ("bf16", BF16), ("bfloat16", BF16), ("FP32", np.float32),
])
def test_dtype_from_name(name, dtype, monkeypatch):
    monkeypatch.setattr(backend, "is_gpu", False)
    assert backend.dtype_from_name(name) == np.dtype(dtype)


def test_dtype_from_name_errors():
    with pytest.raises(ValueError, match="valid names: .*bfloat16"):
        backend.dtype_from_name("float8")


@pytest.fixture
def cupy_of(monkeypatch):
    """Make the backend CuPy of the given versions (a stand-in module), its bfloat16 probe
    asked afresh."""
    def make(version, cuda, capability="90"):
        device = SimpleNamespace(compute_capability=capability)
        runtime = SimpleNamespace(get_local_runtime_version=lambda: cuda,
                                  Device=lambda *_: device)
        monkeypatch.setattr(backend, "xp", SimpleNamespace(__version__=version, cuda=runtime))
        monkeypatch.setattr(backend, "is_gpu", True)
        backend.cupy_bfloat16_refusal.cache_clear()

    yield make
    backend.cupy_bfloat16_refusal.cache_clear()


@pytest.mark.parametrize("version, cuda", [("14.2.0", 13000), ("14.0.0", 12020),
                                           ("15.0.0a1", 12090)])
def test_bfloat16_on_cupy_14(cupy_of, version, cuda):
    cupy_of(version, cuda)
    assert backend.cupy_bfloat16_refusal() is None
    assert backend.dtype_from_name("bf16") == BF16
    assert backend.dtype_from_name("fp16") == np.float16


@pytest.mark.parametrize("version, cuda, numpy", [("13.6.0", 12090, None),
                                                  ("14.2.0", 12010, None),
                                                  ("14.2.0", 13000, "2.1.1")])
def test_bfloat16_refused_by_an_older_cupy_in_one_line(cupy_of, monkeypatch, version, cuda,
                                                        numpy):
    """CuPy 13 has no bfloat16; CuPy 14 has it from NumPy 2.1.2 on, and compiles it from CUDA
    12.2 on: the error names what is needed and what this process has."""
    if numpy is not None:
        monkeypatch.setattr(np, "__version__", numpy)
    cupy_of(version, cuda)
    with pytest.raises(NotImplementedError) as refused:
        backend.dtype_from_name("bf16")
    message = str(refused.value)
    assert "\n" not in message and "needs CuPy >= 14, NumPy >= 2.1.2 and CUDA >= 12.2" in message
    assert f"CuPy {version}, NumPy {np.__version__}, CUDA {cuda // 1000}." in message
    assert backend.dtype_from_name("fp16") == np.float16


@pytest.mark.parametrize("capability", ["70", "75"])
def test_bfloat16_refused_before_ampere_in_one_line(cupy_of, capability):
    """A V100 (7.0) or T4 (7.5) has no bfloat16 tensor cores, and cuBLAS's bfloat16 GEMMs
    fail there: refused as the precision is read, fp16 offered."""
    cupy_of("14.2.0", 13000, capability)
    with pytest.raises(NotImplementedError) as refused:
        backend.dtype_from_name("bf16")
    assert str(refused.value) == (
        "bfloat16 on a GPU needs compute capability 8.0 or later (bfloat16 tensor cores: an "
        f"A100, H100 or newer); this GPU's is {capability[0]}.{capability[1]}: use fp16")
    assert backend.dtype_from_name("fp16") == np.float16


def test_compute_dtype(monkeypatch):
    monkeypatch.setattr(backend, "is_gpu", False)
    assert backend.compute_dtype(np.float16) == np.float32
    assert backend.compute_dtype(BF16) == np.float32
    assert backend.compute_dtype(np.float32) == np.float32
    assert backend.compute_dtype(np.float64) == np.float64
    assert backend.compute_dtype("int32") == np.int32
    monkeypatch.setattr(backend, "is_gpu", True)
    assert backend.compute_dtype(np.float16) == np.float16
    assert backend.compute_dtype(BF16) == BF16
    assert backend.compute_dtype(np.float32) == np.float32
    # an array decides for itself: host data computes in fp32 even on a GPU backend
    assert backend.compute_dtype(np.zeros(2, np.float16)) == np.float32
    assert backend.compute_dtype(np.zeros(2, BF16)) == np.float32


@pytest.mark.skipif(backend.is_gpu, reason="numpy backend behaviour")
def test_numpy_backend_functions():
    assert backend.select_device(3) is None
    e, z = backend.empty((2, 3), np.float32), backend.zeros((4,), BF16)
    assert isinstance(e, np.ndarray) and e.shape == (2, 3) and e.dtype == np.float32
    assert z.dtype == BF16 and not z.astype(np.float32).any()
    a = np.arange(6, dtype=np.float32)
    assert backend.to_host(a) is a
    out = np.empty(6, np.float32)
    assert backend.to_host(a, out=out) is out and np.array_equal(out, a)
    dev = backend.to_device(a)
    assert isinstance(dev, np.ndarray) and np.array_equal(dev, a)
    out2 = np.zeros(6, np.float32)
    assert backend.to_device(a, out=out2) is out2 and np.array_equal(out2, a)
    p = backend.pinned_empty((3, 2), BF16)
    assert isinstance(p, np.ndarray) and p.shape == (3, 2) and p.dtype == BF16
    backend.synchronize()
    assert backend.device_memory_in_use() == {"used": 0, "held": 0}


# --------------------------------------------------------------------------- GPU


@gpu
@needs_gpu
def test_gpu_host_device_roundtrip():
    import cupy

    assert backend.select_device(0) == 0
    host = np.arange(12, dtype=np.float16).reshape(3, 4)
    dev = backend.to_device(host)
    assert isinstance(dev, cupy.ndarray) and backend.is_device_array(dev)
    assert backend.array_module(dev) is cupy and backend.array_module(host) is np
    out = backend.pinned_empty((3, 4), np.float16)
    assert backend.to_host(dev * 2, out=out) is out
    assert np.array_equal(out, host * 2)
    dev2 = backend.zeros((3, 4), np.float16)
    backend.to_device(out, out=dev2)
    backend.synchronize()
    assert np.array_equal(cupy.asnumpy(dev2), host * 2)
    assert backend.device_memory_in_use()["used"] > 0


@gpu
@needs_gpu
def test_gpu_staging_through_host(monkeypatch):
    import cupy

    from zmpi.comm import Comm, wait_all

    monkeypatch.setenv("ZMPI_CUDA_AWARE", "0")
    comm = Comm()
    buf = cupy.arange(8, dtype=cupy.float32)
    assert comm.allreduce(buf) is buf and cupy.asnumpy(buf).tolist() == list(range(8))
    recv = cupy.zeros(8, cupy.float16)
    req = comm.ireduce_scatter(cupy.arange(8, dtype=cupy.float16), recv)
    gathered = cupy.zeros(8, cupy.float32)
    req2 = comm.iallgather(buf, gathered)
    wait_all([req, req2])
    assert cupy.asnumpy(recv).tolist() == list(range(8))
    assert cupy.asnumpy(gathered).tolist() == list(range(8))


@gpu
@needs_gpu
def test_gpu_collectives_on_two_ranks():
    from mpi_util import RANKS_DIR, run_mpi

    reports = run_mpi(RANKS_DIR / "comm_gpu_checks.py", 2, env={"ZMPI_BACKEND": "cupy"})
    for r, rep in enumerate(reports):
        assert rep["allreduce"] == [1.0] * 5  # 0 + 1
        assert rep["reduce_scatter"] == [2.0 * (2 * r + j) + 1 for j in range(2)]
        assert rep["allgather"] == [0.0, 0.0, 1.0, 1.0]
        assert rep["broadcast"] == [0.0, 1.0, 2.0]


_REFAULTS = """
import json, resource, sys
import numpy as np
from zmpi import backend
kept = backend.keep_freed_host_memory()
faults = []
for mib in (64, 48, 16, 64, 8):  # allocate, touch and free, as a step does its activations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(mib << 18, np.float32)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del a
print(json.dumps({"kept": kept, "faults": faults}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("setting", ["1", "0"])
def test_freed_host_memory_is_kept_for_reuse(setting):
    """With the setting on, freed blocks of 8-64 MiB are reused without page faults; off
    (malloc as it is), some of them map fresh pages again (hundreds of faults)."""
    env = {"ZMPI_BACKEND": "numpy", "ZMPI_KEEP_HOST_MEMORY": setting,
           "PYTHONPATH": str(Path(backend.__file__).parents[1])}
    out = subprocess.run([sys.executable, "-c", _REFAULTS], check=True, env=env, timeout=60,
                         capture_output=True, text=True).stdout
    report = __import__("json").loads(out)
    assert report["kept"] == (setting == "1")
    if setting == "1":
        assert max(report["faults"][1:]) < 50, report  # the first allocation maps the pages
    else:
        assert max(report["faults"][1:]) > 200, report


def test_keep_host_memory_setting_is_checked(monkeypatch):
    monkeypatch.setenv("ZMPI_KEEP_HOST_MEMORY", "yes")
    with pytest.raises(ValueError, match="ZMPI_KEEP_HOST_MEMORY must be 0 or 1"):
        backend.keep_freed_host_memory()

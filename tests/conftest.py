"""Suite-wide setting: the processes the suite starts run NumPy's host loops.

Every mpiexec rank and `zmpi` command the tests start gets ZMPI_NUMBA=0 unless the test or the
caller says otherwise. Loading Numba costs a process about half a second of a core (its import
and the first call of its cached loops); over the suite's 400 or so processes that was a
quarter of `make test`'s time, while their tiny models gain nothing from the compiled loops,
which give the same bits as NumPy (tests/test_host_kernels.py). This process keeps the loops
its environment asks for (compiled by default), so the engine tests that run in it use them,
and the ZeRO-Offload suite's ranks ask for them again (tests/test_offload.py).
`ZMPI_NUMBA=1 make test` runs every process with them.

The `tmpfs` fixture mounts a small or read-only file system for the disk-fault tests; the
`cuda_device` fixture runs a test of zmpi's CUDA launchers on a GPU and on the CPU
(tests/cuda_cpu.py: the same kernels compiled by g++).
"""
import os
import subprocess

import cuda_cpu
import pytest

from zmpi import backend, kernels
from zmpi.kernels import flash_attention
from zmpi.kernels import host as host_kernels  # noqa: F401  (loaded now, as the env says)

os.environ.setdefault("ZMPI_NUMBA", "0")


def pytest_addoption(parser):
    """The shared strategy suite (tests/test_zero.py) on chosen strategies: `--strategy NAME`
    (repeatable; or ZMPI_TEST_STRATEGY, comma-separated) runs it on those alone, and
    `--strategy-module FILE.py` (repeatable; or ZMPI_TEST_STRATEGY_MODULE) imports a strategy
    file on every rank first, so its `@register` strategies are tested without installing a
    package (`make test-strategy`, docs/strategies.md)."""
    group = parser.getgroup("zmpi", "zmpi's strategy suite (tests/test_zero.py)")
    group.addoption("--strategy", action="append", default=[], metavar="NAME",
                    help="run the strategy suite on this strategy only (repeatable)")
    group.addoption("--strategy-module", action="append", default=[], metavar="FILE.py",
                    help="a strategy file the suite imports first (repeatable)")


@pytest.fixture
def isolated_registry(monkeypatch, tmp_path):
    """The strategy registry as it was before the test, after it, and the modules the test
    imported from its tmp_path gone: a strategy file a test loads leaves no name behind."""
    import sys

    from zmpi.zero import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.fixture(scope="session")
def strategy_selection(pytestconfig):
    """(names, files): the strategies the suite is limited to (empty: all) and the strategy
    files it loads, from the options or, where they are not given, the environment."""

    def chosen(option, variable):
        given = pytestconfig.getoption(option) or os.environ.get(variable, "").split(",")
        return tuple(v.strip() for v in given if v.strip())

    files = tuple(os.path.abspath(f) for f in chosen("strategy_module",
                                                     "ZMPI_TEST_STRATEGY_MODULE"))
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise pytest.UsageError(f"--strategy-module: no file {', '.join(missing)}")
    return chosen("strategy", "ZMPI_TEST_STRATEGY"), files


@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a new directory on a tmpfs of its own, mounted with `options` (a
    small size for a full disk, "size=64k"; "ro" for a read-only mount) and unmounted after
    the test. Skips the test where this process cannot mount one (not root, no
    CAP_SYS_ADMIN, not Linux): CI runs it as root on Linux."""
    mounted = []

    def mount(options: str):
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                                  capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'})")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


_COMPILED = (kernels._function, kernels._modules, flash_attention._function,
             flash_attention._tensor_core_module_builds, flash_attention._tensor_cores,
             flash_attention._shared_limit)  # the caches
# themselves (a test may patch the names)


def _forget_compiled_kernels():
    for cached in _COMPILED:
        cached.cache_clear()
    kernels._arrived[0] = None  # bias_grad's counters, made by the other module


SHUFFLE_SEED = os.environ.get("ZMPI_CUDA_CPU_SEED", "1")  # the "cpu-shuffled" case's


def pytest_configure(config):
    if not SHUFFLE_SEED.isdigit():
        raise pytest.UsageError(f"ZMPI_CUDA_CPU_SEED={SHUFFLE_SEED!r}: want a whole number, "
                                "the seed of the CPU executor's shuffled order")


@pytest.fixture(params=["cpu", "cpu-shuffled", pytest.param("gpu", marks=pytest.mark.gpu)])
def cuda_device(request, monkeypatch):
    """The module zmpi's CUDA launchers run on, as `cupy` in the test: CuPy on a GPU (the "gpu"
    case, skipped without one), or cuda_cpu.DEVICE, the kernels compiled for the CPU and
    backend.xp pointing at it for the test (skipped without a C++ compiler), its blocks and
    threads run in order ("cpu") or shuffled ("cpu-shuffled", from the seed
    ZMPI_CUDA_CPU_SEED, 1 by default: a race between blocks or between a block's threads
    shows)."""
    if request.param == "gpu":
        cupy = pytest.importorskip("cupy")
        if getattr(cupy, "STANDIN", False) or cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("needs a CUDA device")
        yield cupy
        return
    if cuda_cpu.COMPILER is None:
        pytest.skip("no C++ compiler for tests/cuda_cpu.py")
    _forget_compiled_kernels()
    monkeypatch.setattr(backend, "xp", cuda_cpu.DEVICE)
    monkeypatch.setattr(cuda_cpu.DEVICE, "compute_capability", "90")  # a test may lower it
    monkeypatch.setattr(cuda_cpu.DEVICE, "shuffle_seed",
                        int(SHUFFLE_SEED) if request.param == "cpu-shuffled" else None)
    monkeypatch.setattr(cuda_cpu.DEVICE, "launches", 0)  # each launch's order: seed, number
    yield cuda_cpu.DEVICE
    _forget_compiled_kernels()

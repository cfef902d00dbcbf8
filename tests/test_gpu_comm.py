"""Communication on the GPU path (issue 28), on the NumPy backend and the strict CuPy
stand-in (tests/standin):

- 16-bit float reductions never run a Python-level MPI.Op: float16 uses MPI's own type where
  the MPI has one (MPIX_C_FLOAT16), and otherwise - as bfloat16 always - travels as float32
  and is rounded back once; host and device buffers, blocking and non-blocking, allreduce and
  reduce-scatter, staged and "CUDA-aware"; the counters count the float32 bytes;
- ZeRO-Offload's host buffers for device copies are page-locked under CuPy by default;
- the MPI progress thread binds the rank's GPU (CuPy's current device is per host thread);
- MVAPICH's and Cray MPICH's CUDA switches, and MVAPICH's local-rank variable.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import CUDA_QUERY, RANKS_DIR, REPO_ROOT, STANDIN, child_env, run_mpi

from zmpi import backend
from zmpi.comm import MPI, mpi_info
from zmpi.memory import ring_bytes

sys.path.insert(0, str(RANKS_DIR))
import gpu_comm_checks as checks  # noqa: E402

NUMPY = {"ZMPI_BACKEND": "numpy"}
N = 3  # ranks: with 3, rounding after every pairwise step differs from rounding once
FLOAT16_T_NAME = MPI.FLOAT16_T.Get_name()  # MPICH: MPIX_C_FLOAT16, Open MPI: MPI_SHORT_FLOAT

SETUPS = {  # name: (mode of the rank script, environment)
    "numpy-native": ("native", NUMPY),
    "numpy-no_float16": ("no_float16", NUMPY),
    "standin-staged-no_float16": ("no_float16", {**STANDIN, "ZMPI_CUDA_AWARE": "0"}),
    "standin-aware-no_float16": ("no_float16", {**STANDIN, "ZMPI_CUDA_AWARE": "1"}),
    "standin-aware-native": ("native", {**STANDIN, "ZMPI_CUDA_AWARE": "1"}),
}


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request):
    mode, env = SETUPS[request.param]
    return request.param, mode, run_mpi(RANKS_DIR / "gpu_comm_checks.py", N, args=[mode],
                                        timeout=120, env=env)


def _expected(dtype):
    """Rank r's results of every reduction path, rounded once from the exact values."""
    rows = checks.inputs(N, dtype, checks.K).astype(np.float64)
    once = {"sum": rows.sum(0), "max": rows.max(0), "min": rows.min(0)}
    once = {op: v.astype(dtype).astype(np.float64) for op, v in once.items()}
    block = checks.K // N
    per_rank = []
    for r in range(N):
        mine = slice(r * block, (r + 1) * block)
        per_rank.append({"allreduce_sum": once["sum"], "iallreduce_sum": once["sum"],
                         "allreduce_max": once["max"], "iallreduce_min": once["min"],
                         "reduce_scatter_sum": once["sum"][mine],
                         "ireduce_scatter_sum": once["sum"][mine],
                         "reduce_scatter_max": once["max"][mine]})
    return per_rank, rows


def test_the_inputs_tell_rounding_once_from_rounding_every_step():
    """Guard of the test below: for both dtypes, summing in a pairwise order with a rounding
    after each step gives another result than rounding once, somewhere."""
    for dtype in checks.DTYPES.values():
        rows = checks.inputs(N, dtype, checks.K)
        stepwise = rows[0]
        for row in rows[1:]:
            stepwise = (stepwise.astype(np.float32) + row.astype(np.float32)).astype(dtype)
        once = rows.astype(np.float32).sum(0).astype(dtype)
        assert not np.array_equal(stepwise, once), dtype


@pytest.mark.mpi
def test_16_bit_reductions_use_predefined_ops_and_round_once(setup):
    """Every float16/bfloat16 reduction reaches MPI with a predefined op, as float32 (bfloat16
    always; float16 without MPIX_C_FLOAT16) or as MPI's float16; as float32 its result is the
    exact value rounded once, its counters count 4 bytes an element and staging moves the
    float32 copies; as MPI's float16, within MPICH's pairwise rounding of the exact value."""
    name, mode, reports = setup
    for r, rep in enumerate(reports):
        assert rep["backend"] == ("cupy" if name.startswith("standin") else "numpy")
        assert rep["cuda_aware"] == ("aware" in name)
        # every reduction reached MPI with a predefined op, as float32 or MPI's float16
        assert rep["calls"] and all(call[1] for call in rep["calls"]), rep["calls"]
        types = {t for call in rep["calls"] for t in call[2:]}
        assert types == ({"IN_PLACE", "MPI_FLOAT", FLOAT16_T_NAME} if mode == "native"
                         else {"IN_PLACE", "MPI_FLOAT"}), types
        paths = {"float16/host", "bfloat16/host"} | (
            {"float16/device"} if name.startswith("standin") else set())
        assert set(rep["results"]) == paths
        for path, got in rep["results"].items():
            dtype = checks.DTYPES[path.split("/")[0]]
            expected, rows = _expected(dtype)
            wide = not (mode == "native" and path.startswith("float16"))
            for key, want in expected[r].items():
                if wide:  # float32 on the wire: exactly the exact value rounded once
                    assert got[key] == want.tolist(), (name, path, key)
                else:  # MPICH's float16 op rounds each pairwise step (error <= N-1 halves)
                    ulp = np.abs(want) * np.finfo(dtype).eps
                    assert np.all(np.abs(np.array(got[key]) - want) <= (N - 1) * ulp), key
            assert got["result_is_buffer"]
            itemsize = 4 if wide else 2  # bytes per element on the wire
            block = checks.K // N
            assert got["counters"] == {
                "allreduce": {"calls": 1, "bytes": 2 * checks.K,
                              "sent": ring_bytes(itemsize * checks.K, N, 2)},
                "reduce_scatter": {"calls": 1, "bytes": 2 * block * N,
                                   "sent": ring_bytes(itemsize * block * N, N)}}, path
            staged = path.endswith("device") and "staged" in name  # float32 crosses
            assert got["staged"] == ({"to_host": 4 * (checks.K + block * N),
                                      "to_device": 4 * (checks.K + block)}
                                     if staged else {"to_host": 0, "to_device": 0}), path


OFFLOAD = """
import sys
sys.path[:0] = ["tests/ranks", "tests"]
import numpy as np
from zero_checks import GPT_CONFIG, config, gpt_data
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT


def pinned(a):  # in the stand-in's page-locked memory: a view of alloc_pinned_memory's bytes
    while isinstance(a, np.ndarray):
        a = a.base
    return isinstance(a, memoryview) and isinstance(a.obj, bytearray)


CPU = {"device": "cpu"}  # pin_memory left at its default (false)
comm = Comm()
for stage, zero in ((2, {"offload_optimizer": CPU}),
                    (3, {"offload_optimizer": CPU, "offload_param": CPU}),
                    (1, {"offload_optimizer": {**CPU, "delay_update": True}})):
    cfg = config(stage, "fp16", accumulation=2)
    cfg["zero_optimization"].update(zero)
    engine = Engine(GPT(GPT_CONFIG, seed=0), cfg, comm)
    s, landings, alloc = engine.strategy, [], engine.strategy.alloc

    def alloc_and_record(*args, **kwargs):  # the landing buffers of the gradient copies
        buf = alloc(*args, **kwargs)
        if args[3] == "d2h":
            landings.append(pinned(buf))
        return buf

    s.alloc = alloc_and_record
    engine.train_step(*gpt_data(comm, 2).sample(0))
    host = [b for b in (s.grads_shard, s.grads_spare, s.params_shard)
            if isinstance(b, np.ndarray)]
    print(stage, len(host), sum(map(pinned, host)), len(landings), sum(landings))
"""


@pytest.mark.parametrize("where", ["standin", "numpy"])
def test_offload_copies_go_through_pinned_host_buffers_by_default(where):
    """Without pin_memory, under CuPy: the host gradient shard (stage 2), with it stage 3's
    host parameter shard, and the delayed update's second gradient shard (stage 1) are
    page-locked, and so is every buffer a gradient copy lands in while gradients accumulate
    (stages 2 and 3). Under NumPy nothing is (there is no device to copy from)."""
    env = STANDIN if where == "standin" else child_env(**NUMPY)
    out = subprocess.run([sys.executable, "-c", OFFLOAD], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout
    rows = [list(map(int, line.split())) for line in out.splitlines()]
    on = where == "standin"
    # stage, host buffers, pinned ones, landing buffers, pinned ones
    assert rows[0][:3] == [2, 1, on] and rows[0][3] > 0 and rows[0][4] == on * rows[0][3]
    assert rows[1][:3] == [3, 2, 2 * on] and rows[1][3] > 0 and rows[1][4] == on * rows[1][3]
    assert rows[2] == [1, 2, 2 * on, 0, 0], rows


PROGRESS = """
import sys, time
import numpy as np
from zmpi import backend
from zmpi.comm import Comm, _PROGRESS


def polled(req):  # start the collective and wait until the thread polled while it flies
    before = _PROGRESS.polls
    req.start()
    deadline = time.monotonic() + 30
    while _PROGRESS.polls == before and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _PROGRESS.polls > before, "the progress thread never polled"
    return req


def message():  # a receive in flight (one rank's collectives never reach MPI), then its send
    req = polled(comm.irecv(got, 0))
    comm.send(buf, 0)
    req.wait()


comm = Comm()
buf, got = backend.xp.ones(4, np.float32), backend.xp.zeros(4, np.float32)
message()
if backend.is_gpu:
    import cupy
    first = cupy.cuda.thread_devices().get(_PROGRESS._thread.ident, 0)
    backend.select_device(1)  # the engine's fallback, after the thread started
    message()
    then = cupy.cuda.thread_devices().get(_PROGRESS._thread.ident, 0)
    print(first, then, cupy.cuda.runtime.getDevice())
else:
    print("cupy" in sys.modules)
"""


def _clean_env(**env):
    """The test's environment without any launcher's local-rank variable, plus `env`."""
    base = {k: v for k, v in os.environ.items() if k not in backend.LOCAL_RANK_VARIABLES}
    return {**base, **env}


def test_the_progress_thread_binds_the_ranks_gpu():
    """The launcher says local rank 3 of 4 GPUs: the main thread uses device 3, and so does
    the progress thread (a new host thread starts on device 0); when the engine picks a
    device later, the thread follows at its next poll. Under NumPy it imports no cupy."""
    env = _clean_env(**STANDIN, ZMPI_STANDIN_DEVICES="4", SLURM_LOCALID="3",
                     ZMPI_PROGRESS_THREAD="1", ZMPI_CUDA_AWARE="1")
    out = subprocess.run([sys.executable, "-c", PROGRESS], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["3", "1", "1"], out
    env = _clean_env(PYTHONPATH=STANDIN["PYTHONPATH"], ZMPI_BACKEND="numpy",
                     ZMPI_PROGRESS_THREAD="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROGRESS], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"], out


def test_mvapich_local_rank_picks_the_device():
    code = ("from zmpi import backend; import cupy; "
            "print(backend.device_source, backend.device_id, cupy.cuda.runtime.getDevice())")
    env = _clean_env(**STANDIN, ZMPI_STANDIN_DEVICES="4", MV2_COMM_WORLD_LOCAL_RANK="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["MV2_COMM_WORLD_LOCAL_RANK", "2", "2"]


SWITCHES = ("MV2_USE_CUDA", "MVP_ENABLE_CUDA", "MPICH_GPU_SUPPORT_ENABLED", "ZMPI_CUDA_AWARE")


@pytest.mark.parametrize("library, env, expected", [
    ("MVAPICH2 Version      :\t2.3.7", {"MV2_USE_CUDA": "1"}, (True, "MV2_USE_CUDA")),
    ("MVAPICH2 Version      :\t2.3.7", {"MV2_USE_CUDA": "0"}, (False, "MV2_USE_CUDA")),
    ("MVAPICH Version : 3.0", {"MVP_ENABLE_CUDA": "1"}, (True, "MVP_ENABLE_CUDA")),
    ("MPI VERSION : CRAY MPICH version 8.1.28 (ANL base 3.4a2)",
     {"MPICH_GPU_SUPPORT_ENABLED": "1"}, (True, "MPICH_GPU_SUPPORT_ENABLED")),
    ("MPI VERSION : CRAY MPICH version 8.1.28 (ANL base 3.4a2)",
     {"MPICH_GPU_SUPPORT_ENABLED": "0"}, (False, "MPICH_GPU_SUPPORT_ENABLED")),
    # ZMPI_CUDA_AWARE still overrides
    ("MVAPICH2 Version      :\t2.3.7", {"MV2_USE_CUDA": "1", "ZMPI_CUDA_AWARE": "0"},
     (False, "ZMPI_CUDA_AWARE")),
    # another MPI's switch is not read: the loaded library (the mpich wheel) answers
    (None, {"MV2_USE_CUDA": "1", "MPICH_GPU_SUPPORT_ENABLED": "1"}, (False, CUDA_QUERY)),
    # the switch unset: the loaded library's own answer
    ("MVAPICH2 Version      :\t2.3.7", {}, (False, CUDA_QUERY)),
])
def test_cuda_switches_of_mvapich_and_cray_mpich(monkeypatch, library, env, expected):
    from zmpi.comm import Comm

    for var in SWITCHES:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if library is not None:
        monkeypatch.setattr(mpi_info.MPI, "Get_library_version", lambda: library)
    assert mpi_info.cuda_support() == expected
    comm = Comm()
    assert (comm.is_cuda_aware, comm.cuda_aware_source) == expected


def test_a_cuda_switch_that_is_no_integer_is_an_error(monkeypatch):
    monkeypatch.delenv("ZMPI_CUDA_AWARE", raising=False)
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "yes")
    monkeypatch.setattr(mpi_info.MPI, "Get_library_version",
                        lambda: "MPI VERSION : CRAY MPICH version 8.1.28")
    with pytest.raises(ValueError, match="MPICH_GPU_SUPPORT_ENABLED='yes': expected an integer"):
        mpi_info.cuda_support()

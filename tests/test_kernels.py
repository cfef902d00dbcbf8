"""Fused kernels (zmpi.kernels): the switch, the twins against the composed path, the launch
and sync counts of a training step on the CuPy stand-in, and (on a GPU) each CUDA kernel
against its twin.

On the stand-in (tests/standin) a fused op runs its NumPy twin on the host, counted as the
launches of its CUDA launcher, and "composed" runs the same twin op by op on stand-in arrays:
the two must agree bit for bit, and the fused one must be one launch (two or three where the
docstrings say so) and no cast.
"""
import csv
import functools
import json
import subprocess
import sys

import cuda_cpu
import numpy as np
import pytest
from mpi_util import REPO_ROOT, STANDIN, child_env

from zmpi import backend, kernels
from zmpi.config import Config, ConfigError
from zmpi.kernels import source
from zmpi.nn import attention as A
from zmpi.nn import functional as F
from zmpi.optim.adam import AdamCoefficients, _adam_twin, _sum_of_squares_twin

# Each fused op, run on the stand-in under both modes: (launches when fused, its results).
OPS = """
import json, sys
import numpy as np, cupy
from zmpi import backend, kernels
from zmpi.nn import attention as A
from zmpi.nn import functional as F
from zmpi.nn import llama_functional as L
from zmpi.optim.adam import Adam, AdamCoefficients, _adam_device

rng = np.random.default_rng(0)
def dev(*shape, dtype=np.float32, scale=1.0):
    return cupy.asarray((rng.standard_normal(shape) * scale).astype(dtype))

def host(tree):
    if isinstance(tree, (tuple, list)):
        return [host(t) for t in tree]
    if isinstance(tree, cupy.ndarray):
        return tree.get().astype(np.float64).ravel().tolist()
    return tree

def ops(dtype):
    x, w, b = dev(3, 5, 16, dtype=dtype), dev(16, dtype=dtype), dev(16, dtype=dtype)
    y, ln = F.layernorm_forward(x, w, b)
    yield "layernorm_forward", lambda: F.layernorm_forward(x, w, b)[0]
    yield "layernorm_backward", lambda: F.layernorm_backward(dev(3, 5, 16, dtype=dtype), ln)
    g = dev(4, 33, dtype=dtype, scale=3)
    gy, gc = F.gelu_forward(g)
    yield "gelu_forward", lambda: F.gelu_forward(g)
    yield "gelu_backward", lambda: F.gelu_backward(dev(4, 33, dtype=dtype), gc)
    yield "causal_softmax", lambda: A.causal_softmax(dev(2, 3, 4, 9, dtype=dtype, scale=4), 5)
    p = A.causal_softmax(dev(2, 3, 4, 9, dtype=dtype), 5)
    yield "softmax_backward", lambda: A.softmax_backward(dev(2, 3, 4, 9, dtype=dtype), p)
    z, t = dev(6, 11, dtype=dtype, scale=3), cupy.asarray(rng.integers(0, 11, 6))
    t[2] = -100
    yield "cross_entropy_rows", lambda: F._cross_entropy_rows(z, t, -100, 0.25)
    lse = F._cross_entropy_rows(z, t, -100, 0.25)[1]
    yield "cross_entropy_grad", lambda: F._cross_entropy_grad(z, lse, t, -100, 0.5)
    if dtype != np.float64:  # the batched GEMM, a transposed operand read as it is
        a, bt = dev(2, 3, 5, 40, dtype=dtype), dev(2, 3, 7, 40, dtype=dtype)
        yield "matmul", lambda: kernels.matmul(a, bt.swapaxes(-1, -2))
    if dtype in (np.float32, np.float64):  # the optimizer's state: the master dtype
        k = AdamCoefficients.of(dtype, 3, 1e-2, (0.9, 0.999), 1e-8, 0.1, True, 0.5)
        state = [dev(50, dtype=dtype) for _ in range(3)]
        yield "adam", lambda: (_adam_device(state[0], dev(50, dtype=dtype), state[1],
                                            cupy.abs(state[2]), k), state)[1]
        yield "sum_of_squares", lambda: Adam().sum_of_squares(dev(70, dtype=dtype), 0.5, dtype)
    dy = dev(9, 70, dtype=dtype, scale=2)
    yield "bias_grad", lambda: F._bias_grad(dy, None)
    yield "bias_grad_into", lambda: F._bias_grad(dy, cupy.zeros(70, dtype))
    y, rms = L.rmsnorm_forward(x, w, 1e-6)
    yield "rmsnorm_forward", lambda: L.rmsnorm_forward(x, w, 1e-6)
    yield "rmsnorm_backward", lambda: L.rmsnorm_backward(dev(3, 5, 16, dtype=dtype), rms)
    yield "rmsnorm_backward_into", lambda: L.rmsnorm_backward(dev(3, 5, 16, dtype=dtype), rms,
                                                              cupy.zeros(16, dtype))
    u = dev(4, 33, dtype=dtype)
    sy, sc = L.swiglu_forward(g, u)
    yield "swiglu_forward", lambda: L.swiglu_forward(g, u)
    yield "swiglu_backward", lambda: L.swiglu_backward(dev(4, 33, dtype=dtype), sc)
    # heads (B, n, T, hd) = (2, 3, 5, 8) as the transposed view of (B, T, n hd) GQA takes, and
    # back into such a view: read and written where they lie
    cos, sin = (cupy.asarray(t.astype(dtype))
                for t in L.rope_tables(L.rope_inv_freq(8), 5, 7))
    q = dev(2, 5, 24, dtype=dtype)
    yield "rope_forward", lambda: L.rope_forward(q.reshape(2, 5, 3, 8).transpose(0, 2, 1, 3),
                                                 cos, sin)
    merged = cupy.zeros((2, 5, 3, 8), dtype)
    yield "rope_backward", lambda: (L.rope_backward(dev(2, 3, 5, 8, dtype=dtype), cos, sin,
                                                    merged.transpose(0, 2, 1, 3)), merged)

# the stand-in's counters; a GPU counts nothing
LAUNCHES, CASTS = (cupy.LAUNCHES, cupy.CASTS) if getattr(cupy, "STANDIN", False) else ([0], [0])
out = {}
for dtype in (np.float32, np.float16, backend.BFLOAT16, np.float64):
    for mode in ("fused", "composed"):
        kernels.set_mode(mode)
        rng = np.random.default_rng(0)
        for name, run in ops(dtype):
            before, casts = LAUNCHES[0], CASTS[0]
            result = run()
            out[f"{np.dtype(dtype).name} {mode} {name}"] = [
                LAUNCHES[0] - before, CASTS[0] - casts, host(result)]
print(json.dumps(out))
"""

# launches of each fused op (LayerNorm backward: two kernels and the sum of the column sums'
# partials; sum of squares: a kernel and the sum of its partials), then the inputs made on the
# device by the test
FUSED_LAUNCHES = {"layernorm_forward": 1, "layernorm_backward": 3 + 1, "gelu_forward": 1,
                  "gelu_backward": 1 + 1, "causal_softmax": 1 + 1, "softmax_backward": 1 + 1,
                  "cross_entropy_rows": 1, "cross_entropy_grad": 1, "adam": 1 + 2,
                  "bias_grad": 1, "bias_grad_into": 1 + 1,
                  "sum_of_squares": 2 + 1, "matmul": 1, "rmsnorm_forward": 1,
                  "rmsnorm_backward": 3 + 1, "rmsnorm_backward_into": 3 + 2,
                  "swiglu_forward": 1, "swiglu_backward": 1 + 1, "rope_forward": 1,
                  "rope_backward": 1 + 1}


def test_fused_ops_equal_their_composed_twins_in_one_launch():
    """On the stand-in every fused op gives the composed path's bits (the twin is the same
    program) in one launch (the inputs the test makes on the device besides) and no cast,
    where the composed path takes several, in float32, float16, bfloat16 and float64; in
    float16 the composed path casts (CuPy's batched matmul computes float16 in float32), and
    a bfloat16 batched product is the GEMM in either mode (CuPy 14.2 has none)."""
    out = json.loads(subprocess.run([sys.executable, "-c", OPS], env=STANDIN, cwd=REPO_ROOT,
                                    capture_output=True, text=True, check=True).stdout)
    for key, (launches, casts, result) in out.items():
        dtype, mode, name = key.split()
        if mode == "composed":
            continue
        composed_launches, composed_casts, composed = out[f"{dtype} composed {name}"]
        assert result == composed, key
        assert (launches, casts) == (FUSED_LAUNCHES[name], 0), (key, launches, casts)
        # the bias gradient is one reduction composed too: its kernel reads coalesced
        assert composed_launches > launches or name.startswith("bias_grad") \
            or key == "bfloat16 fused matmul", key
    assert out["float16 composed matmul"][:2] == [4, 3]  # 2 casts in, the GEMM, 1 cast out
    assert out["bfloat16 composed matmul"][:2] == [1, 0]  # the GEMM


def test_the_switch_is_a_config_key():
    assert Config.from_dict({"kernels": "composed"}).kernels == "composed"
    with pytest.raises(ConfigError, match="kernels"):
        Config.from_dict({"kernels": "cuda"})
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.set_mode("fast")


def test_numpy_runs_the_twins_under_either_mode():
    """On NumPy arrays both modes run the twin: the same bits."""
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    try:
        kernels.set_mode("composed")
        composed = F.gelu_forward(x)[0]
    finally:
        kernels.set_mode("fused")
    np.testing.assert_array_equal(F.gelu_forward(x)[0], composed)


def test_tf32_is_refused_without_a_gpu():
    from zmpi import backend

    with pytest.raises(ConfigError, match="tf32"):
        backend.use_tf32()


def test_a_training_step_is_52_launches_a_layer_no_cast_and_one_sync():
    """experiments/bench_gpu.py --count on the stand-in, stages 0-3, fp32, fp16 and bf16,
    fused: at most 52 launches per transformer layer per step (forward, backward, its share of
    the update; one attention block), no dtype cast in a layer's fp32 step and at most 2 in
    its fp16 or bf16 step (16-bit activations end to end: casts only where a buffer changes
    dtype), bf16 no more than fp16, and one device -> host transfer per step (the loss with
    the gradients' norm). "composed" takes more than twice as many launches, and in fp16 and
    bf16 the casts of the twins' float32 arithmetic (and in fp16 CuPy's batched matmul's,
    float16 computed in float32: three a product), which the stand-in counts."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "bench_gpu.py"),
                          "--count", "--json", "--seq-len", "64"],
                         env={**STANDIN, "ZMPI_CUDA_AWARE": "1"}, cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True, timeout=600).stdout
    rows = json.loads(out.splitlines()[-1])
    assert len(rows) == 24
    # the launches outside the layers (embedding, head, loss, update) do not depend on T in
    # the fused step: the committed `make count-gpu` table (T 1024) holds them; a dense step
    # adding the MoE losses' 0 was one launch more in every row
    with open(REPO_ROOT / "results" / "gpu_counts" / "gpu.csv") as f:
        committed = {(r["kernels"], int(r["stage"]), r["precision"]): float(r["launches_outside"])
                     for r in csv.DictReader(f)}
    assert all(row["launches_outside"] == committed[row["kernels"], row["stage"],
                                                    row["precision"]]
               for row in rows if row["kernels"] == "fused"), rows
    for row in rows:
        assert row["syncs_per_step"] == row["syncs_per_step_more_layers"] == 1, row
        peers = {r["precision"]: r for r in rows
                 if (r["kernels"], r["stage"]) == (row["kernels"], row["stage"])}
        assert peers["bf16"]["casts_per_layer"] <= peers["fp16"]["casts_per_layer"], row
        if row["kernels"] == "composed":
            assert (row["casts_per_layer"] > 30) == (row["precision"] != "fp32"), row
            continue
        assert row["launches_per_layer"] <= 52, row
        assert row["casts_per_layer"] <= (0 if row["precision"] == "fp32" else 2), row
        composed = next(r for r in rows if r["kernels"] == "composed"
                        and (r["stage"], r["precision"]) == (row["stage"], row["precision"]))
        assert composed["launches_per_layer"] > 2 * row["launches_per_layer"], row


@pytest.mark.parametrize("dtype", [np.float32, np.float16, backend.BFLOAT16, np.float64])
def test_each_cuda_kernel_matches_its_twin(cuda_device, dtype):
    """Each CUDA launcher against its NumPy twin on the same inputs (float32 accumulation: 1e-5
    relative in fp32, two roundings of the output in fp16 and bf16), on a GPU and on the CPU
    (tests/cuda_cpu.py: the same kernels, compiled by g++); on a GPU, in fp16, bf16 and fp32,
    the batched GEMM (`kernels.matmul`, cuBLAS) against its twin."""
    cupy = cuda_device
    rng = np.random.default_rng(0)
    tol = {np.float16: 2e-3, backend.BFLOAT16: 1.6e-2, np.float32: 1e-5,
           np.float64: 1e-12}[dtype]

    def same(fused, twin):
        for a, b in zip(fused, twin, strict=True):  # lists of arrays (CuPy's, NumPy's)
            a = cupy.asnumpy(a).astype(np.float64)
            np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=tol, atol=tol)

    x = rng.standard_normal((6, 7, 40)).astype(dtype)
    w, b = rng.standard_normal(40).astype(dtype), rng.standard_normal(40).astype(dtype)
    y, cache = kernels.cuda_layernorm_forward(*map(cupy.asarray, (x, w, b)), 1e-5)
    ty, tcache = F._layernorm_forward_twin(x, w, b, 1e-5)
    same([y, cache[0], cache[1]], [ty, tcache[0], tcache[1]])
    dy = rng.standard_normal(x.shape).astype(dtype)
    same(kernels.cuda_layernorm_backward(cupy.asarray(dy), cache),
         F._layernorm_backward_twin(dy, tcache, None, None))
    y, cache = kernels.cuda_gelu_forward(cupy.asarray(x))
    ty, tcache = F._gelu_forward_twin(x)
    same([y, cache[1]], [ty, tcache[1]])
    same([kernels.cuda_gelu_backward(cupy.asarray(dy), cache)],
         [F._gelu_backward_twin(dy, tcache)])
    s = rng.standard_normal((2, 3, 5, 12)).astype(dtype) * 3
    p = kernels.cuda_causal_softmax(cupy.asarray(s), 7)
    same([p], [A._causal_softmax_twin(s.copy(), 7)])
    d = rng.standard_normal(s.shape).astype(dtype)
    same([kernels.cuda_softmax_backward(cupy.asarray(d), p)],
         [A._softmax_backward_twin(d, cupy.asnumpy(p))])
    z, t = rng.standard_normal((9, 50)).astype(dtype) * 3, rng.integers(0, 50, 9)
    t[4] = -1
    loss, lse = kernels.cuda_cross_entropy_rows(cupy.asarray(z), cupy.asarray(t), -1, 0.2)
    same([loss, lse], F._cross_entropy_rows_twin(z, t, -1, 0.2))
    same([kernels.cuda_cross_entropy_grad(cupy.asarray(z), lse, cupy.asarray(t), -1, 0.3)],
         [F._cross_entropy_grad_twin(z, cupy.asnumpy(lse), t, -1, 0.3)])
    for rows in (1, 7, 5000):  # the bias gradient: one row part to all of them, twice (the
        dy = rng.standard_normal((rows, 70)).astype(dtype)  # counters left at zero), into
        db = cupy.zeros(70, dtype)  # a gradient
        for _ in range(2):
            same([kernels.cuda_bias_grad(cupy.asarray(dy), None),
                  kernels.cuda_bias_grad(cupy.asarray(dy), db)],
                 [F._bias_grad_twin(dy, None)] * 2)
    for master in {np.float32, dtype} - {np.float16, backend.BFLOAT16}:  # master weights
        k = AdamCoefficients.of(master, 3, 1e-2, (0.9, 0.999), 1e-8, 0.1, True, 0.5)
        state = [rng.standard_normal(300).astype(master) for _ in range(3)]
        state[2] **= 2  # v >= 0
        grads = rng.standard_normal(300).astype(dtype)
        on_device = [cupy.asarray(a) for a in state]
        kernels.cuda_adam(on_device[0], cupy.asarray(grads), *on_device[1:], k)
        _adam_twin(state[0], grads, state[1], state[2], k)
        same(on_device, state)
        same([kernels.cuda_sum_of_squares(cupy.asarray(grads), 0.5, np.dtype(master))],
             [_sum_of_squares_twin(grads, 0.5, np.dtype(master))])
    if dtype != np.float64 and cupy is not cuda_cpu.DEVICE:  # cuBLAS through strides: a
        # transposed and a sliced operand, and into a slice of rows
        a = rng.standard_normal((2, 3, 9, 40)).astype(dtype)
        bt = rng.standard_normal((2, 3, 11, 40)).astype(dtype)
        y = cupy.zeros((2, 3, 20, 11), dtype)
        kernels.matmul(cupy.asarray(a)[:, :, 2:7], cupy.asarray(bt).swapaxes(-1, -2),
                       out=y[:, :, 4:9])
        want = np.zeros(y.shape, dtype)
        want[:, :, 4:9] = kernels._matmul_twin(a[:, :, 2:7], bt.swapaxes(-1, -2), None)
        same([y], [want])


@pytest.mark.parametrize("master", [np.float32, np.float64])
def test_adam_without_contraction_gives_the_twins_bits(cuda_device, monkeypatch, master):
    """--fmad=false, the test-only option (zmpi.kernels.source.compile_options): Adam's update
    is products, sums, a quotient and a square root, each rounded once on a GPU as in NumPy, so
    compiled without multiply-add contraction the kernel gives the twin's bits exactly (bf16
    gradients, a float32 or float64 master); the production module, contracted, agrees within
    rounding (test_each_cuda_kernel_matches_its_twin)."""
    cupy = cuda_device
    rng = np.random.default_rng(1)
    monkeypatch.setattr(kernels, "compile_options",
                        functools.partial(source.compile_options, fmad=False))
    caches = (kernels._function, kernels._modules)
    for cache in caches:
        cache.cache_clear()
    try:
        k = AdamCoefficients.of(master, 3, 1e-2, (0.9, 0.999), 1e-8, 0.1, True, 0.5)
        state = [rng.standard_normal(1000).astype(master) for _ in range(3)]
        state[2] **= 2  # v >= 0
        grads = rng.standard_normal(1000).astype(backend.BFLOAT16)
        on_device = [cupy.asarray(a) for a in state]
        kernels.cuda_adam(on_device[0], cupy.asarray(grads), *on_device[1:], k)
        _adam_twin(state[0], grads, state[1], state[2], k)
        for got, want in zip(on_device, state, strict=True):
            np.testing.assert_array_equal(cupy.asnumpy(got), want)
    finally:
        for cache in caches:  # the production options' modules again
            cache.cache_clear()


def _gpu():
    """CuPy on a CUDA device, or a skip."""
    cupy = pytest.importorskip("cupy")
    if getattr(cupy, "STANDIN", False) or cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("needs a CUDA device")
    return cupy


def _leaves(tree):
    """The arrays (lists of numbers) of a result as OPS prints it (nested for tuples)."""
    if isinstance(tree, list) and tree and isinstance(tree[0], list):
        for t in tree:
            yield from _leaves(t)
    else:
        yield tree


@pytest.mark.gpu
def test_fused_ops_match_their_composed_twins_on_a_gpu():
    """On a GPU (CuPy >= 14 for bf16): every fused op of OPS (its CUDA kernels) against the
    composed path (its twin's array operations on the device), in float32, float16, bfloat16
    and float64, within two roundings of the output dtype (float32 accumulation: 1e-5 in
    fp32)."""
    _gpu()
    out = json.loads(subprocess.run([sys.executable, "-c", OPS],
                                    env=child_env(ZMPI_BACKEND="cupy"), cwd=REPO_ROOT,
                                    capture_output=True, text=True, check=True).stdout)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}
    for key, (_, _, result) in out.items():
        dtype, mode, name = key.split()
        if mode == "composed":
            continue
        composed = out[f"{dtype} composed {name}"][2]
        for a, b in zip(_leaves(result), _leaves(composed), strict=True):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                       rtol=tol[dtype], atol=tol[dtype], err_msg=key)


@pytest.mark.gpu
def test_bf16_gemm_accumulates_in_fp32():
    """kernels.matmul in bf16 on a GPU (cuBLAS, CUDA_R_16BF, CUBLAS_COMPUTE_32F), a transposed
    operand read as it is: the fp32 product of the same bf16 values, rounded once to bf16
    (within 2^-8 of it), over K = 4096, where sums kept in bf16 would be far off."""
    cupy = _gpu()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 40, 4096)).astype(backend.BFLOAT16)
    bt = rng.standard_normal((3, 24, 4096)).astype(backend.BFLOAT16)
    c = kernels.matmul(cupy.asarray(a), cupy.asarray(bt).swapaxes(-1, -2))
    assert c.dtype == backend.BFLOAT16 and c.shape == (3, 40, 24)
    want = np.matmul(a.astype(np.float32), bt.astype(np.float32).swapaxes(-1, -2))
    np.testing.assert_allclose(cupy.asnumpy(c).astype(np.float32), want, rtol=2**-8,
                               atol=1e-3)

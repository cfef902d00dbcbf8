"""Fused flash attention (zmpi.kernels.flash_attention, docs/gpu.md "Fused flash attention"): its
NumPy twin against zmpi's dense and block-sparse attention and a float64 masked-dense reference,
and by float64 finite differences; the CUDA kernels themselves run on the CPU (tests/cuda_cpu.py:
compiled by g++, each launch's arguments checked against the kernels' signatures) against the
twin, at several tile sizes; their source compiled by NVRTC for every dtype; the config key; a
GPT trained on the CuPy stand-in with and without it (same losses, launches per layer); and, on a
GPU, each CUDA launcher against its twin and a GPT step with and without flash.
"""
import json
import subprocess
import sys

import cuda_cpu
import numpy as np
import pytest
from gradcheck import check
from mpi_util import CLI, REPO_ROOT, STANDIN, child_env
from test_kernels_compile import ARCHITECTURES, _compile, toolchain  # noqa: F401
from test_sparse_attention import masked_attention, random_layout

from zmpi import backend, kernels
from zmpi.config import Config, ConfigError
from zmpi.kernels import flash_attention as FA
from zmpi.nn import attention as A
from zmpi.nn import sparse_attention as S
from zmpi.nn.sparsity import causal_layout, sparsity_from_dict

SPARSE_MODES = [
    {"mode": "fixed", "block": 8, "num_local_blocks": 2, "num_global_blocks": 1,
     "different_layout_per_head": True, "num_different_global_patterns": 2},
    {"mode": "bigbird", "block": 8, "num_random_blocks": 1, "different_layout_per_head": True},
    {"mode": "bslongformer", "block": 16},
    {"mode": "variable", "block": 8, "local_window_blocks": [2, 3]},
    {"mode": "local", "block": 4, "num_sliding_window_blocks": 3},
]


@pytest.fixture
def rng():
    return np.random.default_rng(48)


@pytest.mark.parametrize("B, n_head, T, hd", [(2, 3, 70, 8), (1, 2, 128, 16), (1, 1, 5, 4),
                                               (2, 2, 1, 4), (1, 2, 64, 6)])
def test_dense_twin_equals_attention_and_the_masked_reference(rng, B, n_head, T, hd):
    """Dense causal (a ragged last block of FLASH_BLOCK when T is not a multiple of it): y and
    dqkv equal zmpi.nn.attention's and plain float64 softmax attention's to round-off."""
    qkv = rng.standard_normal((B, T, 3 * n_head * hd))
    dy = rng.standard_normal((B, T, n_head * hd))
    y, cache = FA.flash_attention_forward(qkv, n_head)
    dqkv = FA.flash_attention_backward(dy, cache)
    y_ref, dqkv_ref = masked_attention(qkv, n_head, np.ones((n_head, T, T)), 1, True, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dqkv, dqkv_ref, rtol=1e-11, atol=1e-13)
    y_a, cache_a = A.attention_forward(qkv, n_head)
    np.testing.assert_allclose(y, y_a, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dqkv, A.attention_backward(dy, cache_a), rtol=1e-11, atol=1e-13)
    assert cache.lse.shape == (B, n_head, T) and y.dtype == dqkv.dtype == np.float64


@pytest.mark.parametrize("n_head, T, block", [(3, 32, 4), (2, 48, 8), (1, 12, 1), (4, 64, 16)])
def test_sparse_twin_equals_the_masked_reference(rng, n_head, T, block):
    """Random layouts (blocks above the diagonal too, rows without their diagonal block): the
    masked float64 reference and zmpi.nn.sparse_attention, to round-off."""
    hd = 4
    qkv = rng.standard_normal((2, T, 3 * n_head * hd))
    dy = rng.standard_normal((2, T, n_head * hd))
    layout = causal_layout(random_layout(rng, n_head, T // block))
    y, cache = FA.flash_attention_forward(qkv, n_head, layout, block)
    dqkv = FA.flash_attention_backward(dy, cache)
    y_ref, dqkv_ref = masked_attention(qkv, n_head, layout, block, True, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dqkv, dqkv_ref, rtol=1e-11, atol=1e-13)
    y_s, cache_s = S.sparse_attention_forward(qkv, n_head, layout, block)
    np.testing.assert_allclose(y, y_s, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dqkv, S.sparse_attention_backward(dy, cache_s), rtol=1e-11,
                               atol=1e-13)


@pytest.mark.parametrize("section", SPARSE_MODES, ids=lambda s: s["mode"])
def test_deepspeed_layouts_equal_sparse_attention(rng, section):
    n_head, T, hd = 4, 64, 8
    layout = causal_layout(sparsity_from_dict(section, n_head).make_layout(T))
    qkv = rng.standard_normal((2, T, 3 * n_head * hd)).astype(np.float32)
    dy = rng.standard_normal((2, T, n_head * hd)).astype(np.float32)
    y, cache = FA.flash_attention_forward(qkv, n_head, layout, section["block"])
    y_s, cache_s = S.sparse_attention_forward(qkv, n_head, layout, section["block"])
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, y_s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(FA.flash_attention_backward(dy, cache),
                               S.sparse_attention_backward(dy, cache_s), rtol=1e-4, atol=1e-5)


def test_float16_is_accumulated_in_float32(rng):
    """fp16 in and out, fp32 inside: within fp16's output rounding of the float64 result."""
    n_head, T, hd = 2, 40, 8
    qkv = (rng.standard_normal((2, T, 3 * n_head * hd)) * 4).astype(np.float16)
    dy = rng.standard_normal((2, T, n_head * hd)).astype(np.float16)
    y, cache = FA.flash_attention_forward(qkv, n_head)
    dqkv = FA.flash_attention_backward(dy, cache)
    assert y.dtype == dqkv.dtype == np.float16 and cache.lse.dtype == np.float32
    q64, dy64 = qkv.astype(np.float64), dy.astype(np.float64)
    y_ref, dqkv_ref = masked_attention(q64, n_head, np.ones((n_head, T, T)), 1, True, dy64)
    np.testing.assert_allclose(y.astype(np.float64), y_ref, rtol=0, atol=4e-3)
    scale = np.abs(dqkv_ref).max()
    np.testing.assert_allclose(dqkv.astype(np.float64) / scale, dqkv_ref / scale, atol=4e-3)


@pytest.mark.parametrize("sparse", [False, True])
def test_finite_differences(rng, sparse):
    n_head, T, hd, block = 2, 12, 3, 3
    layout = causal_layout(random_layout(rng, n_head, T // block)) if sparse else None
    args = (layout, block) if sparse else ()
    qkv = rng.standard_normal((2, T, 3 * n_head * hd))
    dy = rng.standard_normal((2, T, n_head * hd))
    dqkv = FA.flash_attention_backward(dy, FA.flash_attention_forward(qkv, n_head, *args)[1])

    def f():
        return float((FA.flash_attention_forward(qkv, n_head, *args)[0] * dy).sum())

    check(f, qkv, dqkv, rng, "qkv")


def test_a_key_block_no_query_keeps_gets_zero_gradients(rng):
    layout = np.tri(4, dtype=bool)[None].copy()
    layout[0, 2:, 1] = False  # key block 1: only its own row keeps it
    layout[0, 1, 1] = False
    layout[0, 1, 0] = True
    qkv = rng.standard_normal((1, 16, 12))
    y, cache = FA.flash_attention_forward(qkv, 1, layout, 4)
    dqkv = FA.flash_attention_backward(rng.standard_normal(y.shape), cache)
    assert (dqkv[0, 4:8, 4:] == 0).all() and (dqkv[0, 8:, 4:] != 0).all()


def test_layouts_as_csr():
    kept = np.array([[[1, 0, 0], [1, 1, 0], [0, 1, 1]], [[1, 0, 0], [0, 1, 0], [1, 0, 1]]], bool)
    layout = FA.sparse_layout(kept, 4)
    assert layout.row_ptr.tolist() == [[0, 1, 3, 5], [5, 6, 7, 9]]
    assert layout.cols.tolist() == [0, 0, 1, 1, 2, 0, 1, 0, 2]
    assert layout.col_ptr.tolist() == [[0, 2, 4, 5], [5, 7, 8, 9]]
    assert layout.rows.tolist() == [0, 1, 1, 2, 2, 0, 2, 1, 2]
    assert [layout.keys(1, i).tolist() for i in range(3)] == [[0], [1], [0, 2]]
    assert FA.sparse_layout(kept.copy(), 4) is layout  # made once per layout
    dense = FA.dense_layout(130)
    assert (dense.heads, dense.nb, dense.block) == (1, 3, FA.FLASH_BLOCK)
    assert dense.cols.tolist() == [0, 0, 1, 0, 1, 2]


def test_bad_shapes_are_refused(rng):
    qkv = rng.standard_normal((1, 30, 12))
    with pytest.raises(ValueError, match="sequence length 30"):
        FA.flash_attention_forward(qkv, 2, np.ones((2, 3, 3), bool), 8)
    with pytest.raises(ValueError, match="3 heads for n_head 2"):
        FA.flash_attention_forward(qkv[:, :24], 2, np.tri(3, dtype=bool)[None].repeat(3, 0), 8)


@pytest.mark.parametrize("kernel", ["flash_forward", "flash_backward_dq", "flash_backward_dkv"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("limit", [FA.SHARED_BYTES, cuda_cpu.SHARED_OPTIN["90"]],
                         ids=["48KiB", "opt-in-sm90"])
def test_tiles_fit_shared_memory_and_divide_the_block(kernel, dtype, limit):
    """The largest tile that divides the block and fits the limit, on tensor cores too."""
    acc = kernels.acc_dtype(dtype)
    for tc in (False, True) if dtype == np.float16 else (False,):
        for block in (16, 64, 128) if tc else (1, 4, 12, 16, 64, 128):
            for hd in (16, 64, 128) if tc else (4, 64, 128):
                s = FA._tile_rows(kernel, block, hd, acc, tc, limit)
                if s is None:  # not even the smallest tile fits: tensor_cores says no
                    assert tc and FA._shared_bytes(kernel, 16, hd, acc, tc) > limit
                    continue
                assert block % s == 0 and FA._shared_bytes(kernel, s, hd, acc, tc) <= limit
                assert s == block or s == 64 or block % (2 * s) or \
                    FA._shared_bytes(kernel, 2 * s, hd, acc, tc) > limit
    with pytest.raises(ValueError, match=f"heads of size 50000 .* in {limit} bytes"):
        FA.tile_rows(kernel, 16, 50000, acc, False, limit)


# -- the CUDA kernels: on the CPU (tests/cuda_cpu.py), their source through NVRTC --------------

@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("sparse, T, s", [(False, 70, 32), (False, 70, 16), (False, 9, 64),
                                          (True, 32, 4), (True, 32, 2), (True, 32, 8)])
def test_the_kernels_equal_the_twin_at_every_tile_size(rng, monkeypatch, cuda_device, dtype,
                                                       sparse, T, s):
    """flash.cu's kernels through their launchers at tile rows s (s / 2 for the keys'
    backward), on the CPU and on a GPU: several tiles a block, a ragged last block, heads with
    their own layouts. The twin's y, lse and dqkv, to round-off (float64) or fp16's output
    rounding, every element written."""
    dev, n_head, hd, block = cuda_device, 2, 5, 8
    monkeypatch.setattr(FA, "tile_rows", lambda kernel, *_: (
        max(1, s // 2) if kernel == "flash_backward_dkv" else s))
    layout = (FA.sparse_layout(causal_layout(random_layout(rng, n_head, T // block)), block)
              if sparse else FA.dense_layout(T))
    _kernels_equal_the_twin(rng, dev, layout, T, n_head, hd, dtype,
                            1e-12 if dtype == np.float64 else 2e-3)


def _kernels_equal_the_twin(rng, dev, layout, T, n_head, hd, dtype, tol, n_kv_head=None):
    """The launchers on `dev` against the twin on random qkv and dy (B 2, T positions; n_kv_head
    key/value heads, n_head if None): y, lse and dqkv within tol, every element written;
    returns qkv."""
    nkv = n_head if n_kv_head is None else n_kv_head
    qkv = rng.standard_normal((2, T, (n_head + 2 * nkv) * hd)).astype(dtype)
    dy = rng.standard_normal((2, T, n_head * hd)).astype(dtype)
    y, lse = FA._forward_twin(qkv, layout, n_head, nkv)
    dqkv = FA._backward_twin(dy, qkv, y, lse, layout, n_head, nkv)
    y_k, lse_k = FA.cuda_flash_forward(dev.asarray(qkv), layout, n_head, nkv)
    dqkv_k = FA.cuda_flash_backward(dev.asarray(dy), dev.asarray(qkv), y_k, lse_k, layout,
                                    n_head, nkv)
    for got, want in ((y_k, y), (lse_k, lse), (dqkv_k, dqkv)):
        got = dev.asnumpy(got).astype(np.float64)
        assert np.isfinite(got).all()  # every element written
        np.testing.assert_allclose(got, want.astype(np.float64), rtol=tol, atol=tol)
    return qkv


@pytest.mark.parametrize("dtype", [np.float16, backend.BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("sparse, T, hd, s", [(False, 70, 16, 64), (False, 70, 32, 32),
                                              (False, 40, 16, 16), (True, 64, 16, 16),
                                              (True, 96, 32, 16)])
def test_the_tensor_core_kernels_equal_the_twin(rng, monkeypatch, cuda_device, dtype, sparse, T,
                                                hd, s):
    """flash_tc.cu (16-bit arrays, heads and block multiples of 16, compute capability 8.0
    or later) through the launchers at tile rows s (one warp per 16 rows) where the kernel's
    tiles fit 48 KiB of shared memory, at the launcher's own rows otherwise: dense with a ragged
    last block, random per-head layouts at block 16 (blocks no query keeps: zero gradients).
    The twin's y, lse and dqkv within the 16-bit type's rounding (p and ds are rounded to it
    before their products); on the CPU, below compute capability 8.0, the SIMT kernels run."""
    dev, n_head = cuda_device, 2
    launched = []
    function = FA._function
    monkeypatch.setattr(FA, "_function", lambda name, *types: launched.append(name) or
                        function(name, *types))
    rows = FA.tile_rows

    def tile_rows(kernel, block, hd, acc, tc=False, limit=FA.SHARED_BYTES):
        fits = FA._shared_bytes(kernel, s, hd, acc, tc) <= limit
        return s if fits else rows(kernel, block, hd, acc, tc, limit)

    monkeypatch.setattr(FA, "tile_rows", tile_rows)
    layout = (FA.sparse_layout(causal_layout(random_layout(rng, n_head, T // 16)), 16)
              if sparse else FA.dense_layout(T))
    qkv = _kernels_equal_the_twin(rng, dev, layout, T, n_head, hd, dtype,
                                  4e-3 if dtype == np.float16 else 3e-2)
    assert set(launched) == {"flash_tc_forward", "flash_tc_backward_dq", "flash_tc_backward_dkv"}
    if dev is cuda_cpu.DEVICE:  # and before Ampere, the SIMT kernels
        monkeypatch.setattr(dev, "compute_capability", "75")
        launched.clear()
        FA.cuda_flash_forward(dev.asarray(qkv), layout, n_head, n_head)
        assert launched == ["flash_forward"]


def test_the_launcher_opts_in_to_its_tiles_shared_memory(rng, cuda_device):
    """Tiles past 48 KiB launch: the launcher raises the kernel's max_dynamic_shared_size_bytes
    first (the CPU executor, as CUDA, refuses the launch otherwise). hd 64 in fp32: the
    forward's 64-row tiles take 82 KiB."""
    qkv, layout = rng.standard_normal((1, 64, 3 * 64)).astype(np.float32), FA.dense_layout(64)
    y, _ = FA.cuda_flash_forward(cuda_device.asarray(qkv), layout, 1, 1)
    need = FA._shared_bytes("flash_forward", 64, 64, np.float32)
    assert need > FA.SHARED_BYTES
    assert FA._function("flash_forward", "float", "float").max_dynamic_shared_size_bytes >= need
    want, _ = FA._forward_twin(qkv, layout, 1, 1)
    np.testing.assert_allclose(cuda_device.asnumpy(y), want, rtol=1e-5, atol=1e-5)


PIPELINE_SOURCE = r"""
#include <cuda_pipeline_primitives.h>
// thread 0 copies src (4 floats) into shared memory asynchronously, and 16 zero-filled bytes
// after them: what the tile holds before the wait, and after it
extern "C" __global__ void copy_late(const float* src, float* before, float* after) {
    __shared__ __align__(16) float tile[8];
    if (threadIdx.x == 0) {
        for (int i = 0; i < 8; ++i) tile[i] = -1.0f;
        __pipeline_memcpy_async(tile, src, 16);
        __pipeline_memcpy_async(tile + 4, src, 16, 16);
        __pipeline_commit();
        for (int i = 0; i < 8; ++i) before[i] = tile[i];
        __pipeline_wait_prior(0);
        for (int i = 0; i < 8; ++i) after[i] = tile[i];
    }
}
"""


def test_the_executors_async_copies_land_at_the_wait():
    """tests/cuda_cpu_include/cuda_pipeline_primitives.h: a copy is made when its thread waits
    for it, not before (the latest CUDA allows), so a kernel that reads early reads stale data;
    zero-fill as cp.async's."""
    kernel = cuda_cpu.RawModule(code=PIPELINE_SOURCE).get_function("copy_late")
    src = np.arange(1, 5, dtype=np.float32)
    before, after = np.zeros(8, np.float32), np.zeros(8, np.float32)
    kernel((1,), (32,), (src, before, after))
    np.testing.assert_array_equal(before, -1)
    np.testing.assert_array_equal(after, [1, 2, 3, 4, 0, 0, 0, 0])


BANKS_SOURCE = r"""
// words[step][lane]: the 32-bit word of a scores row (ld floats) and of a p row (S + 8 halves)
// that softmax lane `lane` touches at its step, as flash_tc.cu's loops index them
extern "C" __global__ void zmpi_softmax_words(int* scores, int* probs, const int S,
                                              const int ld) {
    const int lane = threadIdx.x & 31, row = lane >> 1;
    for (int j = lane & 1, step = 0; j < S; j += 2, ++step) {
        const int c = tc_column(j, lane, S);
        scores[step * 32 + lane] = row * ld + c;
        probs[step * 32 + lane] = (row * (S + 8) + c) / 2;
    }
}
"""


@pytest.mark.parametrize("S", [16, 32, 64])
def test_the_tensor_core_softmax_has_no_bank_conflicts(S):
    """At every step of the softmax loops a warp's 32 lanes read 32 words of the scores in 32
    different banks, and write p (or ds) in words of which no two share a bank (two lanes may
    share a word), for every head size (flash_tc.cu's tc_column, run on the CPU)."""
    code = kernels.module_source(FA.families(True)) + BANKS_SOURCE
    module = cuda_cpu.RawModule(code=code, options=("-DZMPI_T=__half", "-DZMPI_ACC=float"))
    for hd in range(16, 129, 16):
        scores, probs = (np.zeros((S // 2, 32), np.int32) for _ in range(2))
        module.get_function("zmpi_softmax_words")((1,), (32,), (scores, probs, np.int32(S),
                                                                np.int32(max(S, hd) + 4)))
        for step in range(S // 2):
            assert len(set(scores[step] % 32)) == 32, (hd, step, scores[step])
            words = set(probs[step])
            assert len({w % 32 for w in words}) == len(words), (hd, step, probs[step])


def test_tensor_cores_only_where_they_apply(monkeypatch):
    """16-bit arrays, hd and block multiples of 16, tiles that fit the device's opt-in shared
    memory, compute capability >= 8.0; the tiles at the device's size."""
    monkeypatch.setattr(backend, "xp", cuda_cpu.DEVICE)  # compute capability 9.0: 227 KiB
    assert FA.shared_limit() == 227 << 10
    assert FA.tensor_cores(np.float16, 64, 64) and FA.tensor_cores(backend.BFLOAT16, 112, 16)
    assert FA.tensor_cores(np.float16, 128, 64)  # dk/dv's tiles pass 48 KiB: opted in to
    assert not FA.tensor_cores(np.float32, 64, 64)  # fp32: SIMT (no fp32 MMA here)
    assert not FA.tensor_cores(np.float16, 40, 64)  # hd not a multiple of 16
    assert not FA.tensor_cores(np.float16, 64, 8)  # block 8: a tile is 16 rows at least
    assert not FA.tensor_cores(np.float16, 1024, 64)  # 16-row tiles pass even 227 KiB
    limit = FA.shared_limit()  # 64-row tiles, 4 warps a block (dk/dv at hd 128: 32 rows)
    for kernel in ("flash_forward", "flash_backward_dq", "flash_backward_dkv"):
        assert FA.tile_rows(kernel, 64, 64, np.float32, True, limit) == 64
        assert FA.tile_rows(kernel, 64, 128, np.float32, True, limit) == (
            32 if kernel == "flash_backward_dkv" else 64)
    assert FA.tile_rows("flash_forward", 64, 64, np.float32, False, limit) == 64  # 82 KiB
    assert FA.tile_rows("flash_forward", 64, 64, np.float32, True) == 32  # within 48 KiB
    assert FA.tile_rows("flash_backward_dkv", 64, 64, np.float32, True) == 16
    monkeypatch.setattr(cuda_cpu.DEVICE, "compute_capability", "80")  # A100: 163 KiB
    assert FA.tensor_cores(np.float16, 128, 64)
    assert FA.tile_rows("flash_backward_dkv", 64, 128, np.float32, True,
                        FA.shared_limit()) == 32
    monkeypatch.setattr(cuda_cpu.DEVICE, "compute_capability", "70")
    assert not FA.tensor_cores(np.float16, 64, 64)


# (T, ACC, with the tensor-core kernels): their modules as zmpi.kernels.flash_attention compiles
# them
OPTION_SETS = [("__half", "float", False), ("__nv_bfloat16", "float", False),
               ("float", "float", False), ("double", "double", False), ("__half", "float", True),
               ("__nv_bfloat16", "float", True)]


@pytest.mark.parametrize("arch_index", [0, 1], ids=["oldest", "hopper"])
@pytest.mark.parametrize("t, acc, tc", OPTION_SETS)
def test_flash_source_compiles_without_warnings(toolchain, t, acc, tc, arch_index):  # noqa: F811
    """The flash modules (flash.cu after the fused ops', and flash_tc.cu for 16-bit T, its
    kernels compiled out before sm_80) in each wheel layout with CuPy's include directory and
    zmpi's options alone: <mma.h> finds crt/mma.h through the directory compile_options adds."""
    arch = ARCHITECTURES[toolchain.name][arch_index]
    code = kernels.module_source(FA.families(tc))
    ok, log = _compile(toolchain, code, t, acc, arch)
    assert ok, f"{toolchain.name}, T={t}, ACC={acc}, {arch}:\n{log}"
    assert log == "", f"{toolchain.name}, T={t}, ACC={acc}, {arch}: NVRTC warns:\n{log}"


@pytest.mark.gpu
@pytest.mark.parametrize("t", ["__half", "__nv_bfloat16"])
def test_the_tensor_core_module_compiles_on_the_device(t):
    """On a GPU of compute capability 8.0 or later the tensor-core module must compile through
    CuPy as zmpi asks it to: a failure here, where `tensor_cores` would only warn and run the
    SIMT kernels."""
    cupy = pytest.importorskip("cupy")
    if getattr(cupy, "STANDIN", False) or cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("needs a CUDA device")
    if int(cupy.cuda.Device().compute_capability) < 80:
        pytest.skip("the tensor-core kernels need compute capability 8.0")
    assert backend.xp is cupy, "run with ZMPI_BACKEND=cupy"
    for kernel in ("flash_tc_forward", "flash_tc_backward_dq", "flash_tc_backward_dkv"):
        FA._function(kernel, t, "float")  # CuPy's CompileException, if it does not
    assert FA._tensor_core_module_builds(t)


# -- the config key and the GPT on the stand-in -------------------------------------------------

def test_the_config_key():
    assert Config.from_dict({}).attention_kernel == "blocked"
    assert Config.from_dict({"attention_kernel": "flash"}).attention_kernel == "flash"
    with pytest.raises(ConfigError, match="attention_kernel.*'fast'"):
        Config.from_dict({"attention_kernel": "fast"})
    with pytest.raises(ConfigError, match="attention_kernel.*composed"):
        Config.from_dict({"attention_kernel": "flash", "kernels": "composed"})
    with pytest.raises(ConfigError, match="attention_kernel.*NumPy"):
        FA.set_kernel("flash")  # this process computes with NumPy
    FA.set_kernel("blocked")


def test_zmpi_train_on_numpy_refuses_flash_in_one_line(tmp_path):
    config = tmp_path / "flash.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "attention_kernel": "flash"}))
    run = subprocess.run([sys.executable, str(CLI), "train", "--config", str(config), "--steps",
                          "1", "--out", str(tmp_path / "run")],
                         env=child_env(ZMPI_BACKEND="numpy"), cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout)
    assert run.stderr.count("\n") == 1 and "attention_kernel" in run.stderr
    assert "NumPy" in run.stderr, run.stderr


STANDIN_GPT = """
import json, sys
sys.path[:0] = ["tests/ranks", "tests"]
import cupy, numpy as np
from zero_checks import config
from zmpi.kernels import flash_attention as FA
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

comm, out = Comm(), {}
count = getattr(cupy, "LAUNCHES", [0])  # the stand-in's; nothing on a GPU
layers = [int(n) for n in sys.argv[1:]] or [1, 2]  # one and two: launches per layer
SPARSE = {"mode": "fixed", "block": 4, "num_local_blocks": 2, "attention": "unidirectional",
          "different_layout_per_head": True, "num_different_global_patterns": 2}
for name, sparse, T in (("dense", None, 20), ("sparse", SPARSE, 16)):
    for dtype in ("fp32", "fp16"):
        for kernel in ("blocked", "flash"):
            launches = {}
            for n_layer in layers:
                cfg = GPTConfig(vocab_size=16, seq_len=T, n_layer=n_layer, n_head=2, d_model=16)
                section = {"sparse_attention": sparse} if sparse else {}
                engine = Engine(GPT(cfg, seed=0, sparse_attention=sparse),
                                {**config(0, dtype), "attention_kernel": kernel, **section}, comm)
                data = SyntheticSource(16, T, 12, 0, 1, seed=1)
                losses = [engine.train_step(*data.sample(0))]
                before = count[0]
                losses += [engine.train_step(*data.sample(s)) for s in (1, 2)]
                launches[n_layer] = (count[0] - before) / 2
            out[f"{name} {dtype} {kernel}"] = [losses, launches[2] - launches.get(1, 0)]
qkv = cupy.asarray(np.random.default_rng(0).standard_normal((2, 20, 24)).astype(np.float32))
FA.set_kernel("flash")
before = count[0]
y, cache = FA.flash_attention_forward(qkv, 2)
forward = count[0] - before
FA.flash_attention_backward(y, cache)
out["core"] = [forward, count[0] - before - forward]
print(json.dumps(out))
"""


def test_a_gpt_trains_alike_with_flash_on_the_standin():
    """A GPT (dense with a ragged block, and DeepSpeed's fixed layout), fp32 and fp16, trains
    on the CuPy stand-in to the blocked path's losses with "attention_kernel": "flash" (fp32
    to 1e-6, fp16 to 1e-4: the blocked path rounds its products to fp16), its attention core
    one launch forward and two backward, so fewer launches a layer (measured here: 37 against
    the blocked path's 48-52 dense and 175-221 sparse)."""
    out = json.loads(subprocess.run([sys.executable, "-c", STANDIN_GPT], env=STANDIN,
                                    cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                                    timeout=300).stdout)
    assert out.pop("core") == [1, 2]
    for key, (losses, per_layer) in out.items():
        name, dtype, kernel = key.split()
        if kernel == "blocked":
            continue
        blocked, blocked_per_layer = out[f"{name} {dtype} blocked"]
        np.testing.assert_allclose(losses, blocked, rtol=1e-6 if dtype == "fp32" else 1e-4)
        assert per_layer < blocked_per_layer, (key, per_layer, blocked_per_layer)


def test_the_bench_runs_at_a_toy_size(tmp_path):
    """experiments/bench_flash_attention.py --tiny on the stand-in: every row (the attention
    core blocked and flash, dense and sparse, and a GPT step each way) runs and is recorded;
    the stand-in's times are no figures."""
    subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "bench_flash_attention.py"),
                    "--tiny", "--out", str(tmp_path)], env=STANDIN, cwd=REPO_ROOT, check=True,
                   capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["case"], r["path"]) for r in rows] == [
        ("attention core dense", "blocked"), ("attention core dense", "flash"),
        ("attention core fixed", "blocked"), ("attention core fixed", "flash"),
        ("GPT step", "blocked"), ("GPT step", "flash")]
    assert all(r["seconds"] > 0 for r in rows)


# -- on a GPU ---------------------------------------------------------------------------------

def _cupy_on_a_gpu():
    cupy = pytest.importorskip("cupy")
    if getattr(cupy, "STANDIN", False) or cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("needs a CUDA device")
    return cupy


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_each_cuda_launcher_matches_its_twin(cuda_device, dtype):
    """Flash forward (y, lse) and backward (dqkv) against the twin, on a GPU and on the CPU
    (tests/cuda_cpu.py), dense (T 200: a ragged last block; hd 64) and DeepSpeed's fixed layout
    (block 16, heads' own layouts): 1e-5 relative in fp32, fp16's output rounding in fp16."""
    cupy = cuda_device
    rng = np.random.default_rng(0)
    tol = {np.float16: 4e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    n_head, hd = 4, 64
    fixed = sparsity_from_dict({"mode": "fixed", "block": 16, "different_layout_per_head": True,
                                "num_different_global_patterns": 4}, n_head)
    for T, layout in ((200, None), (256, FA.sparse_layout(causal_layout(
            fixed.make_layout(256)), 16))):
        layout = layout or FA.dense_layout(T)
        qkv = rng.standard_normal((2, T, 3 * n_head * hd)).astype(dtype)
        dy = rng.standard_normal((2, T, n_head * hd)).astype(dtype)
        y, lse = FA.cuda_flash_forward(cupy.asarray(qkv), layout, n_head, n_head)
        ty, tlse = FA._forward_twin(qkv, layout, n_head, n_head)
        dqkv = FA.cuda_flash_backward(cupy.asarray(dy), cupy.asarray(qkv), y, lse, layout,
                                      n_head, n_head)
        tdqkv = FA._backward_twin(dy, qkv, ty, tlse, layout, n_head, n_head)
        for got, want in ((y, ty), (lse, tlse), (dqkv, tdqkv)):
            np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64),
                                       want.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_a_gpt_step_with_flash_equals_without_on_a_gpu():
    """On a GPU: the stand-in test's GPT losses over three steps, dense and fixed-sparse, with
    and without "attention_kernel": "flash": fp32 to 1e-5, fp16 to 1e-3 (the blocked path's
    products in fp16); and its attention core in one launch and two."""
    _cupy_on_a_gpu()
    out = json.loads(subprocess.run([sys.executable, "-c", STANDIN_GPT, "2"],
                                    env=child_env(ZMPI_BACKEND="cupy",
                                                  PYTHONPATH=str(REPO_ROOT)),
                                    cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                                    timeout=600).stdout)
    out.pop("core")
    for key, (losses, _) in out.items():
        name, dtype, kernel = key.split()
        if kernel == "flash":
            np.testing.assert_allclose(losses, out[f"{name} {dtype} blocked"][0],
                                       rtol=1e-5 if dtype == "fp32" else 1e-3)


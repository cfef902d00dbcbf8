"""Grouped-query attention in the flash and block-sparse paths (docs/models.md "Attention"):
n_kv_head key/value heads dividing n_head, query head h reading key/value head h // (n_head /
n_kv_head), multi-query (n_kv_head 1) to multi-head (n_kv_head = n_head).

The flash twin and block-sparse attention against zmpi.nn.gqa's blocked path and a float64
masked reference over repeated keys and values (their key/value gradients summed per group),
and by float64 finite differences; flash.cu's and flash_tc.cu's kernels on the CPU CUDA
executor (tests/cuda_cpu.py, blocks in order and shuffled) against the twin; the Llama's layer
and model with a sparse layout (finite differences, an all-ones layout equal to dense) and
with "attention_kernel": "flash" on the CuPy stand-in (the blocked path's losses); bad shapes
one line each. The NVRTC compile of the kernels is tests/test_flash_attention.py's
test_flash_source_compiles_without_warnings; tensor parallelism at tp 2 with one key/value
head and a sparse layout, tests/test_llama.py's "2,1,2,1,sparse" launch.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
from gradcheck import check, check_model_loss, check_module
from mpi_util import REPO_ROOT, STANDIN
from test_flash_attention import _kernels_equal_the_twin
from test_sparse_attention import masked_attention, random_layout

from zmpi.kernels import flash_attention as FA
from zmpi.models.llama import Llama, LlamaConfig
from zmpi.nn import gqa as G
from zmpi.nn import sparse_attention as S
from zmpi.nn.llama_layers import GroupedQueryAttention, RotaryEmbedding
from zmpi.nn.sparsity import causal_layout, sparsity_from_dict

N_HEAD, HD = 4, 6
KV_HEADS = [1, 2, 4]  # multi-query, grouped, multi-head


@pytest.fixture
def rng():
    return np.random.default_rng(58)


def _packed(rng, B, T, n_kv_head, n_head=N_HEAD, hd=HD, dtype=np.float64):
    """Random qkv (B, T, (nh + 2 nkv) hd) and dy (B, T, nh hd)."""
    qkv = rng.standard_normal((B, T, (n_head + 2 * n_kv_head) * hd)).astype(dtype)
    return qkv, rng.standard_normal((B, T, n_head * hd)).astype(dtype)


def _blocked(qkv, dy, n_kv_head, n_head=N_HEAD):
    """y and dqkv of zmpi.nn.gqa's blocked path on the packed qkv."""
    q, k, v = G.unpack_dqkv(qkv, n_head, n_kv_head)  # the views of the three parts
    y, cache = G.gqa_attention_forward(q, k, v, n_head, n_kv_head)
    return y, np.concatenate(G.gqa_attention_backward(dy, cache), axis=-1)


def _masked(qkv, dy, n_kv_head, layout, block, n_head=N_HEAD):
    """y and dqkv of the float64 masked reference (test_sparse_attention.masked_attention) on
    the keys and values repeated to n_head heads, their gradients summed over each group."""
    q, k, v = G.unpack_dqkv(qkv, n_head, n_kv_head)
    B, T, _ = q.shape
    g = n_head // n_kv_head

    def repeat(x):
        return np.repeat(x.reshape(B, T, n_kv_head, 1, -1), g, axis=3).reshape(B, T, -1)

    y, d = masked_attention(np.concatenate([q, repeat(k), repeat(v)], axis=-1), n_head, layout,
                            block, True, dy)
    dq, dk, dv = np.split(d, 3, axis=-1)
    dk, dv = (x.reshape(B, T, n_kv_head, g, -1).sum(axis=3).reshape(B, T, -1) for x in (dk, dv))
    return y, np.concatenate([dq, dk, dv], axis=-1)


def _close(got, want, tol=1e-12):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


# -- the flash twin and block-sparse attention, against the blocked path and the reference ----

@pytest.mark.parametrize("n_kv_head", KV_HEADS)
def test_the_flash_twin_equals_the_blocked_path_and_the_reference(rng, n_kv_head):
    """Dense causal at T 70 (a ragged last block), and a random per-head layout at block 4."""
    qkv, dy = _packed(rng, 2, 70, n_kv_head)
    y, cache = FA.flash_attention_forward(qkv, N_HEAD, n_kv_head=n_kv_head)
    got = (y, FA.flash_attention_backward(dy, cache))
    _close(got, _blocked(qkv, dy, n_kv_head))
    _close(got, _masked(qkv, dy, n_kv_head, np.ones((N_HEAD, 70, 70)), 1))
    layout = causal_layout(random_layout(rng, N_HEAD, 8))
    qkv, dy = qkv[:, :32], dy[:, :32]
    y, cache = FA.flash_attention_forward(qkv, N_HEAD, layout, 4, n_kv_head=n_kv_head)
    _close((y, FA.flash_attention_backward(dy, cache)), _masked(qkv, dy, n_kv_head, layout, 4))


@pytest.mark.parametrize("n_kv_head", KV_HEADS)
def test_block_sparse_gqa_equals_the_blocked_path_and_the_reference(rng, n_kv_head):
    """An all-ones layout against the blocked dense path; random per-head layouts (the heads
    of a group keeping different blocks) against the reference and the flash twin."""
    qkv, dy = _packed(rng, 2, 32, n_kv_head)
    y, cache = S.sparse_attention_forward(qkv, N_HEAD, np.ones((N_HEAD, 4, 4)), 8,
                                          n_kv_head=n_kv_head)
    _close((y, S.sparse_attention_backward(dy, cache)), _blocked(qkv, dy, n_kv_head))
    layout = random_layout(rng, N_HEAD, 8)
    for keep_probs in (True, False):  # selective recompute: the same numbers
        y, cache = S.sparse_attention_forward(qkv, N_HEAD, layout, 4, n_kv_head=n_kv_head,
                                              keep_probs=keep_probs)
        got = (y, S.sparse_attention_backward(dy, cache))
        _close(got, _masked(qkv, dy, n_kv_head, causal_layout(layout), 4))
    y_f, cache_f = FA.flash_attention_forward(qkv, N_HEAD, causal_layout(layout), 4,
                                              n_kv_head=n_kv_head)
    _close(got, (y_f, FA.flash_attention_backward(dy, cache_f)))


@pytest.mark.parametrize("path", ["flash dense", "flash sparse", "sparse"])
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_finite_differences(rng, path, n_kv_head):
    T, block = 12, 3
    layout = causal_layout(random_layout(rng, N_HEAD, T // block))
    qkv, dy = _packed(rng, 2, T, n_kv_head, hd=3)
    forward, backward, args = {
        "flash dense": (FA.flash_attention_forward, FA.flash_attention_backward, ()),
        "flash sparse": (FA.flash_attention_forward, FA.flash_attention_backward,
                         (layout, block)),
        "sparse": (S.sparse_attention_forward, S.sparse_attention_backward, (layout, block)),
    }[path]
    dqkv = backward(dy, forward(qkv, N_HEAD, *args, n_kv_head=n_kv_head)[1])

    def f():
        return float((forward(qkv, N_HEAD, *args, n_kv_head=n_kv_head)[0] * dy).sum())

    check(f, qkv, dqkv, rng, "qkv", max_elementwise=0)


# -- the CUDA kernels on the CPU executor -----------------------------------------------------

@pytest.mark.parametrize("n_kv_head", [1, 2])
@pytest.mark.parametrize("sparse, T, s", [(False, 70, 16), (True, 32, 4)])
def test_the_simt_kernels_equal_the_twin(rng, monkeypatch, cuda_device, n_kv_head, sparse, T,
                                         s):
    """flash.cu in float64 at tile rows s (s / 2 for the keys' backward, which walks the
    query heads of its key/value head one after the other): dense with a ragged last block,
    per-head layouts, to round-off, every element of y, lse and dqkv written."""
    monkeypatch.setattr(FA, "tile_rows", lambda kernel, *_: (
        s // 2 if kernel == "flash_backward_dkv" else s))
    layout = (FA.sparse_layout(causal_layout(random_layout(rng, N_HEAD, T // 8)), 8)
              if sparse else FA.dense_layout(T))
    _kernels_equal_the_twin(rng, cuda_device, layout, T, N_HEAD, 5, np.float64, 1e-12,
                            n_kv_head)


@pytest.mark.parametrize("n_kv_head", [1, 2])
@pytest.mark.parametrize("sparse, T", [(False, 40), (True, 64)])
def test_the_tensor_core_kernels_equal_the_twin(rng, monkeypatch, cuda_device, n_kv_head,
                                                sparse, T):
    """flash_tc.cu in float16 (heads of 16, tiles of 16 rows) within fp16's rounding."""
    launched = []
    function = FA._function
    monkeypatch.setattr(FA, "_function", lambda name, *types: launched.append(name) or
                        function(name, *types))
    monkeypatch.setattr(FA, "tile_rows", lambda *_: 16)
    layout = (FA.sparse_layout(causal_layout(random_layout(rng, N_HEAD, T // 16)), 16)
              if sparse else FA.dense_layout(T))
    _kernels_equal_the_twin(rng, cuda_device, layout, T, N_HEAD, 16, np.float16, 4e-3,
                            n_kv_head)
    assert set(launched) == {"flash_tc_forward", "flash_tc_backward_dq", "flash_tc_backward_dkv"}


# -- the Llama's layer and model ---------------------------------------------------------------

FIXED = {"mode": "fixed", "block": 4, "num_local_blocks": 2, "num_global_blocks": 1,
         "attention": "unidirectional", "different_layout_per_head": True,
         "num_different_global_patterns": 2}


@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_the_layer_with_a_sparse_layout(rng, n_kv_head):
    """GroupedQueryAttention (RoPE at an offset) block-sparse: finite differences of the input
    and every weight; with a layout that keeps every causal block, the blocked layer's output
    and gradients to round-off."""
    rope = RotaryEmbedding(HD, 500.0)
    sparse = GroupedQueryAttention(N_HEAD * HD, N_HEAD, n_kv_head, rope, rng=1,
                                   dtype=np.float64, sparsity=sparsity_from_dict(FIXED, N_HEAD))
    x = rng.standard_normal((2, 16, N_HEAD * HD))
    check_module(sparse, x, rng, max_elementwise=0)
    every = sparsity_from_dict({"mode": "fixed", "block": 4, "num_local_blocks": 4,
                                "attention": "unidirectional"}, N_HEAD)  # one window: all
    outs = []
    for sparsity in (None, every):
        layer = GroupedQueryAttention(N_HEAD * HD, N_HEAD, n_kv_head, rope, rng=1,
                                      dtype=np.float64, sparsity=sparsity)
        y = layer.forward(x, offset=3)
        dx = layer.backward(np.ones_like(y))
        outs.append((y, dx, *(p.grad for _, p in layer.named_parameters())))
    _close(outs[1], outs[0])


def test_a_llama_with_sparse_attention_by_finite_differences(rng):
    cfg = LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                      vocab_multiple=1)
    model = Llama(cfg, seed=0, dtype=np.float64, sparse_attention={**FIXED, "block": 2})
    assert model.sparse_attention.num_heads == 4
    idx = rng.integers(0, 11, (2, 8))
    check_model_loss(model, idx, np.roll(idx, -1, axis=1), rng)
    with pytest.raises(ValueError, match="not a multiple of sparse_attention.block 2"):
        model.check_batch(idx[:, :7], idx[:, :7])


STANDIN_LLAMA = """
import json, sys
sys.path[:0] = ["tests/ranks", "tests"]
import cupy
from zero_checks import config
from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.llama import Llama, LlamaConfig

comm, out = Comm(), {}
SPARSE = json.loads(sys.argv[1])
for name, sparse, T in (("dense", None, 20), ("sparse", SPARSE, 16)):
    for kv in (1, 2):
        for kernel in ("blocked", "flash"):
            cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv,
                              max_position_embeddings=T)
            section = {"sparse_attention": sparse} if sparse else {}
            engine = Engine(Llama(cfg, seed=0, sparse_attention=sparse),
                            {**config(0), "attention_kernel": kernel, **section}, comm)
            data = SyntheticSource(16, T, 12, 0, 1, seed=1)
            out[f"{name} {kv} {kernel}"] = [engine.train_step(*data.sample(s)) for s in range(3)]
print(json.dumps(out))
"""


def test_a_llama_trains_alike_with_flash_on_the_standin():
    """A Llama (multi-query and grouped; dense with a ragged block and DeepSpeed's fixed
    layout) trains on the CuPy stand-in with "attention_kernel": "flash" to the blocked path's
    losses, fp32 to 1e-6."""
    out = json.loads(subprocess.run([sys.executable, "-c", STANDIN_LLAMA, json.dumps(FIXED)],
                                    env=STANDIN, cwd=REPO_ROOT, capture_output=True, text=True,
                                    check=True, timeout=300).stdout)
    assert len(out) == 8
    for key, losses in out.items():
        if key.endswith("flash"):
            np.testing.assert_allclose(losses, out[key.replace("flash", "blocked")], rtol=1e-6)


# -- bad inputs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("forward, args", [(FA.flash_attention_forward, ()),
                                           (S.sparse_attention_forward, (np.ones((4, 2, 2)), 4))])
@pytest.mark.parametrize("width, n_kv_head", [(48, 3), (50, 2), (48, 0), (48, 2.0)])
def test_bad_head_counts_are_one_line(forward, args, width, n_kv_head):
    qkv = np.zeros((1, 8, width))
    with pytest.raises(ValueError, match=f"qkv of width {width} for n_head 4 and n_kv_head "
                                         f"{n_kv_head} \\(n_kv_head must divide n_head"):
        forward(qkv, 4, *args, n_kv_head=n_kv_head)


def test_a_layout_of_other_heads_is_refused():
    with pytest.raises(ValueError, match="a sparse attention layout of 2 heads for n_head=4"):
        GroupedQueryAttention(24, 4, 2, sparsity=sparsity_from_dict(FIXED, 2))
    with pytest.raises(ValueError, match="a sparse attention layout of 2 heads for n_head=4"):
        Llama(LlamaConfig(hidden_size=16), sparse_attention=sparsity_from_dict(FIXED, 2))

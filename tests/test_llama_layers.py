"""The Llama family's layers (zmpi.nn.llama_layers, .llama_functional, .gqa; docs/layers.md):
float64 finite differences for every layer and parameter, accumulation, the cache discipline,
RoPE against the direct formula and transformers' conventions (written here, independently),
grouped-query attention against multi-head attention and a float64 reference that repeats the
key/value heads, and one clear error for each bad argument."""

import json
import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from gradcheck import check_module
from mpi_util import REPO_ROOT, STANDIN

from zmpi.nn import CausalSelfAttention, Module
from zmpi.nn import attention as A
from zmpi.nn import llama_functional as L
from zmpi.nn.gqa import gqa_attention_forward
from zmpi.nn.llama_layers import GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLU

F64 = np.float64
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


class AtOffset(Module):
    """Runs `inner.forward(x, offset)`: a chunk of a sequence that starts at `offset`."""

    def __init__(self, inner, offset):
        self.inner, self.offset = inner, offset

    def forward(self, x):
        return self.inner.forward(x, self.offset)

    def backward(self, dy):
        return self.inner.backward(dy)


def gqa(n_head=4, n_kv_head=2, rope=True, scaling=None, offset=None, d_model=16):
    hd = d_model // n_head
    layer = GroupedQueryAttention(
        d_model, n_head, n_kv_head, RotaryEmbedding(hd, 100.0, scaling) if rope else None,
        rng=0, dtype=F64, std=0.5)
    return layer if offset is None else AtOffset(layer, offset)


LAYERS = {
    "rmsnorm": lambda: (RMSNorm(6, dtype=F64), (2, 3, 6)),
    "swiglu": lambda: (SwiGLU(6, 10, rng=0, dtype=F64, std=0.5), (2, 3, 6)),
    "gqa_mha": lambda: (gqa(n_kv_head=4), (2, 5, 16)),
    "gqa_2": lambda: (gqa(n_kv_head=2), (2, 5, 16)),
    "gqa_mqa": lambda: (gqa(n_kv_head=1), (2, 5, 16)),
    "gqa_norope": lambda: (gqa(n_kv_head=2, rope=False), (2, 5, 16)),
    "gqa_llama3_offset": lambda: (gqa(n_kv_head=2, scaling=LLAMA3, offset=37), (2, 5, 16)),
    "gqa_linear_offset": lambda: (gqa(n_kv_head=1, scaling={"rope_type": "linear",
                                                             "factor": 4.0}, offset=9),
                                  (1, 6, 16)),
}


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def randomize_(module, rng):
    """Non-trivial parameters (RMSNorm starts at 1)."""
    for p in module.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5 + (p.data if p.data.ndim == 1 else 0)


@pytest.mark.parametrize("kind, block", [(k, None) for k in LAYERS]
                         + [(k, 2) for k in LAYERS if k.startswith("gqa")])
def test_layer_grads(kind, block, rng, monkeypatch):
    """Every input and parameter gradient against float64 finite differences; block 2: the
    attention's queries in blocks of 2 rows (several blocks; at 5 rows a partial
    last one)."""
    if block is not None:
        monkeypatch.setattr(A, "ATTENTION_BLOCK", block)
    layer, shape = LAYERS[kind]()
    randomize_(layer, rng)
    checked = check_module(layer, rng.standard_normal(shape), rng)
    assert checked == ["input"] + [n for n, _ in layer.named_parameters()]


@pytest.mark.parametrize("kind", LAYERS)
def test_two_backwards_double_the_grads(kind, rng):
    layer, shape = LAYERS[kind]()
    x = rng.standard_normal(shape)
    dy = rng.standard_normal(layer.forward(x).shape)
    dx = layer.backward(dy)
    once = [p.grad.copy() for p in layer.parameters()]
    np.testing.assert_array_equal(layer.forward(x), layer.forward(x))  # a second forward
    np.testing.assert_array_equal(layer.backward(dy), dx)
    for g1, (name, p) in zip(once, layer.named_parameters(), strict=True):
        np.testing.assert_allclose(p.grad, 2 * g1, rtol=1e-12, err_msg=name)
    layer.zero_grad()
    assert all(not p.grad.any() for p in layer.parameters())


@pytest.mark.parametrize("kind", LAYERS)
def test_backward_without_forward_raises(kind, rng):
    layer, shape = LAYERS[kind]()
    with pytest.raises(RuntimeError, match="without a preceding forward"):
        layer.backward(np.zeros(shape))
    y = layer.forward(rng.standard_normal(shape))
    layer.backward(np.ones_like(y))
    with pytest.raises(RuntimeError, match="cache is consumed"):
        layer.backward(np.ones_like(y))


def test_parameter_names_shapes_and_init():
    attn = GroupedQueryAttention(16, 4, 2, rng=0)
    assert [(n, p.shape) for n, p in attn.named_parameters()] == [
        ("q.weight", (16, 16)), ("k.weight", (16, 8)), ("v.weight", (16, 8)),
        ("o.weight", (16, 16))]
    mlp = SwiGLU(16, 40, rng=0, std=0.02, proj_std=0.001)
    assert [(n, p.shape) for n, p in mlp.named_parameters()] == [
        ("gate.weight", (16, 40)), ("up.weight", (16, 40)), ("down.weight", (40, 16))]
    assert abs(mlp.gate.weight.data.std() - 0.02) < 0.004
    assert abs(mlp.down.weight.data.std() - 0.001) < 0.0002
    norm = RMSNorm(16)
    assert [n for n, _ in norm.named_parameters()] == ["weight"] and (norm.weight.data == 1).all()
    assert norm.eps == 1e-6  # LlamaConfig's rms_norm_eps


# -- RMSNorm and SwiGLU against their definitions ------------------------------------------------


def test_rmsnorm_and_swiglu_values(rng):
    x = rng.standard_normal((3, 4, 6)) * 3
    norm = RMSNorm(6, eps=1e-5, dtype=F64)
    norm.weight.data[...] = rng.standard_normal(6)
    expected = x / np.sqrt((x ** 2).mean(axis=-1, keepdims=True) + 1e-5) * norm.weight.data
    np.testing.assert_allclose(norm.forward(x), expected, rtol=1e-13)

    mlp = SwiGLU(6, 5, rng=0, dtype=F64)
    gate, up, down = (p.data for p in mlp.parameters())
    g = x @ gate
    expected = (g / (1 + np.exp(-g)) * (x @ up)) @ down
    np.testing.assert_allclose(mlp.forward(x), expected, rtol=1e-12)
    # the sigmoid never overflows: silu(-1000) = 0, silu(1000) = 1000
    y, _ = L.swiglu_forward(np.array([-1000.0, 1000.0]), np.ones(2))
    np.testing.assert_array_equal(y, [0.0, 1000.0])


# -- RoPE ---------------------------------------------------------------------------------------


def hf_rotate(x, inv_freq, positions):
    """transformers' apply_rotary_pos_emb, written here: emb = cat(freqs, freqs),
    x cos(emb) + rotate_half(x) sin(emb), rotate_half(x) = cat(-x2, x1)."""
    freqs = np.outer(positions, inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    h = x.shape[-1] // 2
    rotate_half = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def direct_rotate(x, inv_freq, positions):
    """Channels i and i + hd/2 as one complex number, times exp(i p f_i)."""
    h = x.shape[-1] // 2
    z = (x[..., :h] + 1j * x[..., h:]) * np.exp(1j * np.outer(positions, inv_freq))
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("offset", [0, 5, 1000])
def test_rope_matches_the_direct_formula_and_transformers(offset, rng):
    hd, T = 8, 7
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(L.rope_inv_freq(hd), inv_freq, rtol=1e-15)
    x = rng.standard_normal((2, 3, T, hd))
    cos, sin = L.rope_tables(L.rope_inv_freq(hd), T, offset)
    y = L.rope_forward(x, cos, sin)
    positions = np.arange(offset, offset + T)
    np.testing.assert_allclose(y, direct_rotate(x, inv_freq, positions), atol=1e-12)
    np.testing.assert_allclose(y, hf_rotate(x, inv_freq, positions), atol=1e-12)
    # backward: the transpose (= inverse) of the rotation
    dy = rng.standard_normal(y.shape)
    dx = L.rope_backward(dy, cos, sin)
    assert np.isclose((dy * y).sum(), (dx * x).sum(), rtol=1e-12)
    np.testing.assert_allclose(L.rope_backward(y, cos, sin), x, atol=1e-12)


def test_rope_positions_are_global(rng):
    """A chunk at offset o rotates its rows as the whole sequence rotates rows o .. o + T - 1:
    the q and k attention keeps equal the whole sequence's rows, and (positions entering
    only as differences) its output equals the unrotated chunk's at offset 0."""
    rope = RotaryEmbedding(4, 500.0, LLAMA3)
    q, k, v = rng.standard_normal((2, 12, 8)), rng.standard_normal((2, 12, 4)), \
        rng.standard_normal((2, 12, 4))
    _, (qa, ka, *_) = gqa_attention_forward(q, k, v, 2, 1, rope.tables(12, 0, q))
    chunk = slice(5, 12)
    _, (qc, kc, *_) = gqa_attention_forward(q[:, chunk], k[:, chunk], v[:, chunk], 2, 1,
                                            rope.tables(7, 5, q))
    np.testing.assert_allclose(qc, qa[:, :, chunk], atol=1e-13)
    np.testing.assert_allclose(kc, ka[:, :, chunk], atol=1e-13)
    layer = GroupedQueryAttention(8, 2, 1, rope, rng=0, dtype=F64, std=0.5)
    x = rng.standard_normal((2, 7, 8))
    y40, q40 = layer.forward(x, 40), layer._cache[0][0]
    y0, q0 = layer.forward(x, 0), layer._cache[0][0]
    np.testing.assert_allclose(y40, y0, atol=1e-12)
    assert not np.allclose(q40, q0)  # rotated differently, attended the same
    layer.clear_cache()


def llama3_inv_freq(hd, theta, factor, low, high, context):
    """Llama 3.1's frequency rule, one frequency at a time (Meta's apply_scaling)."""
    out = []
    for i in range(0, hd, 2):
        f = 1.0 / theta ** (i / hd)
        wavelength = 2 * math.pi / f
        if wavelength < context / high:
            out.append(f)
        elif wavelength > context / low:
            out.append(f / factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_rope_scaling_frequencies():
    hd, theta = 16, 10000.0
    base = L.rope_inv_freq(hd, theta)
    np.testing.assert_allclose(
        L.rope_inv_freq(hd, theta, {"rope_type": "linear", "factor": 4.0}), base / 4, rtol=1e-15)
    np.testing.assert_array_equal(L.rope_inv_freq(hd, theta, {"type": "linear", "factor": 1}),
                                  base)  # transformers' older key
    np.testing.assert_array_equal(L.rope_inv_freq(hd, theta, {"rope_type": "default"}), base)
    scaling = dict(LLAMA3, original_max_position_embeddings=512)
    got = L.rope_inv_freq(hd, theta, scaling)
    want = llama3_inv_freq(hd, theta, 8.0, 1.0, 4.0, 512)
    np.testing.assert_allclose(got, want, rtol=1e-14)
    # every regime is exercised: kept (high), interpolated (low), and smoothed between
    kept, divided = np.isclose(got, base, rtol=1e-14), np.isclose(got, base / 8, rtol=1e-14)
    assert kept.any() and divided.any() and (~kept & ~divided).any()
    # Llama 3.1 8B's configuration: the highest frequency kept, the lowest divided by 8
    llama31 = L.rope_inv_freq(128, 500000.0, dict(LLAMA3, original_max_position_embeddings=8192))
    want = llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(llama31, want, rtol=1e-14)
    assert llama31[0] == 1.0 and np.isclose(llama31[-1], 500000.0 ** (-126 / 128) / 8)


def test_rope_tables_follow_the_array_and_are_reused():
    rope = RotaryEmbedding(4)
    x32 = np.zeros((1, 3, 4), np.float32)
    cos, sin = rope.tables(3, 2, x32)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (3, 2)
    assert rope.tables(3, 2, x32)[0] is cos  # the layers of a step share them
    np.testing.assert_allclose(rope.tables(3, 2, x32.astype(F64))[0],
                               np.cos(np.outer([2, 3, 4], rope.inv_freq)), rtol=1e-15)


# -- grouped-query attention --------------------------------------------------------------------


def reference_attention(x, layer, offset=0):
    """GroupedQueryAttention in float64 the way transformers writes it: heads split, rotated
    (rotate_half), keys and values repeated n_head / n_kv_head times (repeat_kv), a masked
    softmax over the full T x T scores."""
    B, T, C = x.shape
    nh, nkv = layer.n_head, layer.n_kv_head
    hd = C // nh
    q, k, v = ((x @ lin.weight.data).reshape(B, T, -1, hd).transpose(0, 2, 1, 3)
               for lin in (layer.q, layer.k, layer.v))
    if layer.rope is not None:
        positions = np.arange(offset, offset + T)
        q, k = (hf_rotate(t, layer.rope.inv_freq, positions) for t in (q, k))
    k, v = (np.repeat(t, nh // nkv, axis=1) for t in (k, v))  # head h reads kv head h // g
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(hd)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(B, T, C) @ layer.o.weight.data


@pytest.mark.parametrize("block", [None, 3])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_against_repeated_kv_heads(n_kv_head, block, rng, monkeypatch):
    if block is not None:
        monkeypatch.setattr(A, "ATTENTION_BLOCK", block)
    layer = GroupedQueryAttention(16, 4, n_kv_head, RotaryEmbedding(4, 100.0, LLAMA3), rng=0,
                                  dtype=F64, std=0.5)
    x = rng.standard_normal((2, 8, 16))
    np.testing.assert_allclose(layer.forward(x, 21), reference_attention(x, layer, 21),
                               rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("selective", [False, True])
def test_gqa_at_n_kv_head_n_head_is_multi_head_attention(selective, rng):
    """Without RoPE, with the same weights (and CausalSelfAttention's biases at 0), the same
    outputs and gradients as the GPT's attention; with selective recompute too."""
    mha = CausalSelfAttention(16, 4, rng=0, dtype=F64, std=0.5)
    layer = GroupedQueryAttention(16, 4, rng=1, dtype=F64)
    for i, lin in enumerate((layer.q, layer.k, layer.v)):
        lin.weight.data[...] = mha.qkv.weight.data[:, 16 * i:16 * (i + 1)]
    layer.o.weight.data[...] = mha.proj.weight.data
    mha.recompute_core = layer.recompute_core = selective
    x = rng.standard_normal((2, 70, 16))  # two query blocks on a CPU
    y = layer.forward(x)
    np.testing.assert_allclose(y, mha.forward(x), rtol=1e-12, atol=1e-14)
    dy = rng.standard_normal(y.shape)
    np.testing.assert_allclose(layer.backward(dy), mha.backward(dy), rtol=1e-12, atol=1e-14)
    grads = np.concatenate([lin.weight.grad for lin in (layer.q, layer.k, layer.v)], axis=1)
    np.testing.assert_allclose(grads, mha.qkv.weight.grad, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(layer.o.weight.grad, mha.proj.weight.grad, rtol=1e-12)


def test_selective_recompute_gives_the_same_gradients(rng):
    x = rng.standard_normal((2, 70, 16)).astype(np.float32)
    dy = rng.standard_normal((2, 70, 16)).astype(np.float32)
    results = []
    for selective in (False, True):
        layer = GroupedQueryAttention(16, 4, 2, RotaryEmbedding(4), rng=0)
        layer.recompute_core = selective
        layer.forward(x, 3)
        assert (layer._cache[0][3] is None) == selective  # no probabilities kept
        results.append([layer.backward(dy)] + [p.grad for p in layer.parameters()])
    for kept, recomputed in zip(*results, strict=True):
        np.testing.assert_array_equal(kept, recomputed)  # the same operations, recomputed


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_storage(dtype, rng):
    """float16/bfloat16 parameters compute in float32 and accumulate into their storage."""
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    for make in (lambda d: RMSNorm(16, dtype=d), lambda d: SwiGLU(16, 24, rng=0, dtype=d),
                 lambda d: GroupedQueryAttention(16, 4, 2, RotaryEmbedding(4), rng=0, dtype=d)):
        ref, low = make(np.float32), make(dtype)
        y_ref, y = ref.forward(x), low.forward(x)
        assert y.dtype == np.float32
        tol = 5e-3 if dtype == np.float16 else 3e-2  # one rounding of each weight
        np.testing.assert_allclose(y, y_ref, atol=tol * np.abs(y_ref).max())
        dy = rng.standard_normal(y.shape).astype(np.float32)
        dx_ref, dx = ref.backward(dy), low.backward(dy)
        np.testing.assert_allclose(dx, dx_ref, atol=tol * np.abs(dx_ref).max())
        for (name, p), p_ref in zip(low.named_parameters(), ref.parameters(), strict=True):
            assert p.grad.dtype == dtype, name
            np.testing.assert_allclose(p.grad.astype(np.float32), p_ref.grad,
                                       atol=tol * np.abs(p_ref.grad).max(), err_msg=name)


# -- bad arguments: one clear error each ---------------------------------------------------------

BAD = [
    (lambda: RMSNorm(0), "RMSNorm dim must be an integer >= 1, got 0"),
    (lambda: RMSNorm(4, eps=0.0), "RMSNorm eps must be a finite number > 0"),
    (lambda: RMSNorm(4, eps=float("nan")), "RMSNorm eps must be a finite number > 0"),
    (lambda: SwiGLU(4, 0), "SwiGLU hidden must be an integer >= 1, got 0"),
    (lambda: SwiGLU(4.0, 8), "SwiGLU d_model must be an integer >= 1, got 4.0"),
    (lambda: RotaryEmbedding(5), "head size of rotary embeddings must be even, got 5"),
    (lambda: RotaryEmbedding(0), "head size of rotary embeddings must be an integer >= 2"),
    (lambda: RotaryEmbedding(4, theta=0), "rope_theta must be a finite number > 0, got 0"),
    (lambda: RotaryEmbedding(4, theta=float("inf")), "rope_theta must be a finite number > 0"),
    (lambda: RotaryEmbedding(4, scaling="llama3"), "rope_scaling must be None or a dict"),
    (lambda: RotaryEmbedding(4, scaling={"rope_type": "yarn", "factor": 2.0}),
     "rope_scaling.rope_type must be one of 'default', 'linear', 'llama3', got 'yarn'"),
    (lambda: RotaryEmbedding(4, scaling={"factor": 2.0}),
     "rope_scaling.rope_type must be one of"),
    (lambda: RotaryEmbedding(4, scaling={"rope_type": ["linear"], "factor": 2.0}),
     r"rope_scaling.rope_type must be one of .*, got \['linear'\]"),
    (lambda: RotaryEmbedding(4, scaling={"rope_type": "linear", "type": "llama3",
                                         "factor": 2.0}),
     "rope_scaling names two types: rope_type 'linear' and type 'llama3'"),
    (lambda: RotaryEmbedding(4, scaling={"rope_type": "linear"}),
     r"rope_scaling of type 'linear' takes \['factor'\]: missing \['factor'\]"),
    (lambda: RotaryEmbedding(4, scaling={"rope_type": "linear", "factor": 2.0, "beta": 1}),
     r"takes \['factor'\]: unknown \['beta'\]"),
    (lambda: RotaryEmbedding(4, scaling={"rope_type": "linear", "factor": 0.5}),
     "rope_scaling.factor must be a finite number >= 1, got 0.5"),
    (lambda: RotaryEmbedding(4, scaling=dict(LLAMA3, high_freq_factor=1.0)),
     r"high_freq_factor \(1\) must be greater than low_freq_factor \(1\)"),
    (lambda: RotaryEmbedding(4, scaling=dict(LLAMA3, original_max_position_embeddings=0)),
     "rope_scaling.original_max_position_embeddings must be an integer >= 1, got 0"),
    (lambda: RotaryEmbedding(4, scaling=dict(LLAMA3, low_freq_factor=None)),
     "rope_scaling.low_freq_factor must be a finite number > 0, got None"),
    (lambda: RotaryEmbedding(4).tables(3, -1, np.zeros(1)),
     "position offset must be an integer >= 0, got -1"),
    (lambda: GroupedQueryAttention(16, 4, 3), "n_kv_head=3 does not divide n_head=4"),
    (lambda: GroupedQueryAttention(16, 4, 0), "n_kv_head must be an integer >= 1, got 0"),
    (lambda: GroupedQueryAttention(16, 5), "d_model=16 is not divisible by n_head=5"),
    (lambda: GroupedQueryAttention(16, 4, rope=RotaryEmbedding(8)),
     "rope must be None or a RotaryEmbedding of head size 4 .* of head size 8"),
    (lambda: GroupedQueryAttention(16, 4, rope=10000.0),
     "rope must be None or a RotaryEmbedding of head size 4"),
    (lambda: RMSNorm(4).forward(np.zeros((2, 5))),
     r"RMSNorm takes inputs \(\.\.\., C\) with C = 4, got shape \(2, 5\)"),
    (lambda: SwiGLU(4, 8).forward(np.zeros((2, 3))), "SwiGLU takes inputs"),
    (lambda: GroupedQueryAttention(16, 4).forward(np.zeros((3, 16))),
     r"GroupedQueryAttention takes inputs \(B, T, C\) with C = 16, got shape \(3, 16\)"),
    (lambda: GroupedQueryAttention(16, 4).forward(np.zeros((1, 3, 8))),
     "GroupedQueryAttention takes inputs"),
    (lambda: GroupedQueryAttention(16, 4).forward(np.zeros((1, 3, 16)), offset=-2),
     "position offset must be an integer >= 0, got -2"),
    (lambda: GroupedQueryAttention(16, 4).forward(np.zeros((1, 3, 16)), offset=1.5),
     "position offset must be an integer >= 0, got 1.5"),
    (lambda: GroupedQueryAttention(16, 4).forward(np.zeros((1, 3, 16)), offset=True),
     "position offset must be an integer >= 0, got True"),
]


@pytest.mark.parametrize("make, message", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_one_clear_error(make, message):
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


# -- the CuPy path ------------------------------------------------------------------------------

# The layers with device parameters and inputs on the CuPy stand-in (tests/standin: device
# arrays refuse NumPy operands, copies are explicit) against the same layers on NumPy.
ON_THE_STANDIN = """
import json, sys
import numpy as np, cupy
from zmpi.nn.llama_layers import GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLU
rope = RotaryEmbedding(4, 500.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
rng = np.random.default_rng(0)
x, dy = rng.standard_normal((2, 70, 16)), rng.standard_normal((2, 70, 16))
out = {}
for name, make in (("rmsnorm", lambda: RMSNorm(16, dtype=np.float64)),
                   ("swiglu", lambda: SwiGLU(16, 24, rng=0, dtype=np.float64)),
                   ("gqa", lambda: GroupedQueryAttention(16, 4, 2, rope, rng=0,
                                                         dtype=np.float64))):
    host, device = make(), make()
    for p in device.parameters():
        p.data, p.grad = cupy.asarray(p.data), cupy.asarray(p.grad)
    kwargs = {"offset": 3} if name == "gqa" else {}
    y, y_d = host.forward(x, **kwargs), device.forward(cupy.asarray(x), **kwargs)
    dx, dx_d = host.backward(dy), device.backward(cupy.asarray(dy))
    out[name] = [bool(np.allclose(a_d.get(), a, rtol=1e-12, atol=1e-14))
                 for a, a_d in [(y, y_d), (dx, dx_d)] + [
                     (p.grad, p_d.grad) for p, p_d in zip(host.parameters(),
                                                          device.parameters())]]
print(json.dumps(out))
"""


def test_the_cupy_path_on_the_standin_equals_numpy():
    out = json.loads(subprocess.run([sys.executable, "-c", ON_THE_STANDIN], env=STANDIN,
                                    cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    assert sorted(out) == ["gqa", "rmsnorm", "swiglu"] and all(map(all, out.values())), out

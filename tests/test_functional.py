"""Kernels of zmpi.nn.functional: float64 finite-difference gradients and reference values."""

import math

import numpy as np
import pytest
from gradcheck import check, directional_check

from zmpi.nn import attention as A
from zmpi.nn import functional as F


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def dot(y, dy):
    return float((y * dy).sum())


@pytest.mark.parametrize("bias", [True, False])
def test_linear_grads(rng, bias):
    x, W = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5))  # (B, T, Cin), (Cin, Cout)
    b = rng.standard_normal(5) if bias else None
    y, cache = F.linear_forward(x, W, b)
    dy = rng.standard_normal(y.shape)
    dx, dW, db = F.linear_backward(dy, cache)

    def f():
        return dot(F.linear_forward(x, W, b)[0], dy)

    check(f, x, dx, rng, "x")
    check(f, W, dW, rng, "W")
    if bias:
        check(f, b, db, rng, "b")


def test_linear_matches_matmul_2d_and_3d(rng):
    x, W, b = rng.standard_normal((6, 4)), rng.standard_normal((4, 3)), rng.standard_normal(3)
    np.testing.assert_allclose(F.linear_forward(x, W, b)[0], x @ W + b, rtol=1e-12)
    y3 = F.linear_forward(x.reshape(2, 3, 4), W, b)[0]
    np.testing.assert_allclose(y3.reshape(6, 3), x @ W + b, rtol=1e-12)


def test_embedding_grads_with_repeated_indices(rng):
    W = rng.standard_normal((5, 3))  # (V, C)
    idx = np.array([[0, 2, 2], [4, 2, 0]])  # (B, T), repeats
    y, cache = F.embedding_forward(idx, W)
    np.testing.assert_array_equal(y, W[idx])
    dy = rng.standard_normal(y.shape)
    dW = F.embedding_backward(dy, cache)
    expect = np.zeros_like(W)
    for b in range(2):
        for t in range(3):
            expect[idx[b, t]] += dy[b, t]
    np.testing.assert_allclose(dW, expect, rtol=1e-12)
    check(lambda: dot(F.embedding_forward(idx, W)[0], dy), W, dW, rng, "W")


def test_layernorm_grads_and_normalisation(rng):
    x = rng.standard_normal((2, 3, 6)) * 3 + 1  # (B, T, C)
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    y, cache = F.layernorm_forward(x, w, b)
    xhat = (y - b) / w
    np.testing.assert_allclose(xhat.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(xhat.var(-1), 1, rtol=1e-4)  # var / (var + eps)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = F.layernorm_backward(dy, cache)

    def f():
        return dot(F.layernorm_forward(x, w, b)[0], dy)

    check(f, x, dx, rng, "x")
    check(f, w, dw, rng, "w")
    check(f, b, db, rng, "b")


def test_gelu_values_and_grads(rng):
    y, _ = F.gelu_forward(np.array([0.0, 1.0, -1.0, 10.0, -10.0]))
    np.testing.assert_allclose(y, [0.0, 0.841192, -0.158808, 10.0, 0.0], atol=1e-6)
    x = rng.standard_normal((3, 7)) * 2
    y, cache = F.gelu_forward(x)
    dy = rng.standard_normal(y.shape)
    check(lambda: dot(F.gelu_forward(x)[0], dy), x, F.gelu_backward(dy, cache), rng)


def attention_reference(qkv, n_head):
    """Loop-over-(b, h) reference for attention_forward."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    y = np.zeros((B, T, C))
    for b in range(B):
        for h in range(n_head):
            q, k, v = (qkv[b, :, i * C + h * hd: i * C + (h + 1) * hd] for i in range(3))
            s = q @ k.T / math.sqrt(hd)
            s[np.triu_indices(T, 1)] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            y[b, :, h * hd:(h + 1) * hd] = (p / p.sum(-1, keepdims=True)) @ v
    return y


@pytest.mark.parametrize("block", [A.ATTENTION_BLOCK, 2, 1])  # one block; 2, 2, 1 rows; rows
def test_attention_matches_reference_and_is_causal(rng, block):
    qkv = rng.standard_normal((2, 5, 3 * 8))  # (B, T, 3C), nh = 2
    y, (_, _, _, probs, _) = A.attention_forward(qkv, 2, block)
    np.testing.assert_allclose(y, attention_reference(qkv, 2), rtol=1e-12, atol=1e-12)
    att = np.concatenate([np.pad(p, [(0, 0)] * 3 + [(0, 5 - p.shape[-1])]) for p in probs], 2)
    assert att.shape == (2, 2, 5, 5) and np.all(np.triu(att[0, 0], 1) == 0)
    assert [p.shape[-1] for p in probs] == [min(5, s + block) for s in range(0, 5, block)]
    np.testing.assert_allclose(att.sum(-1), 1.0, rtol=1e-12)
    changed = qkv.copy()
    changed[:, 3] += 1.0  # position 3 changes: outputs at 0..2 must not
    y2, _ = A.attention_forward(changed, 2, block)
    np.testing.assert_array_equal(y2[:, :3], y[:, :3])
    assert not np.allclose(y2[:, 3:], y[:, 3:])


@pytest.mark.parametrize("block", [A.ATTENTION_BLOCK, 2, 1])
def test_attention_grads(rng, block):
    qkv = rng.standard_normal((2, 5, 3 * 8))
    y, cache = A.attention_forward(qkv, 2, block)
    dy = rng.standard_normal(y.shape)
    dqkv = A.attention_backward(dy, cache)
    check(lambda: dot(A.attention_forward(qkv, 2, block)[0], dy), qkv, dqkv, rng, "qkv")


def test_cross_entropy_grads(rng):
    logits = rng.standard_normal((2, 3, 7))  # (B, T, V)
    targets = rng.integers(0, 7, (2, 3))
    loss, cache = F.cross_entropy_forward(logits, targets)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expect = -np.take_along_axis(logp, targets[..., None], -1).mean()
    np.testing.assert_allclose(float(loss), expect, rtol=1e-12)
    assert loss.dtype == np.float64
    dlogits = F.cross_entropy_backward(cache)
    assert dlogits.shape == logits.shape

    def f():
        return float(F.cross_entropy_forward(logits, targets)[0])

    check(f, logits, dlogits, rng, "logits")
    np.testing.assert_allclose(F.cross_entropy_backward(cache, dloss=8.0), 8 * dlogits)


def test_cross_entropy_uniform_is_log_v_and_2d():
    loss, _ = F.cross_entropy_forward(np.zeros((4, 5, 11), np.float32), np.zeros((4, 5), int))
    assert loss.dtype == np.float32
    assert abs(float(loss) - math.log(11)) < 1e-6
    loss2, _ = F.cross_entropy_forward(np.zeros((4, 11)), np.arange(4))  # (B, V) logits
    assert abs(float(loss2) - math.log(11)) < 1e-12


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [5e3, 5e3, 0.0]], np.float32)
    loss, cache = F.cross_entropy_forward(logits, np.array([1, 0]))
    assert np.isfinite(float(loss)) and abs(float(loss) - (1e4 + math.log(2)) / 2) < 1e-2
    assert np.all(np.isfinite(F.cross_entropy_backward(cache)))
    half, _ = F.cross_entropy_forward(np.zeros((2, 3), np.float16), np.array([0, 1]))
    assert half.dtype == np.float32  # low-precision logits: the loss runs in float32


def test_gradcheck_catches_a_wrong_gradient(rng):
    x = rng.standard_normal(10)
    with pytest.raises(AssertionError):
        directional_check(lambda: float((x**3).sum()), x, 3 * x**2 * (1 + 1e-4), rng)
    directional_check(lambda: float((x**3).sum()), x, 3 * x**2, rng)


def test_cross_entropy_ignore_index_and_normalizer(rng):
    """Ignored positions count nowhere: the loss is the mean over the rest (or the sum over
    the rest / normalizer), their gradient is zero, and -100 is not read as an index."""
    logits = rng.standard_normal((3, 4, 7))
    targets = rng.integers(0, 7, (3, 4))
    targets[0, :3] = targets[2, 1] = -100
    keep = targets != -100
    loss, cache = F.cross_entropy_forward(logits, targets, ignore_index=-100)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per = -np.take_along_axis(logp, np.where(keep, targets, 0)[..., None], -1)[..., 0]
    np.testing.assert_allclose(float(loss), per[keep].mean(), rtol=1e-12)
    dlogits = F.cross_entropy_backward(cache, dloss=2.0)
    assert np.all(dlogits[~keep] == 0)
    check(lambda: 2.0 * float(F.cross_entropy_forward(logits, targets, -100)[0]), logits,
          dlogits, rng, "logits")
    summed, cache = F.cross_entropy_forward(logits, targets, -100, normalizer=2.5)
    np.testing.assert_allclose(float(summed), per[keep].sum() / 2.5, rtol=1e-12)
    check(lambda: float(F.cross_entropy_forward(logits, targets, -100, 2.5)[0]), logits,
          F.cross_entropy_backward(cache), rng, "logits")
    nothing, cache = F.cross_entropy_forward(logits, np.full((3, 4), -100), -100)
    assert float(nothing) == 0 and not F.cross_entropy_backward(cache).any()


def test_mse_grads_and_shape_check(rng):
    y, t = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    loss, cache = F.mse_forward(y, t)
    np.testing.assert_allclose(float(loss), ((y - t) ** 2).mean(), rtol=1e-12)
    check(lambda: float(F.mse_forward(y, t)[0]), y, F.mse_backward(cache), rng, "outputs")
    loss, cache = F.mse_forward(y, t, normalizer=5)
    np.testing.assert_allclose(float(loss), ((y - t) ** 2).sum() / 5, rtol=1e-12)
    check(lambda: 3 * float(F.mse_forward(y, t, 5)[0]), y, F.mse_backward(cache, 3.0), rng,
          "outputs")
    assert F.mse_forward(y.astype(np.float16), t)[0].dtype == np.float32
    with pytest.raises(ValueError, match="MSE targets have shape"):
        F.mse_forward(y, t[:, :1])

"""Layers of zmpi.nn: gradients (float64 finite differences), accumulation, cache discipline,
parameter rebinding as the ZeRO engine does it, and float16/bfloat16 storage."""

import ml_dtypes
import numpy as np
import pytest
from gradcheck import check, check_module
from layer_contract import check_grads_accumulate, rebind_to_flat

from zmpi.nn import (
    GELU,
    MLP,
    Block,
    CausalSelfAttention,
    Dense,
    Embedding,
    LayerNorm,
    Linear,
    Module,
    Parameter,
)

F64 = np.float64
LAYERS = {
    "linear": lambda: (Linear(6, 5, rng=0, dtype=F64), (2, 3, 6)),
    "linear_nobias": lambda: (Linear(6, 5, bias=False, rng=0, dtype=F64), (4, 6)),
    "layernorm": lambda: (LayerNorm(6, dtype=F64), (2, 3, 6)),
    "gelu": lambda: (GELU(), (2, 3, 6)),
    "dense": lambda: (Dense(6, 5, rng=0, dtype=F64), (2, 3, 6)),
    "dense_linear": lambda: (Dense(6, 5, act=False, rng=0, dtype=F64), (4, 6)),
    "attention": lambda: (CausalSelfAttention(8, 2, rng=0, dtype=F64, std=0.5), (2, 4, 8)),
    "mlp": lambda: (MLP(4, rng=0, dtype=F64, std=0.5), (2, 3, 4)),
    "block": lambda: (Block(8, 2, rng=0, dtype=F64, std=0.5), (2, 4, 8)),
}


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def randomize_(module, rng):
    """Non-trivial parameters (LayerNorm starts at 1/0, biases at 0)."""
    for p in module.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5 + (p.data if p.data.ndim == 1 else 0)


@pytest.mark.parametrize("kind", LAYERS)
def test_layer_grads(kind, rng):
    layer, shape = LAYERS[kind]()
    randomize_(layer, rng)
    checked = check_module(layer, rng.standard_normal(shape), rng)
    assert checked == ["input"] + [n for n, _ in layer.named_parameters()]


def test_embedding_grads_and_repeated_indices(rng):
    emb = Embedding(7, 3, rng=0, dtype=F64)
    idx = np.array([[1, 1, 4], [6, 1, 0]])
    y = emb.forward(idx)
    np.testing.assert_array_equal(y, emb.weight.data[idx])
    assert emb.backward(np.ones_like(y)) is None
    np.testing.assert_array_equal(emb.weight.grad[:, 0], [1, 3, 0, 0, 1, 0, 1])
    # f = sum(forward(idx) * dy): a directional + elementwise check on the table
    emb.zero_grad()
    dy = rng.standard_normal(y.shape)
    emb.forward(idx)
    emb.backward(dy)
    check(lambda: float((emb.forward(idx) * dy).sum()), emb.weight.data, emb.weight.grad.copy(),
          rng)


@pytest.mark.parametrize("kind", ["linear", "layernorm", "block"])
def test_two_backwards_double_the_grads(kind, rng):
    layer, shape = LAYERS[kind]()
    x = rng.standard_normal(shape)
    check_grads_accumulate(layer, x, rng.standard_normal(layer.forward(x).shape))


@pytest.mark.parametrize("kind", LAYERS)
def test_backward_without_forward_raises(kind, rng):
    layer, shape = LAYERS[kind]()
    with pytest.raises(RuntimeError):
        layer.backward(np.zeros(shape))
    y = layer.forward(rng.standard_normal(shape))
    layer.backward(np.ones_like(y))
    with pytest.raises(RuntimeError):  # the cache is consumed
        layer.backward(np.ones_like(y))


def test_parameters_are_read_at_call_time_like_the_engine_rebinds_them(rng):
    """The engine copies values into flat buffers and rebinds .data/.grad to views."""
    layer = Block(8, 2, rng=0, dtype=np.float32)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    y_ref = layer.forward(x)
    layer.backward(np.ones_like(y_ref))
    g_ref = [p.grad.copy() for p in layer.parameters()]
    flat_data, flat_grad, n = rebind_to_flat(layer, padding=3)
    np.testing.assert_array_equal(layer.forward(x), y_ref)
    layer.backward(np.ones_like(y_ref))
    np.testing.assert_allclose(flat_grad[:n], np.concatenate([g.ravel() for g in g_ref]))
    flat_data[:n] *= 2  # an optimizer step on the flat buffer is seen by the layer
    assert not np.allclose(layer.forward(x), y_ref)
    for p in layer.parameters():  # ZeRO-3 release
        p.data = None
    with pytest.raises(RuntimeError, match="released"):
        layer.forward(x)


def test_named_parameters_order_names_and_shared_units():
    block = Block(8, 2, rng=0)
    names = [n for n, _ in block.named_parameters()]
    assert names[:4] == ["ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias"]
    assert len(names) == len(set(names)) == 12
    assert block.attn.qkv.weight.shape == (8, 24) and block.attn.proj.weight.shape == (8, 8)
    assert block.num_parameters() == 2 * 16 + 8 * 24 + 24 + 64 + 8 + 8 * 32 + 32 + 32 * 8 + 8

    class Borrower(Module):
        def __init__(self, owner):
            self.shared_units = (owner,)
            self.owner = owner  # also as a plain attribute: still not walked
            self.own = Linear(2, 2, rng=0)
            self.blocks = [Linear(2, 2, rng=1), Linear(2, 2, rng=2)]

    b = Borrower(Linear(3, 3, rng=0))
    assert [n for n, _ in b.named_parameters("u.")] == [
        "u.own.weight", "u.own.bias", "u.blocks.0.weight", "u.blocks.0.bias",
        "u.blocks.1.weight", "u.blocks.1.bias"]
    p = Parameter(np.ones((2, 3), np.float32))
    assert p.grad.shape == (2, 3) and p.grad.dtype == np.float32 and not p.grad.any()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_low_precision_storage(dtype, rng):
    ref = Block(8, 2, rng=0, dtype=np.float32)
    low = Block(8, 2, rng=0, dtype=dtype)
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    y_ref, y = ref.forward(x), low.forward(x)
    assert y.dtype == np.float32  # activations flow in the compute dtype
    # tolerance: one rounding of each weight to the storage format (2^-11 fp16, 2^-8 bf16)
    tol = 5e-3 if dtype == np.float16 else 3e-2
    np.testing.assert_allclose(y, y_ref, atol=tol * np.abs(y_ref).max())
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx_ref, dx = ref.backward(dy), low.backward(dy)
    assert dx.dtype == np.float32
    np.testing.assert_allclose(dx, dx_ref, atol=tol * np.abs(dx_ref).max())
    for (name, p), p_ref in zip(low.named_parameters(), ref.parameters(), strict=True):
        assert p.data.dtype == dtype and p.grad.dtype == dtype, name
        g = p.grad.astype(np.float32)
        np.testing.assert_allclose(g, p_ref.grad, atol=tol * np.abs(p_ref.grad).max(), err_msg=name)

    lin = Linear(4, 3, rng=0, dtype=dtype)
    lin.forward(np.ones((5, 4), np.float32))
    lin.backward(np.ones((5, 3), np.float32))
    assert lin.weight.grad.dtype == dtype and float(lin.bias.grad[0]) == 5.0

"""Block-sparse attention (zmpi.nn.sparse_attention) against dense attention with the layout's
mask, written here in plain float64 NumPy over the whole T x T matrix; float64 finite
differences; zmpi's dense attention for a layout of all ones; selective recompute's bits."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from gradcheck import check
from mpi_util import REPO_ROOT, STANDIN

from zmpi.nn import attention as A
from zmpi.nn.sparse_attention import (
    sparse_attention_backward,
    sparse_attention_entries,
    sparse_attention_forward,
)


@pytest.fixture
def rng():
    return np.random.default_rng(50)


def random_layout(rng, n_head, nb, density=0.4):
    """Per-head random 0/1 block layouts (n_head, nb, nb): the diagonal kept but in about a
    quarter of the rows, which keep their first block instead; blocks above the diagonal too
    (causal attention must ignore them)."""
    layout = rng.random((n_head, nb, nb)) < density
    diagonal = rng.random((n_head, nb)) < 0.75
    h, i = np.nonzero(diagonal)
    layout[h, i, i] = True
    h, i = np.nonzero(~diagonal)
    layout[h, i, i] = False
    layout[h, i, 0] = True
    return layout.astype(np.uint8)


def masked_attention(qkv, n_head, layout, block, causal, dy):
    """y and dqkv of softmax(q k^T / sqrt(hd) + mask) v, the mask -inf outside the layout's
    blocks (and above the diagonal with causal), per (b, h) over the whole T x T in float64."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    y, dqkv = np.zeros((B, T, C)), np.zeros_like(qkv)
    for h in range(n_head):
        keep = np.kron(layout[h], np.ones((block, block))).astype(bool)
        if causal:
            keep &= np.tri(T, dtype=bool)
        cols = [slice(i * C + h * hd, i * C + (h + 1) * hd) for i in range(3)]
        for b in range(B):
            q, k, v = (qkv[b, :, c] for c in cols)
            s = np.where(keep, q @ k.T / math.sqrt(hd), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            g = dy[b, :, cols[0]]
            y[b, :, cols[0]] = p @ v
            dp = g @ v.T
            ds = p * (dp - (dp * p).sum(-1, keepdims=True))
            dqkv[b, :, cols[0]] = ds @ k / math.sqrt(hd)
            dqkv[b, :, cols[1]] = ds.T @ q / math.sqrt(hd)
            dqkv[b, :, cols[2]] = p.T @ g
    return y, dqkv


CASES = [  # B, n_head, T, block, causal
    (2, 3, 32, 4, True), (1, 2, 48, 8, True), (2, 1, 12, 1, True), (1, 4, 64, 16, True),
    (2, 2, 24, 2, False), (1, 3, 40, 8, False),
]


@pytest.mark.parametrize("B, n_head, T, block, causal", CASES)
def test_equals_dense_attention_with_the_layouts_mask(rng, B, n_head, T, block, causal):
    hd = 4
    qkv = rng.standard_normal((B, T, 3 * n_head * hd))
    layout = random_layout(rng, n_head, T // block)
    dy = rng.standard_normal((B, T, n_head * hd))
    y, cache = sparse_attention_forward(qkv, n_head, layout, block, causal)
    dqkv = sparse_attention_backward(dy, cache)
    y_ref, dqkv_ref = masked_attention(qkv, n_head, layout, block, causal, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dqkv, dqkv_ref, rtol=1e-11, atol=1e-13)
    entries = sum(p[0].size for p in cache[2])  # the probabilities of the first sequence
    assert entries == sparse_attention_entries(layout, block, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_finite_differences(rng, causal):
    n_head, T, block = 2, 12, 3
    qkv = rng.standard_normal((2, T, 3 * n_head * 2))
    layout = random_layout(rng, n_head, T // block)
    dy = rng.standard_normal((2, T, n_head * 2))
    _, cache = sparse_attention_forward(qkv, n_head, layout, block, causal)
    dqkv = sparse_attention_backward(dy, cache)

    def f():
        return float((sparse_attention_forward(qkv, n_head, layout, block, causal)[0] * dy).sum())

    check(f, qkv, dqkv, rng, "qkv")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_layout_of_all_ones_is_dense_attention(rng, dtype):
    """Equal to dense attention to round-off, at the same block of query rows and at dense's
    default block. Not bit for bit: the two group their products into GEMMs of other shapes
    (a gathered block list against whole rows), and OpenBLAS's kernels for those shapes sum
    in other orders on another core (OPENBLAS_CORETYPE=Haswell or Zen: 10,151 of 24,576
    float32 gradients differed, by up to 4.8e-7; SkylakeX: none)."""
    B, n_head, T, hd = 2, 4, 128, 8
    qkv = rng.standard_normal((B, T, 3 * n_head * hd)).astype(dtype)
    dy = rng.standard_normal((B, T, n_head * hd)).astype(dtype)
    rtol = 1e-13 if dtype == np.float64 else 1e-5
    for block in (16, A.ATTENTION_BLOCK, None):  # None: dense's default, 64 rows: 4 of ours
        sparse_block = block or 16
        y, cache = sparse_attention_forward(qkv, n_head,
                                            np.ones((n_head,) + (T // sparse_block,) * 2),
                                            sparse_block)
        dqkv = sparse_attention_backward(dy, cache)
        y_dense, cache_dense = A.attention_forward(qkv, n_head, *([block] if block else []))
        assert y.dtype == dqkv.dtype == dtype
        np.testing.assert_allclose(y, y_dense, rtol=rtol, atol=rtol)
        np.testing.assert_allclose(dqkv, A.attention_backward(dy, cache_dense), rtol=rtol,
                                   atol=rtol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_recomputed_probabilities_give_the_same_bits(rng, dtype):
    n_head, T, block = 3, 64, 8
    qkv = rng.standard_normal((2, T, 3 * n_head * 4)).astype(dtype)
    layout = random_layout(rng, n_head, T // block)
    dy = rng.standard_normal((2, T, n_head * 4)).astype(dtype)
    y, kept = sparse_attention_forward(qkv, n_head, layout, block)
    y2, recomputed = sparse_attention_forward(qkv, n_head, layout, block, keep_probs=False)
    assert recomputed[2] is None and all(p.dtype == dtype for p in kept[2])
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(sparse_attention_backward(dy, kept),
                                  sparse_attention_backward(dy, recomputed))


def test_only_the_kept_blocks_are_computed(rng):
    """A window of 2 blocks plus a global first block: each block row's probabilities span at
    most 3 blocks of keys, never T, and they count what sparse_attention_entries says; float32
    probabilities agree with the float64 reference."""
    n_head, T, block = 2, 256, 16
    nb = T // block
    layout = np.zeros((n_head, nb, nb), bool)
    for i in range(nb):
        layout[:, i, [0, max(0, i - 1), i]] = True
    qkv = rng.standard_normal((1, T, 3 * n_head * 4))
    y, cache = sparse_attention_forward(qkv.astype(np.float32), n_head, layout, block)
    assert all(p.shape[-1] <= 3 * block and p.dtype == np.float32 for p in cache[2])
    assert sum(p.size for p in cache[2]) == sparse_attention_entries(layout, block) == (
        n_head * block**2 * (3 * nb - 3))
    dy = np.zeros((1, T, n_head * 4))
    np.testing.assert_allclose(y, masked_attention(qkv, n_head, layout, block, True, dy)[0],
                               rtol=1e-5, atol=1e-5)


def test_heads_keeping_different_numbers_of_blocks_are_padded(rng):
    """Row 2 keeps 3 blocks in head 0 and 1 in head 1: both compute 3 (head 1's two masked),
    which sparse_attention_entries counts."""
    layout = np.zeros((2, 3, 3), bool)
    layout[:, np.arange(3), np.arange(3)] = True
    layout[0, 2] = True
    assert sparse_attention_entries(layout, 4) == 4**2 * 2 * (1 + 1 + 3)
    assert sparse_attention_entries(layout, 4, causal=False) == 4**2 * 2 * (1 + 1 + 3)
    layout[0, 0, 2] = True  # above the diagonal: counted only when not causal
    assert sparse_attention_entries(layout, 4) == 4**2 * 2 * (1 + 1 + 3)
    assert sparse_attention_entries(layout, 4, causal=False) == 4**2 * 2 * (2 + 1 + 3)
    for causal in (True, False):  # the padding reads a block of its own head
        _, (_, _, _, plan) = sparse_attention_forward(rng.standard_normal((1, 12, 12)), 2,
                                                      layout, 4, causal)
        for index in plan.gather:
            assert np.all(index // 3 == np.arange(2)[:, None]), index


def test_blocks_above_the_diagonal_are_ignored_when_causal(rng):
    n_head, T, block = 2, 32, 4
    layout = random_layout(rng, n_head, T // block, density=0.6)
    qkv = rng.standard_normal((1, T, 3 * n_head * 2))
    y, _ = sparse_attention_forward(qkv, n_head, layout, block)
    y_tril, _ = sparse_attention_forward(qkv, n_head, np.tril(layout), block)
    np.testing.assert_array_equal(y, y_tril)
    changed = qkv.copy()
    changed[:, 9] += 1.0  # a later position changes no earlier output
    y_changed, _ = sparse_attention_forward(changed, n_head, layout, block)
    np.testing.assert_array_equal(y_changed[:, :9], y[:, :9])


@pytest.mark.parametrize("T, layout, message", [
    (30, np.ones((2, 3, 3)), "sequence length 30 is not a positive multiple of "
                             "sparse_attention.block 8"),
    (32, np.ones((2, 3, 3)), r"shape \(2, 3, 3\) for sequence length 32 at block 8: expected "
                             r"\(heads, 4, 4\)"),
    (32, np.ones((1, 4, 4)), "a layout of 1 heads for n_head 2"),
    (32, np.triu(np.ones((2, 4, 4)), 1), r"head 0, query block row 0 \(tokens 0-7\) keeps no "
                                         r"key block \(and 7 more rows\)"),
])
def test_bad_layouts_are_refused_naming_what_is_wrong(T, layout, message):
    """The layout is checked as the layer runs it: under causal, blocks above the diagonal
    do not count (the last case keeps only those)."""
    with pytest.raises(ValueError, match=message):
        sparse_attention_forward(np.zeros((1, T, 3 * 4)), 2, layout, 8)


def test_a_row_without_keys_is_refused_when_not_causal():
    layout = np.ones((2, 4, 4))
    layout[1, 3] = 0
    with pytest.raises(ValueError, match=r"head 1, query block row 3 \(tokens 24-31\) keeps no"):
        sparse_attention_forward(np.zeros((1, 32, 12)), 2, layout, 8, causal=False)


# The same layouts and data on NumPy and on the CuPy stand-in (tests/standin: device arrays
# refuse NumPy operands): whether each output is the same bit for bit.
ON_THE_STANDIN = """
import json, sys
import numpy as np, cupy
sys.path.insert(0, "tests")
from test_sparse_attention import random_layout
from zmpi.nn.sparse_attention import sparse_attention_backward, sparse_attention_forward
rng = np.random.default_rng(0)
out = {}
for causal in (True, False):
    for keep_probs in (True, False):
        qkv, dy = rng.standard_normal((2, 32, 24)), rng.standard_normal((2, 32, 8))
        layout = random_layout(rng, 2, 4)
        y, cache = sparse_attention_forward(qkv, 2, layout, 8, causal, keep_probs)
        dqkv = sparse_attention_backward(dy, cache)
        y_d, cache = sparse_attention_forward(cupy.asarray(qkv), 2, layout, 8, causal, keep_probs)
        dqkv_d = sparse_attention_backward(cupy.asarray(dy), cache)
        out[f"{causal} {keep_probs}"] = [np.array_equal(y_d.get(), y),
                                         np.array_equal(dqkv_d.get(), dqkv)]
print(json.dumps(out))
"""


def test_the_cupy_path_on_the_standin_equals_numpy():
    out = json.loads(subprocess.run([sys.executable, "-c", ON_THE_STANDIN], env=STANDIN,
                                    cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                                    timeout=120).stdout)
    assert len(out) == 4 and all(y and dqkv for y, dqkv in out.values()), out

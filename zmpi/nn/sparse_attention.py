"""Block-sparse self-attention, forward and backward (NumPy or CuPy), in the style of
zmpi.nn.attention: `y, cache = sparse_attention_forward(qkv, n_head, layout, block)`,
`dqkv = sparse_attention_backward(dy, cache)`.

DeepSpeed's Sparse Attention (after Child et al. 2019, "Generating Long Sequences with Sparse
Transformers"): the T x T score matrix is cut into (T/block)^2 blocks of block x block, and a
0/1 layout (n_head, T/block, T/block), one per head (zmpi.nn.sparsity makes them), names the
blocks computed; every other score is -inf. Only the kept blocks are computed, never a T x T
matrix: the queries go one block row at a time, each head's kept key blocks of the row gathered
side by side, so a row is one batched matmul over (B, nh) against m x block keys (m the most
blocks any head keeps in the row; a head that keeps fewer is padded with masked blocks). Work
and memory: B x nh x block^2 x (kept blocks, so padded), O(w T) for a window of w blocks.

The arithmetic is dense attention's (zmpi.nn.attention): q scaled before q k^T, the softmax
in float32 at least, the products in the input dtype, the same dot products in the same order
(dk and dv as the transposes of dense's products), key gradients summed over the block rows
in order; so a layout of all ones gives attention_forward's bits at the same block size (on
this project's BLAS: tests/test_sparse_attention.py checks it). The batched products go
through `kernels.matmul`, as dense attention's: NumPy's matmul on a CPU, one cuBLAS GEMM
without casts on a GPU (CuPy 14.2's own has no bfloat16 batched product). On a GPU each
operation here is a launch per block row (the CuPy path works, about 35 launches a row
forward and backward, but is launch-bound): zmpi.kernels.flash_attention's fused kernels replace the
row loops there (the config's attention_kernel "flash").

Grouped-query attention (n_kv_head key/value heads dividing n_head, query head h reading
key/value head h // (n_head / n_kv_head)): qkv is (B, T, (nh + 2 nkv) hd); each head's key
blocks are gathered from its key/value head by index (the gather is a copy either way), and
the keys' gradients are kept per query head, as for multi-head attention, then summed over
each group once at the end (the heads of a group may keep different blocks, so a row's
scatter cannot add them in place).

Shapes: B batch, T time, C channels, nh heads, nkv key/value heads, hd = C // nh head size,
nb = T // block, g = nh // nkv.
"""
import functools
import math

import numpy

from zmpi import kernels
from zmpi.backend import array_module
from zmpi.kernels.flash_attention import head_size
from zmpi.nn.attention import _head_scales, _softmax_, softmax_backward, split_heads
from zmpi.nn.functional import _f32
from zmpi.nn.sparsity import causal_layout, check_layout


class _Plan:
    """The index arrays of one layout (made once per layout, block, causal and array module).
    For each query block row i, with m_i the most key blocks any head keeps in it:
      gather[i]  (nh, m_i): l * nb + j for each key block j head h keeps, ascending, l = h // g
                 its key/value head (g query heads a group; l = h for multi-head); a head
                 that keeps fewer is padded up to m_i (with its first block), before its
                 diagonal block under causal (the diagonal stays last, as in dense attention)
                 and at the end otherwise;
      scatter[i] (nh, m_i): the same blocks as h * (nb + 1) + j, the padding as h * (nb + 1) +
                 nb, a spare block that takes the padding's zero gradients (so no index
                 repeats within a row);
      pad[i]     (nh, 1, m_i * block) float32: -inf on the padding, 0 elsewhere (None: none);
      future[i]  (nh, block, block) float32, added to the last block of keys: -inf above the
                 diagonal for the heads whose last block is their diagonal one (causal), 0
                 for the others (None: no head's is; rows share equal ones).
    Not a tuple: the activation account (zmpi.nn.base) counts a cache's tuples of arrays."""

    def __init__(self, gather, scatter, pad, future):
        self.gather, self.scatter, self.pad, self.future = gather, scatter, pad, future


def _kept(layout, causal: bool):
    """The layout as bool (nh, nb, nb), intersected with the block-causal mask under causal."""
    return causal_layout(layout) if causal else numpy.asarray(layout, bool)


def sparse_attention_entries(layout, block: int, causal: bool = True) -> int:
    """Score entries per sequence, over all heads, that sparse_attention_forward computes and
    (keep_probs) caches: block^2 x kept blocks (under causal, those on or below the diagonal),
    a row's heads padded to the most blocks any of them keeps there (= kept blocks x block^2
    when every head keeps as many blocks in each row, as without different_layout_per_head).
    What the activation count uses instead of causal_entries' O(T^2)."""
    kept = _kept(layout, causal)
    return block * block * kept.shape[0] * int(kept.sum(axis=-1).max(axis=0).sum())


def _plan(xp, layout, n_head: int, T: int, block: int, causal: bool, group: int) -> _Plan:
    """The _Plan of the layout the layer runs (causal: intersected with the causal mask) for
    `group` query heads a key/value head, checked first (zmpi.nn.sparsity.check_layout:
    ValueError naming what is wrong)."""
    kept = _kept(layout, causal)
    check_layout(kept, T, block)
    if kept.shape[0] != n_head:
        raise ValueError(f"sparse attention: a layout of {kept.shape[0]} heads for "
                         f"n_head {n_head}")
    return _cached_plan(xp, kept.tobytes(), kept.shape, block, causal, group)


@functools.lru_cache(maxsize=16)
def _cached_plan(xp, kept_bytes: bytes, shape, block: int, causal: bool, group: int) -> _Plan:
    kept = numpy.frombuffer(kept_bytes, bool).reshape(shape)
    nh, nb, _ = shape
    triu = numpy.triu(numpy.ones((block, block), bool), k=1)
    futures = {}  # which heads end on their diagonal block -> that row's `future`
    gather, scatter, pad, future = [], [], [], []
    for i in range(nb):
        cols = [numpy.flatnonzero(kept[h, i]) for h in range(nh)]
        m = max(len(c) for c in cols)
        slots = numpy.full((nh, m), -1)  # -1: padding
        diagonal = numpy.array([causal and c[-1] == i for c in cols])
        for h, c in enumerate(cols):
            slots[h, :len(c) - diagonal[h]] = c[:len(c) - diagonal[h]]
            slots[h, m - diagonal[h]:] = c[len(c) - diagonal[h]:]
        padding = slots < 0
        heads, first = numpy.arange(nh)[:, None], numpy.array([c[:1] for c in cols])
        gather.append(xp.asarray(heads // group * nb + numpy.where(padding, first, slots)))
        scatter.append(xp.asarray(heads * (nb + 1) + numpy.where(padding, nb, slots)))
        pad.append(xp.asarray(numpy.repeat(numpy.where(padding, -numpy.inf, 0), block, axis=1)
                              .astype(numpy.float32)[:, None]) if padding.any() else None)
        if diagonal.any() and diagonal.tobytes() not in futures:
            futures[diagonal.tobytes()] = xp.asarray(numpy.where(
                diagonal[:, None, None] & triu, -numpy.inf, 0).astype(numpy.float32))
        future.append(futures[diagonal.tobytes()] if diagonal.any() else None)
    return _Plan(tuple(gather), tuple(scatter), tuple(pad), tuple(future))


def sparse_attention_forward(qkv, n_head, layout, block, causal=True, keep_probs=True,
                             n_kv_head=None):
    """Multi-head block-sparse attention core: y = softmax(q k^T / sqrt(hd) + mask) v, heads
    merged, where the mask is -inf outside the layout's kept blocks (and, with causal, above
    the diagonal: kept blocks above the diagonal are ignored, i.e. the layout is intersected
    with the causal mask, and inside a kept diagonal block a query sees the keys up to itself).

    qkv (B, T, 3C) holding [q | k | v] -> y (B, T, C); with n_kv_head key/value heads (None:
    n_head), qkv (B, T, (nh + 2 nkv) hd) and y (B, T, nh hd), query head h reading key/value
    head h // (n_head / n_kv_head). layout: (n_head, T/block, T/block) 0/1,
    a host NumPy array (its index arrays are made once and cached); every query block row of
    every head must keep a key block (zmpi.nn.sparsity.check_layout's ValueError naming the
    head and row, as for a T not a multiple of block or a layout of the wrong shape).
    cache = (q, kv, probs, plan): q (scaled) (B, nh, nb, block, hd), kv (2, B, nkv * nb, block,
    hd) and probs a tuple, per query block row i, of its probabilities (B, nh, block, m_i *
    block) over its gathered key blocks, float32 at least (sparse_attention_entries counts
    them). keep_probs=False (selective recompute): probs is None and sparse_attention_backward
    recomputes each row's by the same operations, so the gradients are bit for bit the same.
    """
    xp = array_module(qkv)
    B, T, _ = qkv.shape
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    hd = head_size(qkv, n_head, n_kv_head)
    plan = _plan(xp, layout, n_head, T, block, causal, n_head // n_kv_head)
    nb = T // block
    q, kv = _split(qkv, n_head, n_kv_head, hd)
    q = q.reshape(B, n_head, nb, block, hd)
    kv = kv.reshape(2, B, n_kv_head * nb, block, hd)
    y = xp.empty((B, n_head, nb, block, hd), dtype=qkv.dtype)
    probs = []
    for i, k_g, v_g in _gathered(kv, plan):
        att = _row_probs(q[:, :, i], k_g, plan.pad[i], plan.future[i])
        kernels.matmul(att.astype(v_g.dtype, copy=False), v_g, out=y[:, :, i])
        if keep_probs:
            probs.append(att)
    y = y.reshape(B, n_head, T, hd).transpose(0, 2, 1, 3).reshape(B, T, n_head * hd)
    return y, (q, kv, tuple(probs) if keep_probs else None, plan)


def _split(qkv, n_head: int, n_kv_head: int, hd: int):
    """qkv (B, T, (nh + 2 nkv) hd) -> (q (B, nh, T, hd) scaled by 1/sqrt(hd), kv (2, B, nkv, T,
    hd)), contiguous: split_heads' one pass for multi-head attention, else q and kv apart."""
    if n_kv_head == n_head:
        heads = split_heads(qkv, n_head)
        return heads[0], heads[1:]
    xp = array_module(qkv)
    B, T, _ = qkv.shape
    q = xp.empty((B, n_head, T, hd), dtype=qkv.dtype)
    xp.multiply(qkv[..., :n_head * hd].reshape(B, T, n_head, hd).transpose(0, 2, 1, 3),
                _head_scales(xp, qkv.dtype, hd)[0], out=q)
    kv = qkv[..., n_head * hd:].reshape(B, T, 2, n_kv_head, hd).transpose(2, 0, 3, 1, 4)
    return q, xp.ascontiguousarray(kv)


def _gathered(kv, plan):
    """(i, k, v) of each query block row i: its kept key and value blocks side by side,
    (B, nh, m_i * block, hd) each, contiguous copies."""
    _, B, _, block, hd = kv.shape
    for i, index in enumerate(plan.gather):
        g = kv[:, :, index]  # (2, B, nh, m_i, block, hd)
        g = g.reshape(2, B, index.shape[0], index.shape[1] * block, hd)
        yield i, g[0], g[1]


def _row_probs(q_i, k_g, pad, future):
    """Probabilities (B, nh, block, m * block), float32 at least, of query block q_i (B, nh,
    block, hd) (already scaled) against its gathered keys k_g: softmax(q k^T + masks), the
    padding's mask `pad` over all keys, the causal one `future` over the last block."""
    scores = kernels.matmul(q_i, k_g.swapaxes(-1, -2))
    att = scores.astype(_f32(scores), copy=False)  # the softmax runs in f32, in place
    if pad is not None:
        att += pad
    if future is not None:
        att[..., -future.shape[-1]:] += future
    return _softmax_(att)


def sparse_attention_backward(dy, cache):
    """dy (B, T, nh hd) -> dqkv (B, T, (nh + 2 nkv) hd), block row by block row as the forward
    (recomputing
    each row's probabilities when the forward kept none). With q' = q / sqrt(hd), s = q' k^T
    over a row's gathered blocks: dq = (ds k) / sqrt(hd), dk = ds^T q', dv = p^T dy, dk and
    dv summed into their key blocks row after row (in place, by the plan's scatter indices,
    which never repeat a block within a row; as (S, hd) products, so that each block's rows
    are contiguous in both the product and the sum), per query head, then summed over each
    group of g query heads of a key/value head."""
    xp = array_module(dy)
    q, kv, probs, plan = cache
    B, nh, nb, block, hd = q.shape
    T, nkv = nb * block, kv.shape[2] // nb
    dyh = xp.ascontiguousarray(dy.reshape(B, nb, block, nh, hd).transpose(0, 3, 1, 2, 4))
    dqkv = xp.empty((B, nb, block, nh + 2 * nkv, hd), dtype=q.dtype)  # [q | k | v] heads
    dkv = xp.zeros((2, B, nh * (nb + 1), block, hd), dtype=q.dtype)  # + a spare block a head
    for i, k_g, v_g in _gathered(kv, plan):
        q_i, dy_i, m = q[:, :, i], dyh[:, :, i], plan.gather[i].shape[1]
        att = _row_probs(q_i, k_g, plan.pad[i], plan.future[i]) if probs is None else probs[i]
        dv = kernels.matmul(att.astype(dy.dtype, copy=False).swapaxes(-1, -2), dy_i)
        ds = softmax_backward(kernels.matmul(dy_i, v_g.swapaxes(-1, -2)), att)
        xp.multiply(kernels.matmul(ds, k_g).transpose(0, 2, 1, 3), 1.0 / math.sqrt(hd),
                    out=dqkv[:, i, :, :nh])
        dk = kernels.matmul(ds.swapaxes(-1, -2), q_i)  # (B, nh, S, hd)
        for total, d in ((dkv[0], dk), (dkv[1], dv)):
            total[:, plan.scatter[i]] += d.reshape(B, nh, m, block, hd)
    dkv = dkv.reshape(2, B, nh, nb + 1, block, hd)[:, :, :, :nb]
    if nkv < nh:  # each key/value head's: the sum over its query heads
        dkv = dkv.reshape(2, B, nkv, nh // nkv, nb, block, hd).sum(axis=3)
    dqkv[:, :, :, nh:] = dkv.transpose(1, 3, 4, 0, 2, 5).reshape(B, nb, block, 2 * nkv, hd)
    return dqkv.reshape(B, T, (nh + 2 * nkv) * hd)

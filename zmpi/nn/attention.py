"""Causal self-attention, forward and backward (NumPy or CuPy), in the style of
zmpi.nn.functional: `y, cache = attention_forward(qkv, n_head)`, `dqkv = attention_backward(dy,
cache)`. The mask with the softmax, and the softmax's backward, are fused ops (zmpi.kernels):
one CUDA kernel each on a GPU, their `_..._twin` here elsewhere. The products are
`kernels.matmul`: on a GPU, float16 batched GEMMs on tensor cores without casts. Everything
stays in qkv's dtype (float16 on a GPU: the probabilities too, computed in float32 inside the
softmax's kernel); the CPU computes in float32.

Shapes: B batch, T time, C channels, nh heads, hd = C // nh head size.
"""
import functools
import math

import numpy

from zmpi import kernels
from zmpi.backend import array_module
from zmpi.nn.functional import _f32


def _softmax_(a):
    """Softmax over the last axis, in place (max-subtracted, so exp never overflows)."""
    xp = array_module(a)
    a -= a.max(axis=-1, keepdims=True)
    xp.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    return a


# Query rows per block of causal attention on a CPU: a block of queries attends only to the
# keys up to its last row, so the scores above the diagonal blocks are never computed (5/8 of
# the full T x T at T = 256). Measured for GPT-2 d_model 512, 8 heads, T 256, one thread:
# forward + backward 28 ms with the full matrix, 21 ms with blocks of 64 (32: 22 ms, 128:
# 22.5 ms).
ATTENTION_BLOCK = 64
# On a GPU a block costs about 8 launches whatever its size, so the queries go in as few
# blocks as memory allows: as many rows as keep one block's float32 scores within this many
# bytes (all T rows of GPT-2 small at micro-batch 4 and T 1024: 192 MiB).
ATTENTION_BLOCK_BYTES = 256 << 20


def attention_block(T: int, batch_heads: int, on_device: bool) -> int:
    """Query rows per block of causal attention over T positions for batch_heads (B x nh)
    matrices: ATTENTION_BLOCK on a CPU; on a GPU all T rows, or the largest multiple of
    ATTENTION_BLOCK whose float32 scores fit in ATTENTION_BLOCK_BYTES."""
    if not on_device:
        return ATTENTION_BLOCK
    rows = ATTENTION_BLOCK_BYTES // max(1, 4 * batch_heads * T)
    return T if rows >= T else max(ATTENTION_BLOCK, rows // ATTENTION_BLOCK * ATTENTION_BLOCK)


def causal_entries(T: int, block: int) -> int:
    """Score entries causal attention computes per sequence and head over T positions, in
    query blocks of `block` rows each against the keys up to the block's end: the k = T //
    block full blocks, block x (j + 1) block for block j, and the rest r rows against all T."""
    k, r = divmod(T, block)
    return block * block * k * (k + 1) // 2 + r * T


@functools.cache
def _head_scales(xp, dtype, hd: int):
    """(3, 1, 1, 1, 1) array [1/sqrt(hd), 1, 1] in `dtype` in xp's memory: scales q (not k, v)
    as the heads are laid out (made once per dtype and head size)."""
    return xp.asarray(numpy.array([1.0 / math.sqrt(hd), 1.0, 1.0], dtype).reshape(3, 1, 1, 1, 1))


def attention_forward(qkv, n_head, block=None, keep_probs=True):
    """Multi-head causal attention core: y = softmax(q k^T / sqrt(hd) + mask) v, heads merged.

    The heads are batched: every product is one batched matmul over (B, nh). q is scaled by
    1/sqrt(hd) before q k^T (so float16 scores stay in range) as the heads are laid out, in one
    pass. Queries go `block` rows at a time against the keys they may see (`attention_block`:
    64 on a CPU, all T or a few blocks on a GPU); the mask and the softmax are one fused kernel
    on a GPU (`causal_softmax`).

    qkv (B, T, 3C) holding [q | k | v] -> y (B, T, C).  cache = (q, k, v, probs, block), with
    q (scaled), k, v (B, nh, T, hd) and probs a tuple of each block's attention probabilities
    (B, nh, rows, keys up to the block's last row), in qkv's dtype (computed in float32 at
    least). keep_probs=False (selective recompute, Korthikanti et al. 2022): probs is
    None and attention_backward recomputes each block's probabilities from q and k by the
    same operations, so the gradients are bit for bit the same without the O(T^2) cache.
    """
    xp = array_module(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    if block is None:
        block = attention_block(T, B * n_head, xp is not numpy)
    q, k, v = split_heads(qkv, n_head)
    y = xp.empty((B, n_head, T, hd), dtype=v.dtype)
    probs = []
    for start, stop, att in _attention_blocks(q, k, block):
        kernels.matmul(att, v[:, :, :stop], out=y[:, :, start:stop])
        if keep_probs:
            probs.append(att)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return y, (q, k, v, tuple(probs) if keep_probs else None, block)


def split_heads(qkv, n_head):
    """qkv (B, T, 3C) [q | k | v] -> heads (3, B, nh, T, hd): q scaled by 1/sqrt(hd), k, v, each
    contiguous, in one pass (the layout both dense and block-sparse attention compute on)."""
    xp = array_module(qkv)
    B, T, C3 = qkv.shape
    hd = C3 // 3 // n_head
    heads = xp.empty((3, B, n_head, T, hd), dtype=qkv.dtype)
    xp.multiply(qkv.reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4),
                _head_scales(xp, qkv.dtype, hd), out=heads)
    return heads


def _attention_blocks(q, k, block):
    """(start, stop, probabilities (B, nh, stop - start, stop)) of each block of `block` query
    rows: softmax(q k^T) (q already scaled) with the future masked, in q's dtype."""
    T = q.shape[-2]
    for start in range(0, T, block):
        stop = min(start + block, T)
        scores = kernels.matmul(q[:, :, start:stop], k[:, :, :stop].swapaxes(-1, -2))
        yield start, stop, causal_softmax(scores, start)


def causal_softmax(scores, start):
    """Probabilities of scores (B, nh, R, S) whose row i is query position start + i and sees
    keys 0 .. start + i: softmax over those, 0 for the later ones; computed in float32 at
    least (float16 scores never overflow it) and returned in scores' dtype. Fused: one kernel
    on a GPU. `scores` may be overwritten."""
    return _causal_softmax(scores, start)


def _causal_softmax_twin(scores, start):
    xp = array_module(scores)
    att = scores.astype(_f32(scores), copy=False)  # the softmax runs in f32, in place
    rows = att.shape[-2]
    # -inf above the diagonal of the block's last `rows` keys; every row keeps its diagonal,
    # so the row max stays finite
    att[..., start:] += _future_mask(xp, rows, att.dtype)[:, :att.shape[-1] - start]
    return _softmax_(att).astype(scores.dtype, copy=False)


@functools.cache
def _future_mask(xp, rows: int, dtype):
    """(rows, rows): -inf above the diagonal, 0 on and below (made once per size)."""
    return xp.asarray(numpy.where(numpy.triu(numpy.ones((rows, rows), bool), k=1), -numpy.inf,
                                  0.0).astype(dtype))


def softmax_backward(dprobs, probs):
    """dscores = probs (dprobs - sum(dprobs probs)) over the last axis, in dprobs' dtype
    (computed in float32 at least, or probs' dtype if wider). Fused: one kernel on a GPU."""
    return _softmax_backward(dprobs, probs)


def _softmax_backward_twin(dprobs, probs):
    f = array_module(probs).promote_types(_f32(dprobs), probs.dtype)
    d, p = dprobs.astype(f), probs.astype(f, copy=False)  # d: a copy we may overwrite
    d -= (d * p).sum(axis=-1, keepdims=True)
    d *= p
    return d.astype(dprobs.dtype, copy=False)


_causal_softmax = kernels.fused(_causal_softmax_twin, kernels.cuda_causal_softmax)
_softmax_backward = kernels.fused(_softmax_backward_twin, kernels.cuda_softmax_backward)


def backward_blocks(probs, T, block, recomputed):
    """(start, stop, probabilities) of each block of `block` query rows of T, as a backward
    walks them: the forward's kept `probs` (one array a block), or, when it kept none (probs
    None), the generator `recomputed` (which computes nothing until it is iterated)."""
    if probs is None:
        return recomputed
    return ((start, start + att.shape[-2], att)
            for start, att in zip(range(0, T, block), probs, strict=True))


def add_key_grads(sums, parts, stop, T):
    """The running sums over a backward's blocks of the key-side gradients (dk^T, dv^T), each
    (..., hd, T), after adding one block's `parts` (..., hd, stop) over keys [0, stop): `sums`
    None before the first block; a block that covers every key first is the sum itself
    (nothing is added or allocated), else the sums start at zeros. Each add is one kernel
    (`total[..., :stop] += part` would add, then copy the slice onto itself)."""
    if sums is None:
        if stop == T:
            return parts
        sums = array_module(parts[0]).zeros((len(parts), *parts[0].shape[:-1], T),
                                            dtype=parts[0].dtype)
    xp = array_module(sums[0])
    for total, part in zip(sums, parts, strict=True):
        xp.add(total[..., :stop], part, out=total[..., :stop])
    return sums


def attention_backward(dy, cache):
    """dy (B, T, C) -> dqkv (B, T, 3C), block by block as attention_forward (recomputing each
    block's probabilities when the forward kept none). With q' = q / sqrt(hd) and s = q' k^T:
    dq = (ds k) / sqrt(hd), dk = ds^T q', dv = p^T dy; the transposed products are taken as
    (x^T y) of the small operands and transposed back as they are written (CuPy's batched
    matmul copies a non-contiguous operand; a T x T one would be the largest copy)."""
    xp = array_module(dy)
    q, k, v, probs, block = cache
    B, nh, T, hd = q.shape
    dyh = xp.ascontiguousarray(dy.reshape(B, T, nh, hd).transpose(0, 2, 1, 3))  # (B, nh, T, hd)
    dqkv = xp.empty((B, T, 3, nh, hd), dtype=q.dtype)
    sums = None  # (dkT, dvT) (B, nh, hd, T), summed over the blocks
    # att (B, nh, r, s): rows [start, stop) against keys [0, s)
    for start, stop, att in backward_blocks(probs, T, block, _attention_blocks(q, k, block)):
        dy_b = dyh[:, :, start:stop]  # (B, nh, r, hd)
        dvT_b = kernels.matmul(dy_b.swapaxes(-1, -2), att)
        ds = softmax_backward(kernels.matmul(dy_b, v[:, :, :stop].swapaxes(-1, -2)), att)
        dq = kernels.matmul(ds, k[:, :, :stop]).transpose(0, 2, 1, 3)  # (B, r, nh, hd)
        xp.multiply(dq, 1.0 / math.sqrt(hd), out=dqkv[:, start:stop, 0])
        dkT_b = kernels.matmul(q[:, :, start:stop].swapaxes(-1, -2), ds)  # (B, nh, hd, s)
        sums = add_key_grads(sums, (dkT_b, dvT_b), stop, T)
    dkT, dvT = sums
    dqkv[:, :, 1] = dkT.transpose(0, 3, 1, 2)
    dqkv[:, :, 2] = dvT.transpose(0, 3, 1, 2)
    return dqkv.reshape(B, T, 3 * nh * hd)

"""Grouped-query causal attention (Ainslie et al. 2023), forward and backward (NumPy or CuPy),
in the style of zmpi.nn.attention, whose blocked path it extends: `y, cache =
gqa_attention_forward(q, k, v, n_head, n_kv_head)`, `dq, dk, dv = gqa_attention_backward(dy,
cache)`.

n_head query heads share n_kv_head key/value heads (n_kv_head divides n_head; n_kv_head =
n_head is multi-head attention, 1 is multi-query attention): query head h reads key/value
head h // g, g = n_head / n_kv_head (transformers' `repeat_kv` order). The keys and values are
never repeated in memory: the g query heads of a group are stacked as g x rows of one matrix
against their one key matrix, so every product is one batched matmul over (B, n_kv_head), the
causal mask with the softmax is attention's fused op (`causal_softmax`, one kernel on a GPU)
and the keys' and values' gradients sum over their group inside the products. Queries go
`block` rows at a time (`attention_block`) against the keys they may see, as attention's do.

The flash and block-sparse paths (zmpi.kernels.flash_attention, zmpi.nn.sparse_attention)
take q, k and v packed into one array [q | k | v] (B, T, (nh + 2 nkv) hd): `pack_qkv` writes
it (rotating q and k on the way), `unpack_dqkv` takes its gradient apart (rotating back).

Rotary position embeddings (zmpi.nn.llama_functional), when given as the tables of the
positions the rows hold, rotate q and k per head after the heads are split, and their
gradients back before they are merged.

Shapes: B batch, T time, nh = n_head, nkv = n_kv_head, hd head size, g = nh / nkv.
"""
import math

import numpy

from zmpi import kernels
from zmpi.backend import array_module
from zmpi.nn.attention import (
    add_key_grads,
    attention_block,
    backward_blocks,
    causal_softmax,
    softmax_backward,
)
from zmpi.nn.checks import check_int
from zmpi.nn.llama_functional import rope_backward, rope_forward


def _heads(x, n, rope, scale=None):
    """x (B, T, n hd) -> its heads (B, n, T, hd), C-contiguous, rotated by rope's tables
    (cos, sin) when given, times `scale` when given."""
    xp = array_module(x)
    B, T, _ = x.shape
    xh = x.reshape(B, T, n, -1).transpose(0, 2, 1, 3)
    out = xp.ascontiguousarray(xh) if rope is None else rope_forward(xh, *rope)
    if scale is not None:
        out *= scale
    return out


def _merged(xh, rope=None):
    """Heads (B, n, T, hd) -> (B, T, n hd), rotated back by rope's tables when given (the
    gradient of `_heads`), in one pass into the merged layout."""
    xp = array_module(xh)
    B, n, T, hd = xh.shape
    out = xp.empty((B, T, n, hd), dtype=xh.dtype)
    if rope is None:
        out[...] = xh.transpose(0, 2, 1, 3)
    else:
        rope_backward(xh, *rope, out=out.transpose(0, 2, 1, 3))
    return out.reshape(B, T, n * hd)


def check_heads(d_model: int, n_head: int, n_kv_head: int) -> None:
    """ValueError unless d_model, n_head and n_kv_head are integers >= 1, n_head divides
    d_model and n_kv_head divides n_head."""
    for name, value in (("d_model", d_model), ("n_head", n_head), ("n_kv_head", n_kv_head)):
        check_int(name, value, 1)
    if d_model % n_head:
        raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}")
    if n_head % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} does not divide n_head={n_head}: each "
                         "key/value head serves a whole group of query heads")


def gqa_attention_forward(q, k, v, n_head, n_kv_head, rope=None, block=None, keep_probs=True):
    """y = softmax(q k^T / sqrt(hd) + causal mask) v per query head, against its group's key
    and value head; heads merged.

    q (B, T, nh hd), k, v (B, T, nkv hd), one dtype -> y (B, T, nh hd) in it. rope: (cos,
    sin) tables (T, hd/2) in that dtype for the rows' positions (rope_tables), or None.
    cache = (q, k, v, probs, block): q rotated and scaled by 1/sqrt(hd) (B, nh, T, hd), k
    rotated and v (B, nkv, T, hd), probs each block's probabilities (B, nkv, g, rows, keys up
    to the block's last row), or None with keep_probs=False (selective recompute: backward
    recomputes them from q and k by the same operations, the same gradients bit for bit).
    """
    xp = array_module(q)
    B, T, _ = q.shape
    hd = q.shape[-1] // n_head
    if block is None:
        block = attention_block(T, B * n_head, xp is not numpy)
    qh = _heads(q, n_head, rope, q.dtype.type(1.0 / math.sqrt(hd)))
    kh, vh = _heads(k, n_kv_head, rope), _heads(v, n_kv_head, None)
    g = n_head // n_kv_head
    y = xp.empty((B, n_kv_head, g, T, hd), dtype=vh.dtype)
    probs = []
    for start, stop, att in _blocks(qh, kh, block):  # att (B, nkv, g, r, stop)
        r = stop - start
        y_b = kernels.matmul(att.reshape(B, n_kv_head, g * r, stop), vh[:, :, :stop])
        y[:, :, :, start:stop] = y_b.reshape(B, n_kv_head, g, r, hd)
        if keep_probs:
            probs.append(att)
    y = y.reshape(B, n_head, T, hd).transpose(0, 2, 1, 3).reshape(B, T, n_head * hd)
    return y, (qh, kh, vh, tuple(probs) if keep_probs else None, block)


def _group_rows(qh, n_kv_head, start, stop):
    """Query rows [start, stop) of every head of each group stacked: (B, nkv, g r, hd) (a view
    when g = 1 or the rows are all T, else a copy)."""
    B, nh, T, hd = qh.shape
    g = nh // n_kv_head
    return qh.reshape(B, n_kv_head, g, T, hd)[:, :, :, start:stop].reshape(
        B, n_kv_head, g * (stop - start), hd)


def _blocks(qh, kh, block):
    """(start, stop, probabilities (B, nkv, g, stop - start, stop)) of each block of `block`
    query rows of every head: softmax(q k^T) (q already scaled) with the future masked."""
    B, nh, T, _ = qh.shape
    nkv = kh.shape[1]
    for start in range(0, T, block):
        stop = min(start + block, T)
        scores = kernels.matmul(_group_rows(qh, nkv, start, stop),
                                kh[:, :, :stop].swapaxes(-1, -2))  # (B, nkv, g r, stop)
        yield start, stop, causal_softmax(
            scores.reshape(B, nkv, nh // nkv, stop - start, stop), start)


def gqa_attention_backward(dy, cache, rope=None):
    """dy (B, T, nh hd) -> (dq (B, T, nh hd), dk, dv (B, T, nkv hd)), block by block as the
    forward (recomputing each block's probabilities when it kept none), `rope` the forward's
    tables. With q' = q / sqrt(hd) and s = q' k^T per query head: dq = (ds k) / sqrt(hd),
    dk = sum over the group of ds^T q', dv = sum over the group of p^T dy; the transposed
    products are taken as (x^T y) of the small operands, as attention_backward does."""
    xp = array_module(dy)
    qh, kh, vh, probs, block = cache
    B, nh, T, hd = qh.shape
    nkv = kh.shape[1]
    g = nh // nkv
    dyh = xp.ascontiguousarray(dy.reshape(B, T, nh, hd).transpose(0, 2, 1, 3))
    dq = xp.empty((B, nkv, g, T, hd), dtype=qh.dtype)
    sums = None  # (dkT, dvT) (B, nkv, hd, T), summed over the blocks
    for start, stop, att in backward_blocks(probs, T, block, _blocks(qh, kh, block)):
        r = stop - start
        p = att.reshape(B, nkv, g * r, stop)
        dy_b = _group_rows(dyh, nkv, start, stop)  # (B, nkv, g r, hd)
        dvT_b = kernels.matmul(dy_b.swapaxes(-1, -2), p)  # (B, nkv, hd, stop)
        ds = softmax_backward(kernels.matmul(dy_b, vh[:, :, :stop].swapaxes(-1, -2)), p)
        dq_b = kernels.matmul(ds, kh[:, :, :stop])  # (B, nkv, g r, hd)
        xp.multiply(dq_b.reshape(B, nkv, g, r, hd), 1.0 / math.sqrt(hd),
                    out=dq[:, :, :, start:stop])
        dkT_b = kernels.matmul(_group_rows(qh, nkv, start, stop).swapaxes(-1, -2), ds)
        sums = add_key_grads(sums, (dkT_b, dvT_b), stop, T)
    dkT, dvT = sums
    return (_merged(dq.reshape(B, nh, T, hd), rope), _merged(dkT.swapaxes(-1, -2), rope),
            _merged(dvT.swapaxes(-1, -2)))


def pack_qkv(q, k, v, n_head, n_kv_head, rope=None):
    """The flash and block-sparse paths' input: q (B, T, nh hd), k, v (B, T, nkv hd) -> qkv
    (B, T, (nh + 2 nkv) hd) [q | k | v], a new array, q and k rotated by rope's tables (cos,
    sin) (T, hd/2) when given, written in place into it (one pass each)."""
    xp = array_module(q)
    B, T, _ = q.shape
    hd = q.shape[-1] // n_head
    qkv = xp.empty((B, T, (n_head + 2 * n_kv_head) * hd), dtype=q.dtype)
    for x, part, rotate in zip((q, k, v), _parts(qkv, n_head, n_kv_head, hd), (1, 1, 0),
                               strict=True):
        if rope is None or not rotate:
            part[...] = x
        else:
            rope_forward(_as_heads(x, hd), *rope, out=_as_heads(part, hd))
    return qkv


def unpack_dqkv(dqkv, n_head, n_kv_head, rope=None):
    """The gradient of pack_qkv: dqkv (B, T, (nh + 2 nkv) hd) -> (dq (B, T, nh hd), dk, dv
    (B, T, nkv hd)), dq and dk rotated back by rope's tables when given (new arrays; views of
    dqkv where nothing rotates)."""
    xp = array_module(dqkv)
    hd = dqkv.shape[-1] // (n_head + 2 * n_kv_head)
    out = []
    for part, rotate in zip(_parts(dqkv, n_head, n_kv_head, hd), (1, 1, 0), strict=True):
        if rope is None or not rotate:
            out.append(part)
        else:
            grad = xp.empty(part.shape, dtype=part.dtype)
            rope_backward(_as_heads(part, hd), *rope, out=_as_heads(grad, hd))
            out.append(grad)
    return tuple(out)


def _parts(qkv, n_head, n_kv_head, hd):
    """The views q (B, T, nh hd), k, v (B, T, nkv hd) of a packed qkv."""
    nq, nkv = n_head * hd, n_kv_head * hd
    return qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]


def _as_heads(x, hd):
    """x (B, T, n hd), possibly a strided view of its last axis -> the view (B, n, T, hd) that
    rope_forward rotates along T."""
    B, T, width = x.shape
    return x.reshape(B, T, width // hd, hd).transpose(0, 2, 1, 3)

"""zmpi.cuda_flash_source's kernels run in Python on a machine without a GPU (a test helper):
each function below is one kernel, its grid of thread blocks walked in loops, and each block's
statements in FLASH_SOURCE's order with its index arithmetic on flat arrays (the same offsets
into qkv, y, dy, dqkv, lse and delta, the same CSR walk, the same tile skips and masks), the
loops over a tile's threads written as array operations over the tile. What it checks is the
kernels' control flow and indexing (which tiles meet, which scores count, where each value
lands), against the twin; NVRTC checks that the C++ compiles, and only a GPU runs it.
"""
import math

import numpy as np

from zmpi import kernels


def _load(flat, offset, stride, r0, seq, S, hd, mul, acc):
    """flash_load: rows r0 .. r0 + S of a head (element offset + row * stride + d), zero past
    seq, times mul."""
    tile = np.zeros((S, hd), acc)
    for r in range(S):
        if r0 + r < seq:
            start = offset + (r0 + r) * stride
            tile[r] = flat[start:start + hd].astype(acc) * mul
    return tile


def _list(ptr, h, layout_heads, nb, i):
    p = ptr[(0 if layout_heads == 1 else h) * (nb + 1):]
    return range(p[i], p[i + 1])


def _shape(qkv, n_head):
    B, seq, C3 = qkv.shape
    C = C3 // 3
    return B, seq, C, C // n_head, kernels.acc_dtype(qkv.dtype)


def forward(qkv, layout, n_head, S):
    """flash_forward over its grid (nb block / S, B nh): (y, lse)."""
    B, seq, C, hd, acc = _shape(qkv, n_head)
    block, nb, lh = layout.block, layout.nb, layout.heads
    scale = acc.type(1 / math.sqrt(hd))
    flat = qkv.ravel()
    y = np.full(B * seq * C, np.nan, qkv.dtype)
    lse = np.full(B * n_head * seq, np.nan, acc)
    c_idx = np.arange(S)
    for bh in range(B * n_head):
        b, h = divmod(bh, n_head)
        base = b * seq * 3 * C + h * hd
        for q0 in range(0, nb * block, S):
            q = _load(flat, base, 3 * C, q0, seq, S, hd, scale, acc)
            o = np.zeros((S, hd), acc)
            m = np.full(S, -np.inf, acc)
            total = np.zeros(S, acc)
            for n in _list(layout.row_ptr.ravel(), h, lh, nb, q0 // block):
                j = layout.cols[n]
                for k0 in range(j * block, (j + 1) * block, S):
                    if k0 > q0 + S - 1 or k0 >= seq:
                        continue
                    k = _load(flat, base + C, 3 * C, k0, seq, S, hd, 1, acc)
                    v = _load(flat, base + 2 * C, 3 * C, k0, seq, S, hd, 1, acc)
                    keep = ((k0 + c_idx[None] <= q0 + c_idx[:, None])
                            & (k0 + c_idx[None] < seq))
                    p = np.where(keep, q @ k.T, -np.inf)
                    m_new = np.maximum(m, p.max(axis=1))
                    m_use = np.where(m_new == -np.inf, 0, m_new).astype(acc)
                    p = np.exp(p - m_use[:, None])
                    alpha = np.exp(m - m_use)
                    total = total * alpha + p.sum(axis=1)
                    m = m_new
                    o = o * alpha[:, None] + p @ v
            for r in range(S):
                if q0 + r < seq:
                    start = (b * seq + q0 + r) * C + h * hd
                    y[start:start + hd] = o[r] / total[r]
                    lse[bh * seq + q0 + r] = m[r] + np.log(total[r])
    return y.reshape(B, seq, C), lse.reshape(B, n_head, seq)


def backward(dy, qkv, y, lse, layout, n_head, S_dq, S_dkv):
    """flash_backward_dq then flash_backward_dkv over their grids: dqkv."""
    B, seq, C, hd, acc = _shape(qkv, n_head)
    block, nb, lh = layout.block, layout.nb, layout.heads
    scale = acc.type(1 / math.sqrt(hd))
    flat, dy_flat, y_flat, lse = qkv.ravel(), dy.ravel(), y.ravel(), lse.ravel()
    dqkv = np.full(B * seq * 3 * C, np.nan, qkv.dtype)
    delta = np.full(B * n_head * seq, np.nan, acc)
    for bh in range(B * n_head):  # flash_backward_dq
        b, h = divmod(bh, n_head)
        base, row0, S = b * seq * 3 * C + h * hd, b * seq * C + h * hd, S_dq
        c_idx = np.arange(S)
        for q0 in range(0, nb * block, S):
            q = _load(flat, base, 3 * C, q0, seq, S, hd, scale, acc)
            g = _load(dy_flat, row0, C, q0, seq, S, hd, 1, acc)
            dq = np.zeros((S, hd), acc)
            d_rows = (g * _load(y_flat, row0, C, q0, seq, S, hd, 1, acc)).sum(axis=1)
            rows = q0 + c_idx
            lse_rows = np.where(rows < seq, lse[bh * seq + np.minimum(rows, seq - 1)], 0)
            delta[bh * seq + rows[rows < seq]] = d_rows[rows < seq]
            for n in _list(layout.row_ptr.ravel(), h, lh, nb, q0 // block):
                j = layout.cols[n]
                for k0 in range(j * block, (j + 1) * block, S):
                    if k0 > q0 + S - 1 or k0 >= seq:
                        continue
                    k = _load(flat, base + C, 3 * C, k0, seq, S, hd, 1, acc)
                    v = _load(flat, base + 2 * C, 3 * C, k0, seq, S, hd, 1, acc)
                    keep = ((k0 + c_idx[None] <= rows[:, None]) & (k0 + c_idx[None] < seq)
                            & (rows[:, None] < seq))
                    p = np.where(keep, np.exp(np.where(keep, q @ k.T, 0) - lse_rows[:, None]),
                                 0)
                    dq += (p * (g @ v.T - d_rows[:, None])) @ k
            for r in range(S):
                if q0 + r < seq:
                    start = (b * seq + q0 + r) * 3 * C + h * hd
                    dqkv[start:start + hd] = dq[r] * scale
    for bh in range(B * n_head):  # flash_backward_dkv
        b, h = divmod(bh, n_head)
        base, row0, S = b * seq * 3 * C + h * hd, b * seq * C + h * hd, S_dkv
        c_idx = np.arange(S)
        for k0 in range(0, nb * block, S):
            k = _load(flat, base + C, 3 * C, k0, seq, S, hd, 1, acc)
            v = _load(flat, base + 2 * C, 3 * C, k0, seq, S, hd, 1, acc)
            dk, dv = np.zeros((2, S, hd), acc)
            for n in _list(layout.col_ptr.ravel(), h, lh, nb, k0 // block):
                i = layout.rows[n]
                for q0 in range(i * block, (i + 1) * block, S):
                    if q0 + S - 1 < k0 or q0 >= seq or k0 >= seq:
                        continue
                    q = _load(flat, base, 3 * C, q0, seq, S, hd, scale, acc)
                    g = _load(dy_flat, row0, C, q0, seq, S, hd, 1, acc)
                    rows = q0 + c_idx
                    inside = np.minimum(rows, seq - 1)
                    lse_rows = np.where(rows < seq, lse[bh * seq + inside], 0)
                    d_rows = np.where(rows < seq, delta[bh * seq + inside], 0)
                    keep = ((k0 + c_idx[None] <= rows[:, None]) & (k0 + c_idx[None] < seq)
                            & (rows[:, None] < seq))
                    p = np.where(keep, np.exp(np.where(keep, q @ k.T, 0) - lse_rows[:, None]),
                                 0)
                    ds = p * (g @ v.T - d_rows[:, None])
                    dv += p.T @ g
                    dk += ds.T @ q
            for c in range(S):
                if k0 + c < seq:
                    start = (b * seq + k0 + c) * 3 * C + h * hd
                    dqkv[start + C:start + C + hd] = dk[c]
                    dqkv[start + 2 * C:start + 2 * C + hd] = dv[c]
    return dqkv.reshape(B, seq, 3 * C)

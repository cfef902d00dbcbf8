"""Pure forward/backward kernels (NumPy or CuPy), in the style of llm.c's train_gpt2.c.

Each op is a pair: `y, cache = op_forward(...)` returns the output and exactly what backward
needs; `grads = op_backward(dy, cache)` returns the gradients of the inputs (it never
accumulates: the layers do that). Kernels run in the dtype of their inputs; callers pass arrays
already in the compute dtype. The array module comes from the inputs (`array_module`), so the
same code runs on CuPy.

Caches that hold a parameter keep it as the *last* tuple entry, e.g. linear's `(x, W)`: a layer
keeps only the activations and passes the parameter it reads at backward time, so ZeRO-3 may
release and re-gather the parameter between forward and backward.

Shapes: B batch, T time, C channels, V vocabulary, nh heads, hd = C // nh head size.
"""

import math

from zmpi.backend import array_module

# -- linear -----------------------------------------------------------------------------------


def linear_forward(x, W, b=None):
    """y = x @ W + b.  x (..., Cin), W (Cin, Cout), b (Cout,) or None -> y (..., Cout).

    cache = (x, W).
    """
    y = (x.reshape(-1, x.shape[-1]) @ W).reshape(*x.shape[:-1], W.shape[1])  # (..., Cout)
    if b is not None:
        y += b
    return y, (x, W)


def linear_backward(dy, cache):
    """dy (..., Cout) -> dx (..., Cin), dW (Cin, Cout), db (Cout,) (a layer without bias
    ignores db)."""
    x, W = cache
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # (N, Cin), (N, Cout)
    dx = (dy2 @ W.T).reshape(x.shape)  # (..., Cin)
    dW = x2.T @ dy2  # (Cin, Cout)
    db = dy2.sum(axis=0)  # (Cout,)
    return dx, dW, db


# -- embedding --------------------------------------------------------------------------------


def check_indices(idx, n: int, what: str, ignore=None) -> None:
    """TypeError unless `idx` holds integers, IndexError unless each is in [0, n) (or equals
    `ignore`): an out-of-range id must never wrap around (NumPy reads W[-1] as the last row)."""
    xp = array_module(idx)
    if not xp.issubdtype(idx.dtype, xp.integer):
        raise TypeError(f"{what} must be integer ids in [0, {n}), got dtype {idx.dtype}")
    if idx.size == 0:
        return
    # ignored entries count as 0 (a valid id), not dropped: a boolean gather syncs a GPU
    valid = idx if ignore is None else xp.where(idx != ignore, idx, 0)
    lo, hi = xp.stack([valid.min(), valid.max()]).tolist()  # one device -> host transfer
    if lo < 0 or hi >= n:
        raise IndexError(f"{what} must be in [0, {n})"
                         + (f" or {ignore}" if ignore is not None else "")
                         + f", found {lo if lo < 0 else hi} (min {lo}, max {hi})")


def embedding_forward(idx, W, check: bool = True):
    """y = W[idx].  idx (...) int in [0, V), W (V, C) -> y (..., C).  cache = (idx, V).
    check=False skips `check_indices` (one device sync) for ids known to be in range."""
    if check:
        check_indices(idx, W.shape[0], "embedding indices")
    return W[idx], (idx, W.shape[0])


def embedding_backward(dy, cache):
    """dy (..., C) -> dW (V, C): rows scatter-added, so repeated indices sum."""
    idx, V = cache
    xp = array_module(dy)
    C = dy.shape[-1]
    dW = xp.zeros((V, C), dtype=dy.dtype)
    xp.add.at(dW, idx.reshape(-1), dy.reshape(-1, C))
    return dW


# -- layernorm --------------------------------------------------------------------------------


def _f32(x):
    """The dtype normalisation, softmax, GELU and the loss run in: float32 at least (float64
    stays). Mixed precision as users know it: matmuls may run in float16, these never do
    (float16 overflows in x^2 for |x| > 256 and in GELU's x^3 for |x| > 40)."""
    return array_module(x).promote_types(x.dtype, "float32")


def layernorm_forward(x, w, b, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis (biased variance), computed
    in float32 at least and returned in x's dtype, in two buffers of x's size.

    x (..., C), w (C,), b (C,) -> y (..., C).  cache = (xhat, rstd, w), float32 at least.
    """
    xp, f = array_module(x), _f32(x)
    x32 = x.astype(f, copy=False)
    mean = x32.mean(axis=-1, keepdims=True)  # (..., 1)
    xhat = x32 - mean  # centred here, normalised below
    y = xhat * xhat  # first the squares, then the output
    rstd = 1.0 / xp.sqrt(y.mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    xhat *= rstd  # (..., C)
    xp.multiply(xhat, w.astype(f, copy=False), out=y)
    y += b.astype(f, copy=False)
    return y.astype(x.dtype, copy=False), (xhat, rstd, w)


def layernorm_backward(dy, cache):
    """dy (..., C) -> dx (..., C) in dy's dtype, dw (C,), db (C,) (float32 at least).

    With g = dy * w: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), the three terms being
    the direct path and the paths through mean and variance (llm.c doc/layernorm/layernorm.md).
    Two buffers of dy's size.
    """
    xhat, rstd, w = cache
    xp, C = array_module(xhat), dy.shape[-1]
    dy32 = dy.astype(xhat.dtype, copy=False)
    t = dy32 * xhat  # (..., C): first dy * xhat, then g * xhat, then xhat * mean(g * xhat)
    dw = t.reshape(-1, C).sum(axis=0)  # (C,)
    db = dy32.reshape(-1, C).sum(axis=0)  # (C,)
    g = dy32 * w.astype(xhat.dtype, copy=False)  # (..., C), becomes dx
    xp.multiply(g, xhat, out=t)
    m = t.mean(axis=-1, keepdims=True)
    xp.multiply(xhat, m, out=t)
    g -= g.mean(axis=-1, keepdims=True)
    g -= t
    g *= rstd
    return g.astype(dy.dtype, copy=False), dw, db


# -- gelu -------------------------------------------------------------------------------------

_GELU_S = math.sqrt(2.0 / math.pi)


def _pieces(n, xp):
    """Slices of [0, n) for a chain of elementwise ufuncs: on a CPU, pieces small enough that
    the chain's operands stay in the core's cache between ufuncs (NumPy runs each ufunc over
    the whole array, so a chain of k over arrays larger than the cache streams memory k
    times); on a GPU, one piece."""
    step = _CHAIN_PIECE if xp.__name__ == "numpy" else max(n, 1)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


# Elements per piece of an elementwise chain: GELU forward on 2 M float32 elements, one thread,
# took 4.2 ms whole and 2.7 ms in pieces of 64 Ki (16 Ki: 3.1, 256 Ki: 2.8).
_CHAIN_PIECE = 1 << 16


def gelu_forward(x):
    """GELU, tanh approximation as GPT-2: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
    computed in float32 at least and returned in x's dtype, piece by piece (`_pieces`) in
    two buffers of x's size.

    x (...) -> y (...).  cache = (x, tanh(u)), u the tanh's argument (backward reuses it).
    """
    xp = array_module(x)
    x32 = x.astype(_f32(x), copy=False).reshape(-1)
    t, y = xp.empty_like(x32), xp.empty_like(x32)
    for piece in _pieces(x32.size, xp):
        xs, ts, ys = x32[piece], t[piece], y[piece]
        xp.multiply(xs, xs, out=ts)
        ts *= 0.044715
        ts += 1.0
        ts *= xs
        ts *= _GELU_S  # u = sqrt(2/pi) x (1 + 0.044715 x^2)
        xp.tanh(ts, out=ts)
        xp.add(ts, 1.0, out=ys)
        ys *= xs
        ys *= 0.5
    return y.reshape(x.shape).astype(x.dtype, copy=False), (x, t.reshape(x.shape))


def gelu_backward(dy, cache):
    """dy (...) -> dx (...) in dy's dtype: dy (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx), with
    du/dx = sqrt(2/pi) (1 + 3 0.044715 x^2), computed in float32 at least, piece by piece."""
    x, t = cache
    xp = array_module(t)
    x, t = x.astype(t.dtype, copy=False).reshape(-1), t.reshape(-1)
    d = dy.astype(t.dtype, copy=False).reshape(-1)
    g = xp.empty_like(t)
    pieces = _pieces(t.size, xp)
    scratch = xp.empty(pieces[0].stop if pieces else 0, dtype=t.dtype)
    for piece in pieces:
        xs, ts, gs = x[piece], t[piece], g[piece]
        s = scratch[:gs.size]
        xp.multiply(xs, xs, out=gs)
        gs *= 3 * 0.044715
        gs += 1.0
        gs *= 0.5 * _GELU_S
        gs *= xs  # 0.5 x du/dx
        xp.multiply(ts, ts, out=s)
        s *= -1.0
        s += 1.0  # 1 - t^2
        gs *= s
        gs += 0.5
        xp.multiply(ts, 0.5, out=s)
        gs += s  # 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx
        gs *= d[piece]
    return g.reshape(dy.shape).astype(dy.dtype, copy=False)


# -- causal self-attention --------------------------------------------------------------------


def _softmax_(a):
    """Softmax over the last axis, in place (max-subtracted, so exp never overflows)."""
    xp = array_module(a)
    a -= a.max(axis=-1, keepdims=True)
    xp.exp(a, out=a)
    a /= a.sum(axis=-1, keepdims=True)
    return a


# Query rows per block of causal attention: a block of queries attends only to the keys up to
# its last row, so the scores above the diagonal blocks are never computed (5/8 of the full
# T x T at T = 256). Measured for GPT-2 d_model 512, 8 heads, T 256, one thread: forward +
# backward 28 ms with the full matrix, 21 ms with blocks of 64 (32: 22 ms, 128: 22.5 ms).
ATTENTION_BLOCK = 64


def attention_forward(qkv, n_head, block=ATTENTION_BLOCK, keep_probs=True):
    """Multi-head causal attention core: y = softmax(q k^T / sqrt(hd) + mask) v, heads merged,
    computed `block` query rows at a time against the keys they may see.

    qkv (B, T, 3C) holding [q | k | v] -> y (B, T, C).  cache = (q, k, v, probs, block), with
    q, k, v (B, nh, T, hd) and probs a tuple of each block's attention probabilities
    (B, nh, rows, keys up to the block's last row), float32 at least (the softmax never runs
    in float16). keep_probs=False (selective recompute, Korthikanti et al. 2022): probs is
    None and attention_backward recomputes each block's probabilities from q and k by the
    same operations, so the gradients are bit for bit the same without the O(T^2) cache.
    """
    xp = array_module(qkv)
    B, T, C3 = qkv.shape
    C = C3 // 3
    hd = C // n_head
    qkv = qkv.reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4)  # (3, B, nh, T, hd)
    q, k, v = qkv[0], qkv[1], qkv[2]
    y = xp.empty((B, n_head, T, hd), dtype=v.dtype)
    probs = []
    for start, stop, att in _attention_blocks(q, k, block):
        y[:, :, start:stop] = xp.matmul(att.astype(v.dtype, copy=False), v[:, :, :stop])
        if keep_probs:
            probs.append(att)
    y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return y, (q, k, v, tuple(probs) if keep_probs else None, block)


def _attention_blocks(q, k, block):
    """(start, stop, probabilities (B, nh, stop - start, stop)) of each block of `block` query
    rows: softmax(q k^T / sqrt(hd)) with the future masked, in float32 at least."""
    xp = array_module(q)
    T, hd = q.shape[-2], q.shape[-1]
    # -inf above the diagonal of a diagonal block; every row keeps its diagonal, so the row
    # max stays finite
    rows = min(block, T)
    future = xp.where(xp.triu(xp.ones((rows, rows), dtype=bool), k=1), -xp.inf, 0.0)
    for start in range(0, T, block):
        stop = min(start + block, T)
        att = xp.matmul(q[:, :, start:stop], k[:, :, :stop].swapaxes(-1, -2))  # (B, nh, r, s)
        att = att.astype(_f32(att), copy=False)  # the softmax runs in f32
        att *= 1.0 / math.sqrt(hd)
        att[..., start:] += future[:stop - start, :stop - start].astype(att.dtype)
        _softmax_(att)
        yield start, stop, att


def attention_backward(dy, cache):
    """dy (B, T, C) -> dqkv (B, T, 3C), block by block as attention_forward (recomputing each
    block's probabilities when the forward kept none)."""
    xp = array_module(dy)
    q, k, v, probs, block = cache
    B, nh, T, hd = q.shape
    dy = dy.reshape(B, T, nh, hd).transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    dqkv = xp.zeros((3, B, nh, T, hd), dtype=q.dtype)
    dq, dk, dv = dqkv[0], dqkv[1], dqkv[2]
    blocks = _attention_blocks(q, k, block) if probs is None else (
        (start, start + att.shape[-2], att)
        for start, att in zip(range(0, T, block), probs, strict=True))
    for start, stop, att in blocks:  # (B, nh, r, s): rows [start, stop) against keys [0, s)
        keys = att.shape[-1]
        dy_b = dy[:, :, start:stop]  # (B, nh, r, hd)
        datt = xp.matmul(dy_b, v[:, :, :keys].swapaxes(-1, -2)).astype(att.dtype, copy=False)
        # att^T dy as (dy^T att)^T: the transposed operand is the small (hd, r) one (CuPy's
        # batched matmul copies a non-contiguous operand; NumPy's does not)
        dv[:, :, :keys] += xp.matmul(dy_b.swapaxes(-1, -2),
                                     att.astype(dy.dtype, copy=False)).swapaxes(-1, -2)
        # softmax backward, in datt's buffer: dpre = att * (datt - sum(datt * att)); masked
        # entries have att = 0
        datt -= (datt * att).sum(axis=-1, keepdims=True)
        datt *= att
        datt *= 1.0 / math.sqrt(hd)
        dpre = datt.astype(q.dtype, copy=False)  # back to the matmul dtype
        dq[:, :, start:stop] = xp.matmul(dpre, k[:, :, :keys])
        dk[:, :, :keys] += xp.matmul(q[:, :, start:stop].swapaxes(-1, -2), dpre).swapaxes(-1, -2)
    return dqkv.transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * nh * hd)


# -- softmax cross-entropy --------------------------------------------------------------------


def cross_entropy_forward(logits, targets, ignore_index=None, normalizer=None):
    """Sum over counted positions of -log softmax(logits)[target], divided by `normalizer`
    (default: the number of counted positions, i.e. the mean, as PyTorch's reduction="mean").

    logits (..., V) float, targets (...) int -> loss (0-d array, float32 or float64).
    Positions whose target equals `ignore_index` (e.g. -100) do not count and get no gradient.
    Runs in float32 at least (float64 logits stay float64). cache = (probs (N, V), targets
    (N,), mask (N,) or None, normalizer, shape of logits).
    """
    xp = array_module(logits)
    dtype = xp.promote_types(logits.dtype, xp.float32)
    shape = logits.shape
    V = shape[-1]
    z = logits.reshape(-1, V).astype(dtype)  # (N, V), a copy we may overwrite
    targets = xp.asarray(targets).reshape(-1)  # (N,)
    check_indices(targets, V, "cross-entropy targets", ignore_index)
    mask = None if ignore_index is None else targets != ignore_index
    if mask is not None:
        targets = xp.where(mask, targets, 0)  # any valid index; masked out below
    if normalizer is None:
        normalizer = targets.shape[0] if mask is None else max(int(mask.sum()), 1)
    z -= z.max(axis=-1, keepdims=True)  # log-softmax without overflow
    lse = xp.log(xp.exp(z).sum(axis=-1))  # (N,)
    per_position = lse - z[xp.arange(z.shape[0]), targets]
    if mask is not None:
        per_position = per_position * mask
    loss = per_position.sum() / dtype.type(normalizer)
    probs = xp.exp(z - lse[:, None])  # (N, V)
    return loss, (probs, targets, mask, normalizer, shape)


def cross_entropy_backward(cache, dloss=1.0):
    """dlogits (..., V) = dloss * (softmax(logits) - onehot(targets)) / normalizer, zero at
    ignored positions, in the loss dtype."""
    xp = array_module(cache[0])
    probs, targets, mask, normalizer, shape = cache
    dlogits = probs.copy()  # (N, V)
    dlogits[xp.arange(dlogits.shape[0]), targets] -= 1.0
    dlogits *= dloss / normalizer
    if mask is not None:
        dlogits *= mask[:, None]
    return dlogits.reshape(shape)


def mse_forward(outputs, targets, normalizer=None):
    """Sum of (outputs - targets)^2 divided by `normalizer` (default: outputs.size, the mean,
    as PyTorch's MSELoss). outputs, targets: same shape, float -> loss (0-d array, float32 at
    least). cache = (outputs - targets, normalizer)."""
    xp = array_module(outputs)
    dtype = xp.promote_types(outputs.dtype, xp.float32)
    targets = xp.asarray(targets)
    if targets.shape != outputs.shape:
        raise ValueError(f"MSE targets have shape {targets.shape}, outputs {outputs.shape}")
    diff = outputs.astype(dtype) - targets.astype(dtype)
    normalizer = diff.size if normalizer is None else normalizer
    return (diff * diff).sum() / dtype.type(normalizer), (diff, normalizer)


def mse_backward(cache, dloss=1.0):
    """doutputs = dloss * 2 (outputs - targets) / normalizer, in the loss dtype."""
    diff, normalizer = cache
    return diff * (2.0 * dloss / normalizer)

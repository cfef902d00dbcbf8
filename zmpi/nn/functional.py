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

Causal self-attention is zmpi.nn.attention. Fused ops (zmpi.kernels): LayerNorm, GELU and the
cross-entropy run as one or two CUDA kernels on a GPU; the functions named `_..._twin` here are
what the CPU and the CuPy stand-in run in their place (and what a GPU runs op by op under
"kernels": "composed").
"""

import math
from contextlib import contextmanager

import numpy

from zmpi import kernels
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


def linear_backward(dy, cache, dW=None, db=None):
    """dy (..., Cout) -> dx (..., Cin), dW (Cin, Cout), db (Cout,) (a layer without bias
    ignores db). dW, db: arrays of dy's dtype to write those two into (the parameters'
    gradients, `parameter.grad_out`: no extra pass), or None."""
    x, W = cache
    xp = array_module(dy)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # (N, Cin), (N, Cout)
    dx = (dy2 @ W.T).reshape(x.shape)  # (..., Cin)
    dW = xp.matmul(x2.T, dy2, out=dW)  # (Cin, Cout)
    db = _bias_grad(dy2, db)  # (Cout,)
    return dx, dW, db


def _written(a, out, dtype):
    """a in `dtype`, written into `out` when it is given."""
    if out is None:
        return a.astype(dtype, copy=False)
    out[...] = a
    return out


def _bias_grad_twin(dy, out):
    """The column sums of dy (N, C), accumulated in float32 at least, in dy's dtype (into
    `out` when given): a bias's gradient (one kernel on a GPU, `kernels.cuda_bias_grad`)."""
    return _written(dy.sum(axis=0, dtype=_f32(dy)), out, dy.dtype)


_bias_grad = kernels.fused(_bias_grad_twin, kernels.cuda_bias_grad)


# -- embedding --------------------------------------------------------------------------------


_ids_checked = [False]


@contextmanager
def ids_checked():
    """Within it, `check_indices` checks only the dtype of device arrays, not their range (a
    device -> host transfer each): the caller has checked every id of the step on the host
    (the engine, through UnitModel.check_batch). Host arrays are always checked in full."""
    before, _ids_checked[0] = _ids_checked[0], True
    try:
        yield
    finally:
        _ids_checked[0] = before


def check_indices(idx, n: int, what: str, ignore=None) -> None:
    """TypeError unless `idx` holds integers, IndexError unless each is in [0, n) (or equals
    `ignore`): an out-of-range id must never wrap around (NumPy reads W[-1] as the last row,
    CuPy wraps every index). The range check of a device array is one device -> host transfer,
    skipped inside `ids_checked()`."""
    xp = array_module(idx)
    if not xp.issubdtype(idx.dtype, xp.integer):
        raise TypeError(f"{what} must be integer ids in [0, {n}), got dtype {idx.dtype}")
    if idx.size == 0 or (_ids_checked[0] and xp is not numpy):
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
    """dy (..., C) -> dW (V, C), float32 at least: rows scatter-added, so repeated indices sum
    (a token seen a thousand times in a float16 run sums in float32, not float16)."""
    idx, V = cache
    xp = array_module(dy)
    C = dy.shape[-1]
    dW = xp.zeros((V, C), dtype=_f32(dy))
    xp.add.at(dW, idx.reshape(-1), dy.reshape(-1, C).astype(dW.dtype, copy=False))
    return dW


# -- layernorm --------------------------------------------------------------------------------


def _f32(x):
    """The dtype normalisation, softmax, GELU and the loss run in: float32 at least (float64
    stays). Mixed precision as users know it: matmuls may run in float16, these never do
    (float16 overflows in x^2 for |x| > 256 and in GELU's x^3 for |x| > 40)."""
    return array_module(x).promote_types(x.dtype, "float32")


def layernorm_forward(x, w, b, eps=1e-5):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis (biased variance), computed
    in float32 at least and returned in x's dtype. Fused: one kernel on a GPU.

    x (..., C), w (C,), b (C,) -> y (..., C).  cache = (xhat, rstd, w), float32 at least.
    """
    return _layernorm_forward(x, w, b, eps)


def layernorm_backward(dy, cache, dw=None, db=None):
    """dy (..., C) -> dx (..., C), dw (C,), db (C,), all in dy's dtype (computed in float32 at
    least: dw and db are rounded once, as they are written). dw, db: arrays of dy's dtype to
    write those two into (the parameters' gradients, `parameter.grad_out`), or None.

    With g = dy * w: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), the three terms being
    the direct path and the paths through mean and variance (llm.c doc/layernorm/layernorm.md).
    Fused: dx in one kernel on a GPU, the column sums of dw and db in a second, written by a
    third that sums its partials.
    """
    return _layernorm_backward(dy, cache, dw, db)


def _layernorm_forward_twin(x, w, b, eps):
    """layernorm_forward in two buffers of x's size."""
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


def _layernorm_backward_twin(dy, cache, dw_out, db_out):
    """layernorm_backward in two buffers of dy's size."""
    xhat, rstd, w = cache
    xp, C = array_module(xhat), dy.shape[-1]
    dy32 = dy.astype(xhat.dtype, copy=False)
    t = dy32 * xhat  # (..., C): first dy * xhat, then g * xhat, then xhat * mean(g * xhat)
    dw = _written(t.reshape(-1, C).sum(axis=0), dw_out, dy.dtype)  # (C,)
    db = _written(dy32.reshape(-1, C).sum(axis=0), db_out, dy.dtype)  # (C,)
    g = dy32 * w.astype(xhat.dtype, copy=False)  # (..., C), becomes dx
    xp.multiply(g, xhat, out=t)
    m = t.mean(axis=-1, keepdims=True)
    xp.multiply(xhat, m, out=t)
    g -= g.mean(axis=-1, keepdims=True)
    g -= t
    g *= rstd
    return g.astype(dy.dtype, copy=False), dw, db


_layernorm_forward = kernels.fused(_layernorm_forward_twin, kernels.cuda_layernorm_forward)
_layernorm_backward = kernels.fused(_layernorm_backward_twin, kernels.cuda_layernorm_backward,
                                    launches=3)


# -- gelu -------------------------------------------------------------------------------------

_GELU_S = math.sqrt(2.0 / math.pi)


def _pieces(n, xp, width=1):
    """Slices of [0, n) for a chain of elementwise ufuncs over rows of `width` elements: on a
    CPU, pieces of about _CHAIN_PIECE elements, small enough that the chain's operands stay in
    the core's cache between ufuncs (NumPy runs each ufunc over the whole array, so a chain of
    k over arrays larger than the cache streams memory k times); on a GPU, one piece."""
    step = max(1, _CHAIN_PIECE // max(width, 1)) if xp.__name__ == "numpy" else max(n, 1)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


# Elements per piece of an elementwise chain: GELU forward on 2 M float32 elements, one thread,
# took 4.2 ms whole and 2.7 ms in pieces of 64 Ki (16 Ki: 3.1, 256 Ki: 2.8).
_CHAIN_PIECE = 1 << 16


def gelu_forward(x):
    """GELU, tanh approximation as GPT-2: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
    computed in float32 at least and returned in x's dtype. Fused: one kernel on a GPU.

    x (...) -> y (...).  cache = (x, tanh(u)), u the tanh's argument (backward reuses it).
    """
    return _gelu_forward(x)


def gelu_backward(dy, cache):
    """dy (...) -> dx (...) in dy's dtype: dy (0.5 (1 + t) + 0.5 x (1 - t^2) du/dx), with
    du/dx = sqrt(2/pi) (1 + 3 0.044715 x^2), computed in float32 at least. Fused: one
    kernel on a GPU."""
    return _gelu_backward(dy, cache)


def _gelu_forward_twin(x):
    """gelu_forward piece by piece (`_pieces`), in two buffers of x's size."""
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


def _gelu_backward_twin(dy, cache):
    """gelu_backward piece by piece."""
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


_gelu_forward = kernels.fused(_gelu_forward_twin, kernels.cuda_gelu_forward)
_gelu_backward = kernels.fused(_gelu_backward_twin, kernels.cuda_gelu_backward)


# -- softmax cross-entropy --------------------------------------------------------------------


def mask_padding(logits, real: int):
    """`logits` (..., Vp) with its columns from `real` on (a padded vocabulary's) set to -inf,
    in place, and returned: a softmax over them, and so the cross-entropy and sampling, gives
    them probability exactly 0 and the loss's gradient there is exactly 0. One strided fill, or
    nothing when there is no padding."""
    if real < logits.shape[-1]:
        logits[..., real:] = -numpy.inf
    return logits


def cross_entropy_forward(logits, targets, ignore_index=None, normalizer=None):
    """Sum over counted positions of -log softmax(logits)[target], divided by `normalizer`
    (default: the number of counted positions, i.e. the mean, as PyTorch's reduction="mean").

    logits (..., V) float, targets (...) int -> loss (0-d array, float32 or float64).
    Positions whose target equals `ignore_index` (e.g. -100) do not count and get no gradient.
    Runs in float32 at least (float64 logits stay float64), one pass over the logits (a fused
    kernel on a GPU) that keeps only each row's log-sum-exp: backward recomputes the softmax
    from the logits, so no (N, V) float32 array is ever made. cache = (logits (N, V), lse (N,),
    targets (N,) int64, ignore_index, normalizer, shape of logits).
    """
    xp = array_module(logits)
    shape = logits.shape
    V = shape[-1]
    z = logits.reshape(-1, V)  # (N, V)
    targets = xp.asarray(targets).reshape(-1)  # (N,)
    check_indices(targets, V, "cross-entropy targets", ignore_index)
    targets = targets.astype(xp.int64, copy=False)
    if normalizer is None:
        normalizer = targets.shape[0] if ignore_index is None else \
            max(int((targets != ignore_index).sum()), 1)
    per_position, lse = _cross_entropy_rows(z, targets, ignore_index, 1.0 / normalizer)
    return per_position.sum(), (z, lse, targets, ignore_index, normalizer, shape)


def cross_entropy_backward(cache, dloss=1.0):
    """dlogits (..., V) = dloss * (softmax(logits) - onehot(targets)) / normalizer, zero at
    ignored positions, in the logits' dtype (computed in float32 at least)."""
    z, lse, targets, ignore_index, normalizer, shape = cache
    return _cross_entropy_grad(z, lse, targets, ignore_index, dloss / normalizer).reshape(shape)


def _cross_entropy_rows_twin(z, targets, ignore_index, inv_normalizer):
    """(loss per row * inv_normalizer, log-sum-exp per row), float32 at least, 0 loss where
    the target is ignore_index. z (N, V), targets (N,) int64."""
    xp = array_module(z)
    f = _f32(z)
    N = z.shape[0]
    loss, lse = xp.empty(N, f), xp.empty(N, f)
    for rows in _pieces(N, xp, z.shape[1]):
        zs = z[rows].astype(f)  # (n, V), a copy we may overwrite
        t = targets[rows]
        m = zs.max(axis=1, keepdims=True)
        zs -= m  # log-softmax without overflow
        ignored = None if ignore_index is None else t == ignore_index
        zt = zs[xp.arange(zs.shape[0]), t if ignored is None else xp.where(ignored, 0, t)]
        xp.exp(zs, out=zs)
        lse_s = xp.log(zs.sum(axis=1))  # of the shifted logits
        loss_s = (lse_s - zt) * f.type(inv_normalizer)
        loss[rows] = loss_s if ignored is None else xp.where(ignored, 0, loss_s)
        lse[rows] = lse_s + m[:, 0]
    return loss, lse


def _cross_entropy_grad_twin(z, lse, targets, ignore_index, scale):
    """(exp(z - lse) - onehot(targets)) * scale in z's dtype, 0 on ignored rows."""
    xp = array_module(z)
    dz = xp.empty_like(z)
    for rows in _pieces(z.shape[0], xp, z.shape[1]):
        g = z[rows].astype(lse.dtype)  # a copy we may overwrite
        g -= lse[rows, None]
        xp.exp(g, out=g)
        t = targets[rows]
        ignored = None if ignore_index is None else t == ignore_index
        g[xp.arange(g.shape[0]), t if ignored is None else xp.where(ignored, 0, t)] -= 1.0
        g *= lse.dtype.type(scale)
        if ignored is not None:
            g *= ~ignored[:, None]
        dz[rows] = g
    return dz


_cross_entropy_rows = kernels.fused(_cross_entropy_rows_twin, kernels.cuda_cross_entropy_rows)
_cross_entropy_grad = kernels.fused(_cross_entropy_grad_twin, kernels.cuda_cross_entropy_grad)


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

"""Pure kernels of the Llama family's layers (NumPy or CuPy), in the style of
zmpi.nn.functional: `y, cache = op_forward(...)`, `grads = op_backward(dy, cache)`; a backward
returns gradients and never accumulates (the layers do, zmpi.nn.llama_layers).

    rmsnorm       y = x / sqrt(mean(x^2) + eps) * w  (Zhang & Sennrich 2019: no mean, no bias)
    swiglu        silu(g) * u, the gating of the SwiGLU feed-forward (Shazeer 2020)
    rope          rotary position embeddings (Su et al. 2021): the inverse frequencies with
                  rope_theta and transformers' "linear" and "llama3" scaling, the cos/sin
                  tables of global positions [offset, offset + T), and the rotation

Everything runs in the array module of its inputs; normalisation and the gating compute in
float32 at least (float64 stays) and return their input's dtype, as zmpi.nn.functional's
LayerNorm and GELU. The six forward and backward ops are fused ops (zmpi.kernels.fused, the
same switch as the GPT's LayerNorm and GELU): on a GPU under "fused" each is one CUDA kernel
(RMSNorm's backward three: dx, and dw's column sums in two), zmpi.kernels.llama's launchers of
rmsnorm.cu, rope.cu and swiglu.cu, which compute in float32 (float64 for float64) and round
once as they write; NumPy, the stand-in and "composed" run the `_..._twin` functions here.

RoPE layout: transformers' (`rotate_half`), not the original interleaved one: in a head of
size hd, channel i < hd/2 and channel i + hd/2 form the pair rotated by the angle p * f_i at
position p, f_i = inv_freq[i]:

    y[i]        = x[i] cos(p f_i) - x[i + hd/2] sin(p f_i)
    y[i + hd/2] = x[i + hd/2] cos(p f_i) + x[i] sin(p f_i)

The rotation is orthogonal, so its backward is the rotation by the opposite angle.
"""

import math

import numpy

from zmpi import kernels
from zmpi.backend import array_module
from zmpi.kernels import llama as K
from zmpi.nn.checks import check_int, check_number
from zmpi.nn.functional import _f32, _written

# -- rmsnorm ----------------------------------------------------------------------------------


def rmsnorm_forward(x, w, eps):
    """y = x * rstd * w over the last axis, rstd = 1 / sqrt(mean(x^2) + eps), computed in
    float32 at least and returned in x's dtype. Fused: one kernel on a GPU.

    x (..., C), w (C,) -> y (..., C).  cache = (xhat, rstd, w): xhat = x * rstd (..., C) and
    rstd (..., 1) in float32 at least; w last (read again at backward time by the layer).
    """
    return _rmsnorm_forward(x, w, eps)


def rmsnorm_backward(dy, cache, dw=None):
    """dy (..., C) -> dx (..., C), dw (C,), in dy's dtype (computed in float32 at least). dw:
    an array of dy's dtype to write the weight's gradient into (`parameter.grad_out`), or None.

    With g = dy * w: dx = rstd * (g - xhat * mean(g * xhat)) (the direct path and the path
    through rstd; RMSNorm has no mean to subtract, unlike LayerNorm). Fused: dx in one kernel
    on a GPU, dw's column sums in a second, written by a third that sums its partials."""
    return _rmsnorm_backward(dy, cache, dw)


def _rmsnorm_forward_twin(x, w, eps):
    """rmsnorm_forward as array operations (the CPU's path, and "composed")."""
    xp, f = array_module(x), _f32(x)
    x32 = x.astype(f, copy=False)
    rstd = (x32 * x32).mean(axis=-1, keepdims=True)  # (..., 1)
    rstd += eps
    xp.sqrt(rstd, out=rstd)
    xp.divide(1.0, rstd, out=rstd)
    xhat = x32 * rstd
    y = xhat * w.astype(f, copy=False)
    return y.astype(x.dtype, copy=False), (xhat, rstd, w)


def _rmsnorm_backward_twin(dy, cache, dw):
    """rmsnorm_backward as array operations, in the order its kernels take the products."""
    xhat, rstd, w = cache
    C = dy.shape[-1]
    dy32 = dy.astype(xhat.dtype, copy=False)
    t = dy32 * xhat  # (..., C): first dy * xhat, then g * xhat, then xhat * mean(g * xhat)
    dw = _written(t.reshape(-1, C).sum(axis=0), dw, dy.dtype)
    g = dy32 * w.astype(xhat.dtype, copy=False)  # becomes dx
    xp = array_module(t)
    xp.multiply(g, xhat, out=t)
    xp.multiply(xhat, t.mean(axis=-1, keepdims=True), out=t)
    g -= t
    g *= rstd
    return g.astype(dy.dtype, copy=False), dw


_rmsnorm_forward = kernels.fused(_rmsnorm_forward_twin, K.cuda_rmsnorm_forward)
_rmsnorm_backward = kernels.fused(_rmsnorm_backward_twin, K.cuda_rmsnorm_backward, launches=3)


# -- swiglu -----------------------------------------------------------------------------------


def _sigmoid(x):
    """1 / (1 + exp(-x)) as 0.5 (1 + tanh(x / 2)): no overflow for any finite x."""
    xp = array_module(x)
    s = xp.multiply(x, 0.5)
    xp.tanh(s, out=s)
    s += 1.0
    s *= 0.5
    return s


def swiglu_forward(g, u):
    """silu(g) * u = g * sigmoid(g) * u, computed in float32 at least and returned in g's dtype.
    Fused: one kernel on a GPU.

    g, u (..., H) of one shape (the gate's and the up projection's outputs; a ValueError
    otherwise) -> y (..., H). cache = (g, u) as given (backward recomputes the sigmoid).
    """
    if g.shape != u.shape:
        raise ValueError(f"swiglu takes a gate and an up projection of one shape, got {g.shape} "
                         f"and {u.shape}")
    return _swiglu_forward(g, u)


def swiglu_backward(dy, cache):
    """dy (..., H) -> (dg, du) in dy's dtype: du = dy silu(g), dg = dy u silu'(g) with
    silu'(g) = s (1 + g (1 - s)), s = sigmoid(g); computed in float32 at least. Fused: one
    kernel on a GPU."""
    return _swiglu_backward(dy, cache)


def _swiglu_forward_twin(g, u):
    """swiglu_forward, the sigmoid as `_sigmoid`, then times g, then times u."""
    f = _f32(g)
    g32 = g.astype(f, copy=False)
    y = _sigmoid(g32)
    y *= g32
    y *= u.astype(f, copy=False)
    return y.astype(g.dtype, copy=False), (g, u)


def _swiglu_backward_twin(dy, cache):
    """swiglu_backward, in the order its kernel takes the products."""
    g, u = cache
    f = _f32(dy)
    g32, dy32 = g.astype(f, copy=False), dy.astype(f, copy=False)
    s = _sigmoid(g32)
    du = dy32 * g32
    du *= s  # dy silu(g)
    dg = 1.0 - s
    dg *= g32
    dg += 1.0
    dg *= s  # silu'(g)
    dg *= dy32
    dg *= u.astype(f, copy=False)
    return dg.astype(dy.dtype, copy=False), du.astype(dy.dtype, copy=False)


_swiglu_forward = kernels.fused(_swiglu_forward_twin, K.cuda_swiglu_forward)
_swiglu_backward = kernels.fused(_swiglu_backward_twin, K.cuda_swiglu_backward)


# -- rope -------------------------------------------------------------------------------------

# transformers' rope_scaling types zmpi implements, and the keys each takes besides
# "rope_type" ("type" is its older spelling)
ROPE_SCALING_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}


def _refuse(what: str, value, expected: str):
    raise ValueError(f"{what} must be {expected}, got {value!r}")


def rope_scaling_type(scaling) -> str:
    """The rope_type of a transformers `rope_scaling` dict (None: "default"), checked: a
    ValueError naming the key for an unknown type, a missing or unknown key, or a bad value
    (a factor below 1, which transformers only warns of, is refused; so is a llama3
    high_freq_factor not above its low_freq_factor, which would divide by zero or less)."""
    if scaling is None:
        return "default"
    if not isinstance(scaling, dict):
        _refuse("rope_scaling", scaling, "None or a dict with a 'rope_type'")
    keys = dict(scaling)
    if "rope_type" in keys and "type" in keys and keys["rope_type"] != keys["type"]:
        raise ValueError(f"rope_scaling names two types: rope_type {keys['rope_type']!r} and "
                         f"type {keys['type']!r}")
    kind = keys.pop("rope_type", keys.pop("type", None))  # both popped
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        _refuse("rope_scaling.rope_type", kind,
                "one of " + ", ".join(map(repr, ROPE_SCALING_KEYS)))
    expected = ROPE_SCALING_KEYS[kind]
    missing = [k for k in expected if k not in keys]
    unknown = sorted(k for k in keys if k not in expected)
    if missing or unknown:
        raise ValueError(f"rope_scaling of type {kind!r} takes {list(expected) or 'no keys'}: "
                         + (f"missing {missing}" if missing else f"unknown {unknown}"))
    if kind != "default":
        check_number("rope_scaling.factor", keys["factor"], 1.0, strict=False)
    if kind == "llama3":
        low = check_number("rope_scaling.low_freq_factor", keys["low_freq_factor"], 0.0, True)
        high = check_number("rope_scaling.high_freq_factor", keys["high_freq_factor"], 0.0, True)
        if high <= low:
            raise ValueError(f"rope_scaling.high_freq_factor ({high:g}) must be greater than "
                             f"low_freq_factor ({low:g})")
        check_int("rope_scaling.original_max_position_embeddings",
                  keys["original_max_position_embeddings"], 1)
    return kind


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling=None) -> numpy.ndarray:
    """The rotation frequencies f_i of a head of size head_dim (even), float64 (hd/2,):
    f_i = theta^(-2i / hd), then scaled as transformers' `rope_scaling` says (None: not):

      linear  f_i / factor (positions interpolated: position p turns as p / factor did)
      llama3  Llama 3.1's: with wavelength w_i = 2 pi / f_i and the original context L,
              f_i where w_i < L / high_freq_factor (high frequencies kept), f_i / factor where
              w_i > L / low_freq_factor (low frequencies interpolated), and between them
              (1 - a) f_i / factor + a f_i with a = (L / w_i - low) / (high - low).

    transformers computes these in float32; here they are float64, rounded once where used.
    """
    if check_int("the head size of rotary embeddings", head_dim, 2) % 2:
        _refuse("the head size of rotary embeddings", head_dim, "even")
    theta = check_number("rope_theta", theta, 0.0, strict=True)
    kind = rope_scaling_type(scaling)
    inv_freq = 1.0 / theta ** (numpy.arange(0, head_dim, 2, dtype=numpy.float64) / head_dim)
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    a = (context / wavelength - low) / (high - low)  # 0 at the low end, 1 at the high end
    return numpy.where(wavelength < context / high, inv_freq,
                       numpy.where(wavelength > context / low, inv_freq / factor,
                                   (1 - a) * inv_freq / factor + a * inv_freq))


def rope_tables(inv_freq, T: int, offset: int = 0):
    """(cos, sin), each (T, hd/2) float64 on the host, of the angles p * inv_freq for the
    global positions p = offset .. offset + T - 1 (a rank holding a chunk of a sequence that
    starts at `offset` rotates its positions as the whole sequence would)."""
    angles = numpy.outer(numpy.arange(offset, offset + T, dtype=numpy.float64), inv_freq)
    return numpy.cos(angles), numpy.sin(angles)


def rope_forward(x, cos, sin, out=None):
    """x (..., T, hd) rotated pairwise (the module docstring's layout) by the angles whose
    cosines and sines are cos, sin (T, hd/2), in x's dtype (the tables should be in it too):
    into `out` (an array of x's shape, possibly a strided view) if given, else a new
    C-contiguous array. No cache: the backward needs only the tables. Fused: one kernel on a
    GPU, x and `out` read and written through their strides (zmpi.kernels.llama's
    cuda_rope_forward: a head layout taken as a transposed view is not copied). Tables of
    another shape, or an `out` of another shape, are a ValueError."""
    _check_rope(x, cos, sin, out)
    return _rope_forward(x, cos, sin, out)


def rope_backward(dy, cos, sin, out=None):
    """The gradient of rope_forward: dy rotated by the opposite angles (the transpose of an
    orthogonal rotation is its inverse), as rope_forward takes its arguments. Fused: one
    kernel on a GPU."""
    _check_rope(dy, cos, sin, out)
    return _rope_backward(dy, cos, sin, out)


def _check_rope(x, cos, sin, out):
    want = (*x.shape[-2:-1], x.shape[-1] // 2)
    if x.ndim < 2 or x.shape[-1] % 2 or cos.shape != want or sin.shape != want:
        raise ValueError(f"rotary embeddings take x (..., T, hd), hd even, and tables cos, sin "
                         f"(T, hd/2), got x {x.shape}, cos {cos.shape}, sin {sin.shape}")
    if out is not None and out.shape != x.shape:
        raise ValueError(f"rotary embeddings write an out of x's shape {x.shape}, got "
                         f"{out.shape}")


def _rope_forward_twin(x, cos, sin, out):
    """rope_forward in x's dtype, four products and two sums."""
    xp = array_module(x)
    h = x.shape[-1] // 2
    y = xp.empty(x.shape, dtype=x.dtype) if out is None else out
    x1, x2, y1, y2 = x[..., :h], x[..., h:], y[..., :h], y[..., h:]
    xp.multiply(x1, cos, out=y1)
    y1 -= x2 * sin
    xp.multiply(x2, cos, out=y2)
    y2 += x1 * sin
    return y


def _rope_backward_twin(dy, cos, sin, out):
    """rope_backward: rope_forward's twin with the sines negated."""
    return _rope_forward_twin(dy, cos, -sin, out)


_rope_forward = kernels.fused(_rope_forward_twin, K.cuda_rope_forward, strided=True)
_rope_backward = kernels.fused(_rope_backward_twin, K.cuda_rope_backward, strided=True)

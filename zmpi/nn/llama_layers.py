"""The Llama family's layers (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024), thin
Modules over the kernels of zmpi.nn.llama_functional and zmpi.nn.gqa, under the contract of
zmpi.nn.layers: `forward` keeps exactly what `backward` needs (never a parameter array),
`backward` returns the input gradient and accumulates into each `p.grad`, a backward without
its forward raises RuntimeError; parameters are read at call time, computed in
`compute_dtype(p.data)`; NumPy or CuPy alike; no MPI.

    RMSNorm                 x / sqrt(mean(x^2) + eps) * weight; weight (C,) starts at 1
    SwiGLU                  down(silu(gate x) * up x), three Linears without bias
    RotaryEmbedding         rope_theta and transformers' rope_scaling ("linear", "llama3"):
                            the cos/sin tables of global positions (not a Module: no state)
    GroupedQueryAttention   causal attention of n_head query heads over n_kv_head key/value
                            heads, RoPE on q and k at positions offset .. offset + T - 1;
                            q, k, v and o Linears without bias

Parameter names follow transformers' LlamaForCausalLM where they can (gate, up, down; q, k, v,
o for its q_proj, k_proj, v_proj, o_proj), with weights (in, out) as zmpi's Linear keeps
them: the transpose of torch's (out, in). Init as transformers' Llama: every weight
normal(0, std = 0.02) (`proj_std` for the two that write the residual stream, o and down, as
the GPT's layers take it), RMSNorm weights 1.

RMSNorm, RoPE and SwiGLU's gating are fused ops (zmpi.nn.llama_functional): one CUDA kernel
each way on a GPU under the config's "kernels": "fused", as the GPT's LayerNorm and GELU. The
model is models/llama.py.
"""

import numpy

from zmpi.backend import array_module
from zmpi.nn import gqa as G
from zmpi.nn import llama_functional as L
from zmpi.nn.layers import AttentionPaths, Linear, constant_parameter
from zmpi.nn.module import Module
from zmpi.nn.parameter import accumulate_grad_, compute_data, grad_out


def _check_input(x, width: int, what: str, ndim: int | None = None) -> None:
    """ValueError unless x's last axis is `width` long (and x has `ndim` axes, if given)."""
    if x.shape[-1:] != (width,) or ndim is not None and x.ndim != ndim:
        axes = "(B, T, C)" if ndim == 3 else "(..., C)"
        raise ValueError(f"{what} takes inputs {axes} with C = {width}, got shape {x.shape}")


class RMSNorm(Module):
    """Root-mean-square normalisation over the last axis (Zhang & Sennrich 2019), as Llama's:
    y = x / sqrt(mean(x^2) + eps) * weight, no mean subtracted, no bias.  x (..., C) ->
    y (..., C). eps: transformers' rms_norm_eps (1e-6 by default, as LlamaConfig's)."""

    def __init__(self, dim, eps=1e-6, dtype=numpy.float32):
        self.dim = L.check_int("RMSNorm dim", dim, 1)
        self.eps = L.check_number("RMSNorm eps", eps, 0.0, strict=True)
        self.weight = constant_parameter((dim,), 1.0, dtype)

    def forward(self, x):
        _check_input(x, self.dim, "RMSNorm")
        w = compute_data(self.weight)
        y, (xhat, rstd, _) = L.rmsnorm_forward(x.astype(w.dtype, copy=False), w, self.eps)
        self._save(xhat, rstd)
        return y

    def backward(self, dy):
        xhat, rstd = self._pop()
        dx, dw = L.rmsnorm_backward(dy, (xhat, rstd, compute_data(self.weight)),
                                    grad_out(self.weight, dy.dtype))
        accumulate_grad_(self.weight, dw)  # nothing left to do when written into the grad
        return dx


class SwiGLU(Module):
    """The SwiGLU feed-forward (Shazeer 2020), as Llama's MLP: down(silu(gate x) * up x).
    x (..., C) -> (..., C). gate, up: Linear (C, hidden); down: Linear (hidden, C); no biases.
    hidden is transformers' intermediate_size (about 8/3 C in Llama, rounded up).
    Tensor parallelism (zmpi.parallel.tensor.plan): gate and up column-parallel, down
    row-parallel, as Megatron-LM's MLP."""

    tp_plan = {"gate": "colwise", "up": "colwise", "down": "rowwise"}

    def __init__(self, d_model, hidden, rng=None, dtype=numpy.float32, std=0.02,
                 proj_std=None):
        L.check_int("SwiGLU d_model", d_model, 1)
        L.check_int("SwiGLU hidden", hidden, 1)
        rng = numpy.random.default_rng(rng)
        self.d_model = d_model
        self.gate = Linear(d_model, hidden, bias=False, rng=rng, dtype=dtype, std=std)
        self.up = Linear(d_model, hidden, bias=False, rng=rng, dtype=dtype, std=std)
        self.down = Linear(hidden, d_model, bias=False, rng=rng, dtype=dtype,
                           std=std if proj_std is None else proj_std)

    def forward(self, x):
        _check_input(x, self.d_model, "SwiGLU")
        a, cache = L.swiglu_forward(self.gate.forward(x), self.up.forward(x))
        self._save(cache)
        return self.down.forward(a)

    def backward(self, dy):
        cache = self._pop()
        dg, du = L.swiglu_backward(self.down.backward(dy), cache)
        dx = self.gate.backward(dg)
        dx += self.up.backward(du)
        return dx


class RotaryEmbedding:
    """Rotary position embeddings (Su et al. 2021) for heads of size head_dim (even), in
    transformers' layout (zmpi.nn.llama_functional): frequencies from `theta` (rope_theta;
    10000 in Llama 2, 500000 in Llama 3) scaled as `scaling` (transformers' rope_scaling dict:
    None, {"rope_type": "linear", "factor": f} or {"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}; any other
    type or key is a ValueError).

    One object may serve every attention layer of a model: `tables` keeps the last tables it
    made (the layers of a step ask for the same ones)."""

    def __init__(self, head_dim, theta=10000.0, scaling=None):
        self.inv_freq = L.rope_inv_freq(head_dim, theta, scaling)  # checks its arguments
        self.head_dim, self.theta = head_dim, float(theta)
        self.scaling = None if scaling is None else dict(scaling)
        self._last = (None, None)  # (key, tables)

    def tables(self, T, offset, like):
        """(cos, sin) (T, head_dim / 2) of the global positions offset .. offset + T - 1, in
        the dtype and array module of the array `like` (computed in float64 on the host,
        rounded once)."""
        L.check_int("sequence length", T, 0)
        L.check_int("position offset", offset, 0)
        xp = array_module(like)
        key = (int(T), int(offset), like.dtype, xp)
        if self._last[0] != key:
            self._last = key, tuple(xp.asarray(t.astype(like.dtype))
                                    for t in L.rope_tables(self.inv_freq, T, offset))
        return self._last[1]


class GroupedQueryAttention(AttentionPaths):
    """Grouped-query causal self-attention (Ainslie et al. 2023) with rotary position
    embeddings, as Llama's.  forward(x (B, T, C), offset=0) -> (B, T, C).

    n_kv_head key/value heads (default n_head: multi-head attention; 1: multi-query) serve
    n_head query heads of size hd = C / n_head; n_kv_head must divide n_head. q: Linear (C,
    n_head hd), k, v: Linear (C, n_kv_head hd), o: Linear (n_head hd, C), no biases. rope: a
    RotaryEmbedding of head size hd (shared by the model's layers), or None for no position
    embedding (then n_kv_head = n_head computes what CausalSelfAttention does, without its
    biases). offset: the global position of x's first row (sequence and context parallelism
    give each rank's chunk its own; an integer >= 0), for the rotations.

    The attention core (AttentionPaths, as CausalSelfAttention's) is zmpi.nn.gqa's blocked
    path; with `sparsity` (a zmpi.nn.sparsity SparsityConfig for the n_head query heads)
    block-sparse attention over its layout, and with the config's attention_kernel "flash" on
    device arrays the fused flash kernels, both on q, k (rotated) and v packed into one qkv
    (zmpi.nn.gqa.pack_qkv), reading each group's key/value head by index. Selective recompute
    (`recompute_core`, set by UnitModel.set_recompute) drops the attention probabilities as
    CausalSelfAttention does.

    Tensor parallelism (zmpi.parallel.tensor.plan's gqa_heads): q, k, v column-parallel by
    heads, o row-parallel; key/value heads split over the tensor ranks where the tensor size
    divides n_kv_head, else replicated (each rank computes the one its query heads read); each
    rank's query heads are heads [head_offset, head_offset + n_head) of the sparse layout's.
    """

    tp_plan = {"q": "gqa_heads", "o": "rowwise"}

    def __init__(self, d_model, n_head, n_kv_head=None, rope=None, rng=None,
                 dtype=numpy.float32, std=0.02, proj_std=None, sparsity=None):
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        G.check_heads(d_model, n_head, n_kv_head)
        self._check_sparsity(sparsity, n_head)
        hd = d_model // n_head
        if rope is not None and (not isinstance(rope, RotaryEmbedding) or rope.head_dim != hd):
            raise ValueError(f"rope must be None or a RotaryEmbedding of head size {hd} "
                             f"(d_model / n_head), got {rope!r}"
                             + (f" of head size {rope.head_dim}"
                                if isinstance(rope, RotaryEmbedding) else ""))
        rng = numpy.random.default_rng(rng)
        self.d_model, self.n_head, self.n_kv_head, self.rope = d_model, n_head, n_kv_head, rope
        self.sparsity = sparsity
        self.q = Linear(d_model, n_head * hd, bias=False, rng=rng, dtype=dtype, std=std)
        self.k = Linear(d_model, n_kv_head * hd, bias=False, rng=rng, dtype=dtype, std=std)
        self.v = Linear(d_model, n_kv_head * hd, bias=False, rng=rng, dtype=dtype, std=std)
        self.o = Linear(n_head * hd, d_model, bias=False, rng=rng, dtype=dtype,
                        std=std if proj_std is None else proj_std)

    def _tables(self, T, offset, like):
        return None if self.rope is None else self.rope.tables(T, offset, like)

    def forward(self, x, offset=0):
        _check_input(x, self.d_model, "GroupedQueryAttention", ndim=3)
        L.check_int("position offset", offset, 0)
        q, k, v = self.q.forward(x), self.k.forward(x), self.v.forward(x)
        tables = self._tables(q.shape[1], offset, q)
        if self._packed(q):
            qkv = G.pack_qkv(q, k, v, self.n_head, self.n_kv_head, tables)
            y, cache = self._packed_forward(qkv, self.n_kv_head)
        else:
            y, cache = G.gqa_attention_forward(q, k, v, self.n_head, self.n_kv_head, tables,
                                               keep_probs=not self.recompute_core)
        self._save(cache, offset)
        return self.o.forward(y)

    def backward(self, dy):
        cache, offset = self._pop()
        dy = self.o.backward(dy)
        tables = self._tables(dy.shape[1], offset, dy)
        if self._packed_cache(cache):
            dq, dk, dv = G.unpack_dqkv(self._packed_backward(dy, cache), self.n_head,
                                       self.n_kv_head, tables)
        else:
            dq, dk, dv = G.gqa_attention_backward(dy, cache, tables)
        dx = self.q.backward(dq)
        dx += self.k.backward(dk)
        dx += self.v.backward(dv)
        return dx

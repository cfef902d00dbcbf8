"""Layers: thin Modules that hold Parameters and a cache, and delegate the math to functional.

Contract of every layer: `y = layer.forward(x)` keeps on `self` exactly the activations that
backward needs (never a parameter array: parameters are read again at backward time, so ZeRO-3
may release them in between); `dx = layer.backward(dy)` returns the input gradient and
accumulates (`+=`) into each `p.grad`; backward without forward raises RuntimeError.

Mixed precision: with float16/bfloat16 parameter storage, a layer computes in
`compute_dtype(p.data)` (float32 on NumPy), activations flow in that dtype and parameter
gradients are rounded back to the storage dtype as they are accumulated.

Init (GPT-2): weights normal(0, std), biases 0, LayerNorm weight 1 and bias 0. `rng` is a
`numpy.random.Generator` or a seed; initial values are made on the host with NumPy.
"""

import math

import numpy

from zmpi.backend import compute_dtype
from zmpi.kernels import flash_attention
from zmpi.nn import attention as A
from zmpi.nn import functional as F
from zmpi.nn import sparse_attention as S
from zmpi.nn.module import Module
from zmpi.nn.parameter import Parameter, accumulate_grad_, compute_data, grad_out, live
from zmpi.nn.sparsity import DenseSparsityConfig, model_layout


def normal_parameter(rng, shape, std, dtype):
    """A Parameter initialised from normal(0, std), drawn in float64 then cast to `dtype`."""
    return Parameter(numpy.random.default_rng(rng).normal(0.0, std, shape).astype(dtype))


def constant_parameter(shape, value, dtype):
    """A Parameter filled with `value`."""
    return Parameter(numpy.full(shape, value, dtype=dtype))


class Linear(Module):
    """y = x @ W + b.  x (..., in_features) -> y (..., out_features).

    weight (in_features, out_features), bias (out_features,) or None. Default init std is
    1/sqrt(in_features); GPT-2 layers pass std=0.02.
    """

    def __init__(self, in_features, out_features, bias=True, rng=None, dtype=numpy.float32,
                 std=None):
        rng = numpy.random.default_rng(rng)
        std = 1.0 / math.sqrt(in_features) if std is None else std
        self.weight = normal_parameter(rng, (in_features, out_features), std, dtype)
        self.bias = constant_parameter((out_features,), 0.0, dtype) if bias else None

    def forward(self, x):
        W = compute_data(self.weight)  # (Cin, Cout)
        b = compute_data(self.bias) if self.bias is not None else None
        y, (x, _) = F.linear_forward(x.astype(W.dtype, copy=False), W, b)
        self._save(x)
        return y

    def backward(self, dy):
        x = self._pop()
        W = compute_data(self.weight)
        bias_out = grad_out(self.bias, W.dtype) if self.bias is not None else None
        dx, dW, db = F.linear_backward(dy.astype(W.dtype, copy=False), (x, W),
                                       grad_out(self.weight, W.dtype), bias_out)
        accumulate_grad_(self.weight, dW)  # nothing left to do when written into the grad
        if self.bias is not None:
            accumulate_grad_(self.bias, db)
        return dx


class Embedding(Module):
    """y = weight[idx].  idx (...) int -> y (..., dim) in the compute dtype; weight (num, dim).

    backward(dy) accumulates the scatter-add of dy into weight.grad and returns None (the
    input is an index array).
    """

    def __init__(self, num_embeddings, embedding_dim, rng=None, dtype=numpy.float32, std=0.02):
        self.weight = normal_parameter(rng, (num_embeddings, embedding_dim), std, dtype)

    def forward(self, idx):
        y, cache = embedding_lookup(self.weight, idx)
        self._save(cache)
        return y

    def backward(self, dy):
        accumulate_grad_(self.weight, F.embedding_backward(dy, self._pop()))
        return None


def embedding_lookup(p, idx, check: bool = True):
    """Rows `idx` of Parameter `p`, gathered in the storage dtype then cast to the compute dtype
    (so float16 storage never makes a float32 copy of the whole table). check: as in
    F.embedding_forward.

    Returns (y (..., C), embedding cache).
    """
    W = live(p)  # (V, C)
    y, cache = F.embedding_forward(idx, W, check)
    return y.astype(compute_dtype(W), copy=False), cache


class LayerNorm(Module):
    """Layer normalisation over the last axis (Ba et al. 2016).  x (..., C) -> y (..., C)."""

    def __init__(self, dim, eps=1e-5, dtype=numpy.float32):
        self.eps = eps
        self.weight = constant_parameter((dim,), 1.0, dtype)
        self.bias = constant_parameter((dim,), 0.0, dtype)

    def forward(self, x):
        w, b = compute_data(self.weight), compute_data(self.bias)
        y, (xhat, rstd, _) = F.layernorm_forward(x.astype(w.dtype, copy=False), w, b, self.eps)
        self._save(xhat, rstd)
        return y

    def backward(self, dy):
        xhat, rstd = self._pop()
        dx, dw, db = F.layernorm_backward(dy, (xhat, rstd, compute_data(self.weight)),
                                          grad_out(self.weight, dy.dtype),
                                          grad_out(self.bias, dy.dtype))
        accumulate_grad_(self.weight, dw)  # nothing left to do when written into the grad
        accumulate_grad_(self.bias, db)
        return dx


class GELU(Module):
    """GELU, tanh approximation (as GPT-2). No parameters."""

    def forward(self, x):
        y, cache = F.gelu_forward(x)
        self._save(cache)
        return y

    def backward(self, dy):
        return F.gelu_backward(dy, self._pop())


class AttentionPaths(Module):
    """What causal attention layers share (CausalSelfAttention, zmpi.nn.llama_layers'
    GroupedQueryAttention): the choice of the attention core. On a packed qkv (B, T, (n_head +
    2 n_kv_head) hd) [q | k | v]: zmpi.kernels.flash_attention's fused kernels (the config's
    attention_kernel "flash", on device arrays), else block-sparse attention
    (zmpi.nn.sparse_attention) over `sparsity`'s layout for this layer's heads; the layer's
    own blocked dense path where `_packed` says neither applies.

    sparsity (a zmpi.nn.sparsity SparsityConfig for the model's query heads, or None), n_head
    (this rank's query heads, heads [head_offset, head_offset + n_head) of the model's under
    tensor parallelism) and recompute_core are the layer's."""

    sparsity = None
    # selective recompute: keep q, k, v but not the (B, nh, T, T) attention probabilities,
    # which backward recomputes (bit for bit); set by UnitModel.set_recompute
    recompute_core = False
    head_offset = 0  # this rank's first head of the model's (tensor parallelism)

    @staticmethod
    def _check_sparsity(sparsity, n_head):
        """ValueError unless sparsity is None or a layout of n_head heads."""
        if sparsity is not None and sparsity.num_heads != n_head:
            raise ValueError(f"a sparse attention layout of {sparsity.num_heads} heads for "
                             f"n_head={n_head}")

    def _packed(self, x) -> bool:
        """Whether attention on x (a device array or not) runs on a packed qkv: the flash
        kernels or block-sparse attention."""
        return flash_attention.enabled_for(x) or not self._dense

    def _packed_forward(self, qkv, n_kv_head=None):
        """(y (B, T, n_head hd), cache) of the flash kernels or block-sparse attention on qkv
        (n_kv_head key/value heads; None: n_head)."""
        sparse = () if self._dense else (self.layout(qkv.shape[1]), self.sparsity.block)
        if flash_attention.enabled_for(qkv):
            return flash_attention.flash_attention_forward(qkv, self.n_head, *sparse,
                                                           n_kv_head=n_kv_head)
        return S.sparse_attention_forward(qkv, self.n_head, *sparse, n_kv_head=n_kv_head,
                                          keep_probs=not self.recompute_core)

    def _packed_cache(self, cache) -> bool:
        """Whether `cache` is a _packed_forward's (else the blocked dense path's)."""
        return isinstance(cache, flash_attention.FlashCache) or not self._dense

    @staticmethod
    def _packed_backward(dy, cache):
        """dqkv (B, T, (n_head + 2 n_kv_head) hd) of a _packed_forward's cache."""
        backward = (flash_attention.flash_attention_backward
                    if isinstance(cache, flash_attention.FlashCache) else
                    S.sparse_attention_backward)
        return backward(dy, cache)

    @property
    def _dense(self) -> bool:
        """Dense attention: no sparsity, or mode "dense" (every block kept: the dense kernels,
        which query blocks of their own size, give its numbers bit for bit)."""
        return self.sparsity is None or isinstance(self.sparsity, DenseSparsityConfig)

    def layout(self, T: int) -> numpy.ndarray:
        """This layer's heads' block layout at sequence length T (n_head, T/block, T/block),
        intersected with the causal mask; ValueError if T is not a multiple of the block."""
        return model_layout(self.sparsity, T)[self.head_offset:self.head_offset + self.n_head]


class CausalSelfAttention(AttentionPaths):
    """Multi-head causal self-attention.  x (B, T, C) -> y (B, T, C).

    qkv: Linear (C, 3C) producing [q | k | v]; proj: Linear (C, C), init std `proj_std`
    (GPT-2 scales it by 1/sqrt(2 n_layer) because it writes into the residual stream).
    Under tensor parallelism (zmpi.parallel.tensor.plan) each rank keeps n_head / T heads,
    heads [head_offset, head_offset + n_head) of the model's.

    sparsity (a zmpi.nn.sparsity SparsityConfig for the model's heads, or None): block-sparse
    attention (zmpi.nn.sparse_attention) over its layout intersected with the causal mask,
    made once per sequence length T (a multiple of its block) for this layer's heads. Mode
    "dense" runs the dense kernels (its layout keeps every block: the same numbers). With the
    config's attention_kernel "flash", on device arrays, dense and sparse attention run
    zmpi.kernels.flash_attention's fused kernels instead (they keep no probabilities either way):
    AttentionPaths.
    """

    tp_plan = {"qkv": "colwise_heads", "proj": "rowwise"}

    def __init__(self, d_model, n_head, rng=None, dtype=numpy.float32, std=0.02, proj_std=None,
                 sparsity=None):
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}")
        self._check_sparsity(sparsity, n_head)
        rng = numpy.random.default_rng(rng)
        self.n_head, self.sparsity = n_head, sparsity
        self.qkv = Linear(d_model, 3 * d_model, rng=rng, dtype=dtype, std=std)
        self.proj = Linear(d_model, d_model, rng=rng, dtype=dtype,
                           std=std if proj_std is None else proj_std)

    def forward(self, x):
        qkv = self.qkv.forward(x)  # (B, T, 3C)
        if self._packed(qkv):
            y, cache = self._packed_forward(qkv)
        else:
            y, cache = A.attention_forward(qkv, self.n_head, keep_probs=not self.recompute_core)
        self._save(cache)
        return self.proj.forward(y)  # (B, T, C)

    def backward(self, dy):
        cache = self._pop()
        backward = self._packed_backward if self._packed_cache(cache) else A.attention_backward
        return self.qkv.backward(backward(self.proj.backward(dy), cache))


class Dense(Module):
    """Linear followed by GELU (unless act=False): x (..., d_in) -> (..., d_out). The block of a
    plain MLP; one Dense per unit makes an MLP a UnitModel (zmpi.models.mlp)."""

    def __init__(self, d_in, d_out, act=True, rng=None, dtype=numpy.float32, std=None):
        self.fc = Linear(d_in, d_out, rng=rng, dtype=dtype, std=std)
        self.act = GELU() if act else None

    def forward(self, x):
        x = self.fc.forward(x)
        return self.act.forward(x) if self.act else x

    def backward(self, dy):
        return self.fc.backward(self.act.backward(dy) if self.act else dy)


class MLP(Module):
    """Transformer feed-forward: x (..., C) -> fc (C, 4C) -> GELU -> proj (4C, C)."""

    tp_plan = {"fc": "colwise", "proj": "rowwise"}  # zmpi.parallel.tensor.plan

    def __init__(self, d_model, rng=None, dtype=numpy.float32, std=0.02, proj_std=None):
        rng = numpy.random.default_rng(rng)
        self.fc = Linear(d_model, 4 * d_model, rng=rng, dtype=dtype, std=std)
        self.gelu = GELU()
        self.proj = Linear(4 * d_model, d_model, rng=rng, dtype=dtype,
                           std=std if proj_std is None else proj_std)

    def forward(self, x):
        self._save(True)
        return self.proj.forward(self.gelu.forward(self.fc.forward(x)))

    def backward(self, dy):
        self._pop()
        return self.fc.backward(self.gelu.backward(self.proj.backward(dy)))


class Block(Module):
    """Pre-LN transformer block (GPT-2): x = x + attn(ln1(x)); x = x + mlp(ln2(x)).

    x (B, T, C) -> (B, T, C). Under sequence parallelism (zmpi.parallel.tensor.plan) x is this
    rank's sequence shard (B, T/tp, C): the LayerNorms and residual adds work on it, and the
    attention and MLP gather the sequence at their input and reduce-scatter it at their output.

    mlp: the feed-forward module, None for GPT-2's MLP (built here, after the attention, from
    `rng`); a mixture of experts (zmpi.nn.moe.MoE) makes the block an MoE block.
    """

    tp_plan = {"ln1": "sequence", "ln2": "sequence"}  # zmpi.parallel.tensor.plan

    def __init__(self, d_model, n_head, rng=None, dtype=numpy.float32, std=0.02, proj_std=None,
                 sparsity=None, mlp=None):
        rng = numpy.random.default_rng(rng)
        self.ln1 = LayerNorm(d_model, dtype=dtype)
        self.attn = CausalSelfAttention(d_model, n_head, rng=rng, dtype=dtype, std=std,
                                        proj_std=proj_std, sparsity=sparsity)
        self.ln2 = LayerNorm(d_model, dtype=dtype)
        self.mlp = MLP(d_model, rng=rng, dtype=dtype, std=std, proj_std=proj_std) \
            if mlp is None else mlp

    def forward(self, x):
        self._save(True)
        x = x + self.attn.forward(self.ln1.forward(x))
        return x + self.mlp.forward(self.ln2.forward(x))

    def backward(self, dy):
        self._pop()
        dx = dy + self.ln2.backward(self.mlp.backward(dy))
        return dx + self.ln1.backward(self.attn.backward(dx))

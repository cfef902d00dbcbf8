"""GPT-2 style decoder-only transformer built from zmpi.nn, as ZeRO units (no dropout).

Units: [TokenPositionEmbedding, Block x n_layer, LMHead]. The LM head reuses the token
embedding as its output projection (tied weights, as GPT-2): it lists the embedding unit in
`shared_units`, reads `wte` at call time and accumulates into the same `wte.grad`, so `wte`
gets gradient from both ends of the model but is owned (and named) only by unit 0.

    model = GPT(GPTConfig(vocab_size=65, seq_len=64, n_layer=4, n_head=4, d_model=128))
    loss = model.loss(idx, targets)   # idx, targets (B, T) int, T <= seq_len
    model.backward_loss()             # grads accumulate into p.grad
"""

import math
from dataclasses import dataclass, replace

import numpy

from zmpi import backend
from zmpi.models.gpt_counts import moe_config
from zmpi.nn import (
    Block,
    LayerNorm,
    Module,
    UnitModel,
    accumulate_grad_,
    array_module,
    compute_data,
    embedding_lookup,
    live,
    normal_parameter,
)
from zmpi.nn import functional as F
from zmpi.nn.moe import MoE
from zmpi.nn.sparsity import SparsityConfig, model_layout, sparsity_from_dict
from zmpi.parallel.expert.tensor import tensor_parallel_moe
from zmpi.parallel.tensor.plan import mark_sequence_parallel, parallelize
from zmpi.parallel.tensor.regions import (
    GatherFromSequenceRegion,
    ReduceScatterToSequenceRegion,
    sequence_shard,
)
from zmpi.parallel.tensor.vocab import (
    VocabParallelCrossEntropy,
    real_rows,
    vocab_head_backward,
    vocab_lookup,
    vocab_lookup_backward,
    vocab_parameter,
)

GPU_VOCAB_MULTIPLE = 128  # the vocabulary's padding on a GPU: aligned LM-head GEMMs


def default_vocab_multiple(on_gpu: bool) -> int:
    """The vocabulary's padding multiple when none is given: 128 on a GPU (tensor-core GEMMs
    want every dimension a multiple of 8, and cuBLAS picks its fastest kernels at multiples of
    128: nanoGPT's 50257 -> 50304), 1 on a CPU (BLAS gains nothing from it; the padded columns
    would only cost time)."""
    return GPU_VOCAB_MULTIPLE if on_gpu else 1


@dataclass
class GPTConfig:
    vocab_size: int = 65
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    # the token table (and the tied LM head's logits) padded to a multiple of this (times tp);
    # None: default_vocab_multiple of the backend. Padding is never a token: docs/gpu.md
    vocab_multiple: int | None = None


class TokenPositionEmbedding(Module):
    """Unit 0: x = wte[idx] + wpe[arange(T)].  idx (B, T) int -> x (B, T, C), compute dtype.

    wte (Vp, C) token embedding (also the LM head's output projection), the vocabulary padded to
    a multiple of `vocab_multiple` (zero rows, never looked up), wpe (seq_len, C). With `tp` (a
    tensor-parallel Comm), wte is this rank's Vp / tp rows of the padded table and the lookup
    sums over tp (zmpi.parallel.tensor.vocab); wpe stays whole. With sequence_parallel the sum
    is a reduce-scatter to this rank's sequence shard, x (B, T/tp, C), to which the rank adds
    its own positions' wpe rows (wpe is marked `sequence_parallel`: its gradient is partial).

    positions=False: no wpe (a model whose attention places the tokens, as Llama's RoPE does):
    x = wte[idx], seq_len only bounds T.
    """

    def __init__(self, vocab_size, seq_len, d_model, rng, dtype, tp=None,
                 sequence_parallel=False, vocab_multiple=1, positions=True):
        self.tp, self.vocab_size, self.seq_len = tp, vocab_size, seq_len
        self.vocab_multiple = vocab_multiple
        self.wte = vocab_parameter(vocab_size, d_model, tp, rng, dtype, multiple=vocab_multiple)
        self.wpe = normal_parameter(rng, (seq_len, d_model), 0.02, dtype) if positions else None
        self.scatter = ReduceScatterToSequenceRegion(tp) if sequence_parallel else None
        if sequence_parallel and positions:
            mark_sequence_parallel(self.wpe)

    def forward(self, idx):
        wte = live(self.wte)
        xp = array_module(wte)
        idx = xp.asarray(idx)
        B, T = idx.shape
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} > seq_len {self.seq_len}")
        positions = xp.arange(T)
        if self.scatter is not None:  # this rank's positions; refused before any collective
            n = sequence_shard(T, self.tp)
            positions = positions[self.tp.rank * n:(self.tp.rank + 1) * n]
        if self.tp is None:  # ids in [0, V): padding rows are never looked up
            F.check_indices(idx, self.vocab_size, "embedding indices")
            tok, tok_cache = embedding_lookup(self.wte, idx, check=False)  # (B, T, C)
        else:
            tok, tok_cache = vocab_lookup(self.wte, idx, self.tp, self.vocab_size,
                                          reduce=self.scatter is None)
        if self.scatter is not None:
            tok = self.scatter.forward(tok)  # the sum over tp, this rank's (B, T/tp, C)
        if self.wpe is None:
            self._save(tok_cache, None)
            return tok
        # positions are in range (T <= seq_len above): no check, no device sync
        pos, pos_cache = embedding_lookup(self.wpe, positions, check=False)  # (T or T/tp, C)
        self._save(tok_cache, pos_cache)
        return tok + pos

    def backward(self, dx):
        tok_cache, pos_cache = self._pop()
        if self.wpe is not None:
            accumulate_grad_(self.wpe, F.embedding_backward(dx.sum(axis=0), pos_cache))
        if self.scatter is not None:
            dx = self.scatter.backward(dx)  # (B, T, C): every rank's positions
        if self.tp is None:
            accumulate_grad_(self.wte, F.embedding_backward(dx, tok_cache))
        else:
            vocab_lookup_backward(self.wte, dx, tok_cache)
        return None


class LMHead(Module):
    """Last unit: logits = ln_f(x) @ wte.T.  x (B, T, C) -> logits (B, T, Vp).

    norm: the final normalisation (default a LayerNorm, GPT-2's; Llama passes its RMSNorm).
    tied=False: the head owns its output projection, `lm_head`, a table shaped and split as
    the embedding's wte (drawn from `rng`), instead of borrowing wte (Llama's default).

    Owns ln_f; borrows wte from the embedding unit (`shared_units = (embedding,)`). The
    padding columns (ids >= V of the padded vocabulary) are -inf (`F.mask_padding`): any loss
    or sampling gives them probability 0, and their gradient, and so the padding rows' of wte,
    is exactly 0. Under tensor parallelism the logits are this rank's Vp/T columns (never
    gathered: the loss is zmpi.parallel.tensor.vocab's), and backward sums the input gradient
    over tp. With sequence_parallel, x is this rank's sequence shard (B, T/tp, C):
    ln_f runs on it (and is marked `sequence_parallel`), then the sequence is gathered before
    the logits (GatherFromSequenceRegion), whose backward reduce-scatters the input gradient.
    """

    def __init__(self, embedding, d_model, dtype, sequence_parallel=False, norm=None,
                 tied=True, rng=None):
        self._tp = embedding.tp  # the embedding's tensor-parallel Comm (or None)
        if tied:
            self.shared_units = (embedding,)
        else:
            self.lm_head = vocab_parameter(embedding.vocab_size, d_model, embedding.tp, rng,
                                           dtype, multiple=embedding.vocab_multiple)
        self.ln_f = LayerNorm(d_model, dtype=dtype) if norm is None else norm
        self.gather = GatherFromSequenceRegion(embedding.tp) if sequence_parallel else None
        if sequence_parallel:
            mark_sequence_parallel(self.ln_f)

    @property
    def wte(self):
        """The output projection: the tied token embedding Parameter, owned by the embedding
        unit, or the head's own `lm_head`."""
        return self.shared_units[0].wte if self.shared_units else self.lm_head

    def forward(self, x):
        h = self.ln_f.forward(x)  # (B, T, C); sequence parallel: (B, T/tp, C)
        if self.gather is not None:
            h = self.gather.forward(h)  # (B, T, C)
        logits, (h, _) = F.linear_forward(h, compute_data(self.wte).T)  # (B, T, Vp)
        self._save(h)
        return F.mask_padding(logits, real_rows(self.wte))

    def backward(self, dlogits):
        h = self._pop()
        if self._tp is not None:  # this rank's vocabulary rows; dh summed over tp
            dh = vocab_head_backward(self.wte, h, dlogits, self._tp,
                                     reduce=self.gather is None)
            if self.gather is not None:  # the sum over tp, this rank's sequence shard
                dh = self.gather.backward(dh)
            return self.ln_f.backward(dh)
        WT = compute_data(self.wte).T  # (C, Vp)
        dh, dWT, _ = F.linear_backward(dlogits.astype(WT.dtype, copy=False), (h, WT))
        accumulate_grad_(self.wte, dWT.T)
        return self.ln_f.backward(dh)


def _sparsity(spec, n_head: int):
    """The SparsityConfig of GPT's `sparse_attention` argument (None, a DeepSpeed section or a
    SparsityConfig), for n_head heads."""
    if spec is None or isinstance(spec, SparsityConfig):
        if spec is not None and spec.num_heads != n_head:
            raise ValueError(f"a sparse attention layout of {spec.num_heads} heads for "
                             f"n_head={n_head}")
        return spec
    return sparsity_from_dict(spec, n_head)


class GPT(UnitModel):
    """GPT-2: token+position embedding, n_layer pre-LN blocks, final LayerNorm, tied LM head.

    Parameters are stored in `dtype` (float32, float64, float16 or ml_dtypes.bfloat16) and
    initialised as GPT-2, deterministically from `seed`: weights normal(0, 0.02), residual
    projections (attn.proj, mlp.proj) normal(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm 1/0.

    tp: the mesh's tensor-parallel Comm (`mesh.tp_comm`). Each block is then split by its
    layers' plans (zmpi.parallel.tensor.plan: attention by heads, the MLP column then row) as
    it is built; the token embedding (tied to the LM head) is split by vocabulary rows, padded
    to a multiple of vocab_multiple x T, and the loss is the vocabulary-parallel cross-entropy,
    so the (B, T, V) logits are never gathered; the LayerNorms and the position embedding are
    replicated. The slices of the T ranks put together are the model the same seed builds
    without `tp`.

    sequence_parallel (with tp of 2 ranks or more; without, it changes nothing): sequence
    parallelism (Korthikanti et al. 2022). Between the tensor-parallel regions each rank holds
    its sequence shard (B, T/tp, C): the embedding's vocabulary-parallel sum becomes a
    reduce-scatter, the LayerNorms and residual adds run on the shard, each attention and MLP
    gathers the sequence at its input and reduce-scatters at its output, and the LM head
    gathers it before the logits. The batch's T must be a multiple of tp.size (`check_batch`
    and the embedding raise a ValueError). The replicated parameters whose gradients each rank
    computes from its shard (LayerNorms, wpe) are marked `sequence_parallel`; the engine sums
    their gradients over the tensor ranks.

    sparse_attention: None (dense attention), a DeepSpeed `sparse_attention` section (dict) or
    a zmpi.nn.sparsity SparsityConfig for n_head heads: every block's attention is block-sparse
    over that layout intersected with the causal mask (zmpi.nn.sparse_attention;
    docs/sparse-attention.md), each tensor rank running its own heads' layouts. The batch's T
    must then be a multiple of the layout's block (`check_batch` raises a ValueError).

    moe: None (dense), a `moe` config section (dict, DeepSpeed-MoE's keys: zmpi.config.moe)
    or a MoEConfig. The blocks it names (every moe_layer_interval-th, or `layers`) get a
    mixture of experts (zmpi.nn.moe.MoE, each with its own expert count and random stream,
    seeded from `seed` and the block) in place of their MLP, as DeepSpeed-MoE and GShard do;
    its routing groups are the batch's sequences. With tp, every expert (and PR-MoE's residual
    MLP, the shared experts) is split over the tensor ranks as the MLP is, the router whole on
    each (zmpi.parallel.expert.tensor; with sequence parallelism it gathers the sequence).
    Whoever trains
    the model sets each MoE layer's routing (`moe_layers()`; the Engine does: docs/moe.md);
    `inference()` routes as in evaluation (eval_capacity_factor, no random draws).
    """

    def __init__(self, config, seed=0, dtype=numpy.float32, tp=None, sequence_parallel=False,
                 sparse_attention=None, moe=None):
        self.config = c = self._setup(config, tp, sequence_parallel)
        multiple, sp = c.vocab_multiple, self.sequence_parallel
        self.sparse_attention = sparsity = _sparsity(sparse_attention, c.n_head)
        if self.tp is not None and c.n_head % tp.size:
            raise ValueError(f"n_head={c.n_head} is not divisible by the tensor-parallel size "
                             f"{tp.size}: every rank must hold an equal share of the heads")
        self.moe = moe_config(moe)
        experts = {} if self.moe is None else self.moe.layer_experts(c.n_layer)
        rng = numpy.random.default_rng(seed)
        proj_std = 0.02 / math.sqrt(2 * c.n_layer)
        embedding = TokenPositionEmbedding(c.vocab_size, c.seq_len, c.d_model, rng, dtype,
                                           self.tp, sp, multiple)

        def mlp(i):  # block i's feed-forward: None for GPT-2's MLP
            if i not in experts:
                return None
            return MoE(c.d_model, experts[i], rng=rng, dtype=dtype, proj_std=proj_std,
                       seed=seed * c.n_layer + i, **self.moe.layer_options())

        # each block is split as soon as it is built: no rank holds the whole model
        blocks = [parallelize(Block(c.d_model, c.n_head, rng=rng, dtype=dtype,
                                    proj_std=proj_std, sparsity=sparsity, mlp=mlp(i)), self.tp, sp)
                  for i in range(c.n_layer)]
        for block in blocks:  # an MoE's experts split over tp as the MLP (docs/moe.md)
            if isinstance(block.mlp, MoE):
                tensor_parallel_moe(block.mlp, self.tp, sp)
        loss = None if self.tp is None else VocabParallelCrossEntropy(self.tp, c.vocab_size,
                                                                      multiple=multiple)
        super().__init__([embedding, *blocks, LMHead(embedding, c.d_model, dtype, sp)],
                         loss=loss)

    def _setup(self, config, tp, sequence_parallel):
        """Set `tp` (None at one rank) and `sequence_parallel` (checked); returns `config`
        with its vocab_multiple resolved (None: `default_vocab_multiple` of the backend)."""
        multiple = config.vocab_multiple
        if multiple is None:
            multiple = default_vocab_multiple(backend.is_gpu)
        elif type(multiple) is not int or multiple < 1:
            raise ValueError(f"vocab_multiple must be an integer >= 1, got {multiple!r}")
        self.tp = tp if tp is not None and tp.size > 1 else None
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
        self.sequence_parallel = sequence_parallel and self.tp is not None
        return replace(config, vocab_multiple=multiple)

    def check_batch(self, inputs, targets) -> bool:
        """(B, T) integer token ids in [0, vocab_size), T <= seq_len, targets shaped as inputs
        (and in range, or the loss's ignore_index). Returns True: every id is checked."""
        c = self.config
        for name, a in (("inputs", inputs), ("targets", targets)):
            if getattr(a, "ndim", None) != 2 or a.shape[1] > c.seq_len:
                raise ValueError(f"{name} must be (batch, time <= {c.seq_len}) token ids, got "
                                 f"shape {getattr(a, 'shape', type(a).__name__)}")
        if inputs.shape != targets.shape:
            raise ValueError(f"inputs {inputs.shape} and targets {targets.shape} differ")
        if self.sequence_parallel:
            sequence_shard(inputs.shape[1], self.tp)
        if self.sparse_attention is not None:  # T a multiple of the block, no empty row
            model_layout(self.sparse_attention, inputs.shape[1])
        F.check_indices(inputs, c.vocab_size, "inputs (token ids)")
        F.check_indices(targets, c.vocab_size, "targets (token ids)",
                        getattr(self.loss_fn, "ignore_index", None))
        return True

    def moe_layers(self) -> list[MoE]:
        """The MoE layers, in block order ([] for a dense model)."""
        return [block.mlp for block in self.units[1:-1] if isinstance(block.mlp, MoE)]

    def tied_parameters(self):
        """The LM head's output projection is the token embedding (where tied)."""
        if not self.units[-1].shared_units:
            return {}
        return {f"units.{len(self.units) - 1}.wte": "units.0.wte"}

    def generate(self, idx, max_new_tokens, temperature=1.0, rng=None, vocab=None):
        """Sample `max_new_tokens` tokens after `idx` (B, T0) int; returns (B, T0 + new) int.

        Each step runs the model on the last seq_len tokens and samples from
        softmax(logits / temperature) with `rng` (a numpy Generator or seed), on the host,
        among the first `vocab` tokens (default all: a model whose vocabulary is larger than
        its data's samples only the data's).
        """
        rng = numpy.random.default_rng(rng)
        idx = numpy.asarray(_to_host(idx))
        for _ in range(max_new_tokens):
            window, last = self._window(idx)
            with self.inference():
                logits = self._gathered(self.forward(window)[:, last, :])[:, :vocab]
            z = logits.astype(numpy.float64) / temperature
            p = numpy.exp(z - z.max(axis=-1, keepdims=True))
            cdf = numpy.cumsum(p / p.sum(axis=-1, keepdims=True), axis=-1)  # (B, V)
            u = rng.random((idx.shape[0], 1))
            nxt = numpy.minimum((cdf < u).sum(axis=-1), cdf.shape[-1] - 1)  # (B,)
            idx = numpy.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
        self.clear_cache()
        return idx

    def _window(self, idx):
        """(the model's input for the token after `idx`, the position of idx's last token in
        it): the last seq_len tokens. Where the model's T must be a multiple of m (tp.size
        under sequence parallelism, the block of sparse attention, or both), at most L =
        seq_len rounded down to a multiple of m (at least m), padded on the right to such a
        multiple, and with sparse attention to L itself (a layout may need that many block
        rows: the one training checked); the padding changes no earlier position (causal
        attention)."""
        m = math.lcm(self.tp.size if self.sequence_parallel else 1,
                     1 if self.sparse_attention is None else self.sparse_attention.block)
        if m == 1:
            return idx[:, -self.config.seq_len:], -1
        L = max(self.config.seq_len // m * m, m)
        window = idx[:, -L:]
        short = L - window.shape[1] if self.sparse_attention else -window.shape[1] % m
        pad = numpy.zeros((len(window), short), window.dtype)
        return numpy.concatenate([window, pad], axis=1), window.shape[1] - 1

    def _gathered(self, logits):
        """(B, V) host logits from this rank's (B, V) or, under tensor parallelism, its
        (B, Vp/T) columns (gathered over tp, padding dropped)."""
        logits = numpy.ascontiguousarray(_to_host(logits))
        if self.tp is not None:
            logits = numpy.concatenate(self.tp.allgather_object(logits), axis=-1)
        return logits[:, :self.config.vocab_size]


def _to_host(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else a

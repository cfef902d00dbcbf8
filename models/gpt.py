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
from dataclasses import dataclass

import numpy

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
from zmpi.parallel.tensor.plan import parallelize
from zmpi.parallel.tensor.vocab import (
    VocabParallelCrossEntropy,
    vocab_head_backward,
    vocab_lookup,
    vocab_lookup_backward,
    vocab_parameter,
)


@dataclass
class GPTConfig:
    vocab_size: int = 65
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128


def gpt_num_params(n_layer: int, d_model: int, vocab_size: int, seq_len: int,
                   tp: int = 1) -> int:
    """Parameters of zmpi's GPT (tied LM head) that one rank holds, with tensor parallelism
    over `tp` ranks (1: the whole model): the token embedding's ceil(V / tp) d rows (the
    vocabulary padded), the position embedding's seq_len d, per block (12 d^2 + 7 d) / tp split
    (qkv, fc with biases; proj, mlp.proj weights) and 6 d replicated (two LayerNorms, the two
    row-parallel biases), the final LayerNorm 2 d. At tp = 1: V d + T d + L (12 d^2 + 13 d)
    + 2 d."""
    d = d_model
    return (-(-vocab_size // tp) + seq_len) * d + n_layer * ((12 * d * d + 7 * d) // tp + 6 * d) \
        + 2 * d


class TokenPositionEmbedding(Module):
    """Unit 0: x = wte[idx] + wpe[arange(T)].  idx (B, T) int -> x (B, T, C), compute dtype.

    wte (V, C) token embedding (also the LM head's output projection), wpe (seq_len, C). With
    `tp` (a tensor-parallel Comm), wte is this rank's rows of the padded table and the lookup
    sums over tp (zmpi.parallel.tensor.vocab); wpe stays whole.
    """

    def __init__(self, vocab_size, seq_len, d_model, rng, dtype, tp=None):
        self.tp, self.vocab_size = tp, vocab_size
        self.wte = normal_parameter(rng, (vocab_size, d_model), 0.02, dtype) if tp is None \
            else vocab_parameter(vocab_size, d_model, tp, rng, dtype)
        self.wpe = normal_parameter(rng, (seq_len, d_model), 0.02, dtype)

    def forward(self, idx):
        wte = live(self.wte)
        xp = array_module(wte)
        idx = xp.asarray(idx)
        B, T = idx.shape
        if T > self.wpe.shape[0]:
            raise ValueError(f"sequence length {T} > seq_len {self.wpe.shape[0]}")
        tok, tok_cache = embedding_lookup(self.wte, idx) if self.tp is None else \
            vocab_lookup(self.wte, idx, self.tp, self.vocab_size)  # (B, T, C)
        # positions 0..T-1 are in range (T <= seq_len above): no check, no device sync
        pos, pos_cache = embedding_lookup(self.wpe, xp.arange(T), check=False)  # (T, C)
        self._save(tok_cache, pos_cache)
        return tok + pos

    def backward(self, dx):
        tok_cache, pos_cache = self._pop()
        if self.tp is None:
            accumulate_grad_(self.wte, F.embedding_backward(dx, tok_cache))
        else:
            vocab_lookup_backward(self.wte, dx, tok_cache)
        accumulate_grad_(self.wpe, F.embedding_backward(dx.sum(axis=0), pos_cache))
        return None


class LMHead(Module):
    """Last unit: logits = ln_f(x) @ wte.T.  x (B, T, C) -> logits (B, T, V).

    Owns ln_f; borrows wte from the embedding unit (`shared_units = (embedding,)`). Under
    tensor parallelism the logits are this rank's Vp/T columns (never gathered: the loss is
    zmpi.parallel.tensor.vocab's), padding rows get no gradient, and backward sums the input
    gradient over tp.
    """

    def __init__(self, embedding, d_model, dtype):
        self.shared_units = (embedding,)
        self.ln_f = LayerNorm(d_model, dtype=dtype)

    @property
    def wte(self):
        """The tied token embedding Parameter, owned by the embedding unit."""
        return self.shared_units[0].wte

    def forward(self, x):
        h = self.ln_f.forward(x)  # (B, T, C)
        logits, (h, _) = F.linear_forward(h, compute_data(self.wte).T)  # (B, T, V)
        self._save(h)
        return logits

    def backward(self, dlogits):
        h = self._pop()
        embedding = self.shared_units[0]
        if embedding.tp is not None:  # this rank's vocabulary rows; dh summed over tp
            return self.ln_f.backward(vocab_head_backward(self.wte, h, dlogits, embedding.tp,
                                                          embedding.vocab_size))
        WT = compute_data(self.wte).T  # (C, V)
        dh, dWT, _ = F.linear_backward(dlogits.astype(WT.dtype, copy=False), (h, WT))
        accumulate_grad_(self.wte, dWT.T)
        return self.ln_f.backward(dh)


class GPT(UnitModel):
    """GPT-2: token+position embedding, n_layer pre-LN blocks, final LayerNorm, tied LM head.

    Parameters are stored in `dtype` (float32, float64, float16 or ml_dtypes.bfloat16) and
    initialised as GPT-2, deterministically from `seed`: weights normal(0, 0.02), residual
    projections (attn.proj, mlp.proj) normal(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm 1/0.

    tp: the mesh's tensor-parallel Comm (`mesh.tp_comm`). Each block is then split by its
    layers' plans (zmpi.parallel.tensor.plan: attention by heads, the MLP column then row) as
    it is built; the token embedding (tied to the LM head) is split by vocabulary rows, padded
    to a multiple of T, and the loss is the vocabulary-parallel cross-entropy, so the (B, T, V)
    logits are never gathered; the LayerNorms and the position embedding are replicated. The
    slices of the T ranks put together are the model the same seed builds without `tp`.
    """

    def __init__(self, config, seed=0, dtype=numpy.float32, tp=None):
        self.config = c = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None and c.n_head % tp.size:
            raise ValueError(f"n_head={c.n_head} is not divisible by the tensor-parallel size "
                             f"{tp.size}: every rank must hold an equal share of the heads")
        rng = numpy.random.default_rng(seed)
        proj_std = 0.02 / math.sqrt(2 * c.n_layer)
        embedding = TokenPositionEmbedding(c.vocab_size, c.seq_len, c.d_model, rng, dtype,
                                           self.tp)
        # each block is split as soon as it is built: no rank holds the whole model
        blocks = [parallelize(Block(c.d_model, c.n_head, rng=rng, dtype=dtype,
                                    proj_std=proj_std), self.tp)
                  for _ in range(c.n_layer)]
        loss = None if self.tp is None else VocabParallelCrossEntropy(self.tp, c.vocab_size)
        super().__init__([embedding, *blocks, LMHead(embedding, c.d_model, dtype)], loss=loss)

    def check_batch(self, inputs, targets) -> None:
        """(B, T) integer token ids in [0, vocab_size), T <= seq_len, targets shaped as inputs
        (and in range, or the loss's ignore_index)."""
        c = self.config
        for name, a in (("inputs", inputs), ("targets", targets)):
            if getattr(a, "ndim", None) != 2 or a.shape[1] > c.seq_len:
                raise ValueError(f"{name} must be (batch, time <= {c.seq_len}) token ids, got "
                                 f"shape {getattr(a, 'shape', type(a).__name__)}")
        if inputs.shape != targets.shape:
            raise ValueError(f"inputs {inputs.shape} and targets {targets.shape} differ")
        F.check_indices(inputs, c.vocab_size, "inputs (token ids)")
        F.check_indices(targets, c.vocab_size, "targets (token ids)",
                        getattr(self.loss_fn, "ignore_index", None))

    def tied_parameters(self):
        """The LM head's output projection is the token embedding."""
        return {f"units.{len(self.units) - 1}.wte": "units.0.wte"}

    def generate(self, idx, max_new_tokens, temperature=1.0, rng=None):
        """Sample `max_new_tokens` tokens after `idx` (B, T0) int; returns (B, T0 + new) int.

        Each step runs the model on the last seq_len tokens and samples from
        softmax(logits / temperature) with `rng` (a numpy Generator or seed), on the host.
        """
        rng = numpy.random.default_rng(rng)
        idx = numpy.asarray(_to_host(idx))
        for _ in range(max_new_tokens):
            logits = self._gathered(self.forward(idx[:, -self.config.seq_len:])[:, -1, :])
            z = logits.astype(numpy.float64) / temperature
            p = numpy.exp(z - z.max(axis=-1, keepdims=True))
            cdf = numpy.cumsum(p / p.sum(axis=-1, keepdims=True), axis=-1)  # (B, V)
            u = rng.random((idx.shape[0], 1))
            nxt = numpy.minimum((cdf < u).sum(axis=-1), cdf.shape[-1] - 1)  # (B,)
            idx = numpy.concatenate([idx, nxt[:, None].astype(idx.dtype)], axis=1)
        self.clear_cache()
        return idx

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

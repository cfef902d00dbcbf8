"""Vocabulary-parallel embedding, tied LM head and cross-entropy (Megatron-LM's
VocabParallelEmbedding and vocab_parallel_cross_entropy), with explicit forward and backward.

The (V, C) token table is split by rows over the tp ranks of `tp` (a zmpi Comm, normally
`mesh.tp_comm`). V is padded up to Vp, a multiple of `multiple` x tp (Megatron's
make-vocab-size-divisible-by times tp; `multiple` 128 makes the LM head's GEMMs aligned on a
GPU), so every rank holds Vp/tp rows, a multiple of `multiple`: rank r holds rows
[r Vp/tp, (r+1) Vp/tp) of the padded table. This is the one padding of the vocabulary: models/gpt.py
pads its table with it at tp = 1 too (`vocab_parameter` with tp None). Padding rows (ids >= V)
are zero, are never looked up, and never receive a gradient; their logits are -inf in the
softmax (`F.mask_padding`), so their probability and gradient are exactly 0.

    emb = VocabParallelEmbedding(V, C, tp, rng, dtype)      # weight (Vp/tp, C), this rank's rows
    head = VocabParallelLMHead(emb)                          # logits_local = h @ weight.T
    loss_fn = VocabParallelCrossEntropy(tp, V, ignore_index=-100)
    x = emb.forward(idx)                    # (B, T, C), full on every rank
    loss = loss_fn.forward(head.forward(x), targets)       # the (B, T, V) logits never gathered
    emb.backward(head.backward(loss_fn.backward(1.0)))

Traffic over `tp` per forward + backward, N = B T positions, C channels, in the compute dtype
(float32, or float64 for float64 parameters/logits):
    embedding forward   one allreduce(sum) of N C        embedding backward   none
    LM head forward     none                             LM head backward     one allreduce(sum)
                                                                              of N C (dh)
    cross-entropy fwd   three allreduces of N each       cross-entropy bwd    none
                        (max, sum of exp, target logit)
At tp = 1 nothing is communicated (the collectives are skipped; the counters stay at zero).
"""

import numpy

from zmpi.backend import array_module, compute_dtype
from zmpi.nn import functional as F
from zmpi.nn.base import Module
from zmpi.nn.losses import Loss
from zmpi.nn.parameter import Parameter, accumulate_grad_, compute_data, live


def vocab_shard(vocab_size: int, size: int = 1, rank: int = 0,
                multiple: int = 1) -> tuple[int, int, int]:
    """(Vp, start, rows): the padded vocabulary (vocab_size rounded up to a multiple of
    `multiple` x `size`), and this rank's rows [start, start + rows) of it, rows = Vp / size
    (a multiple of `multiple`)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if multiple < 1:
        raise ValueError(f"the vocabulary's padding multiple must be >= 1, got {multiple}")
    rows = -(-vocab_size // (multiple * size)) * multiple
    return rows * size, rank * rows, rows


def real_rows(weight) -> int:
    """How many rows of `weight` (a `vocab_parameter`, this rank's slice) are real ids; the
    last rows beyond them pad."""
    return _real_rows(weight.tp_full, int(weight.tp_index[0]), len(weight.tp_index))


def _held(weight, tp) -> tuple[int, int]:
    """(start, rows): the rows of the padded table that `weight`, this rank's slice, holds."""
    rows = weight.shape[0]
    return tp.rank * rows, rows


def _real_rows(vocab_size: int, start: int, rows: int) -> int:
    """How many of the rows [start, start + rows) are real ids (< vocab_size); the rest pad."""
    return max(0, min(rows, vocab_size - start))


def _allreduce(tp, buf, op: str = "sum"):
    """tp.allreduce(buf, op) in place; nothing at tp = 1."""
    return buf if tp.size == 1 else tp.allreduce(buf, op)


def _local_ids(ids, start: int, rows: int, xp):
    """(ids - start where this rank holds them, else `rows`; held mask)."""
    local = ids - start
    held = (local >= 0) & (local < rows)
    return xp.where(held, local, rows), held


def vocab_parameter(vocab_size, d_model, tp, rng=None, dtype=numpy.float32, std=0.02,
                    multiple=1):
    """This rank's rows of a (V, C) table split by rows over `tp` (None: one rank holding
    every row) and padded as `vocab_shard` says: the full table is drawn from `rng` exactly as
    zmpi.nn's normal_parameter draws it (so the generator advances as for the unpadded serial
    table); padding rows (ids >= V) are zero. The Parameter carries `tp_split = 0`, `tp_index`
    (its rows of the padded table) and `tp_full = V` (gathering and checkpoints drop the
    padding)."""
    size, rank = (1, 0) if tp is None else (tp.size, tp.rank)
    _, start, rows = vocab_shard(vocab_size, size, rank, multiple)
    full = numpy.random.default_rng(rng).normal(0.0, std, (vocab_size, d_model)).astype(dtype)
    local = numpy.zeros((rows, d_model), dtype=dtype)
    real = _real_rows(vocab_size, start, rows)
    local[:real] = full[start:start + real]
    p = Parameter(local)
    p.tp_split, p.tp_index, p.tp_full = 0, numpy.arange(start, start + rows), vocab_size
    return p


def vocab_lookup(weight, idx, tp, vocab_size, check=True, reduce=True):
    """(W[idx] over every rank's rows: (..., C) on every rank in the compute dtype, the cache
    for vocab_lookup_backward). A local lookup (ids held elsewhere give zero rows), then one
    allreduce(sum) over tp. reduce=False: this rank's rows only (the caller sums them, e.g.
    by a reduce-scatter along the sequence under sequence parallelism)."""
    W = live(weight)  # (Vp/tp, C)
    xp = array_module(W)
    idx = xp.asarray(idx)
    if check:
        F.check_indices(idx, vocab_size, "embedding indices")
    start, rows = _held(W, tp)
    local, held = _local_ids(idx, start, rows, xp)
    y = W[xp.minimum(local, rows - 1)].astype(compute_dtype(W), copy=False)
    y *= held[..., None]  # ids held elsewhere: zero rows
    return _allreduce(tp, y) if reduce else y, (local, rows)


def vocab_lookup_backward(weight, dy, cache) -> None:
    """Scatter-add dy into this rank's own rows of `weight` (dy is replicated: no
    communication)."""
    local, rows = cache
    # ids held elsewhere land in a spare last row, dropped: no mask over dy, no sync
    dW = F.embedding_backward(dy, (local, rows + 1))
    accumulate_grad_(weight, dW[:rows])


class VocabParallelEmbedding(Module):
    """y = W[idx] with W (V, C) split by rows over `tp`.  idx (...) int in [0, V) -> y (..., C),
    the full embedding on every rank, in the compute dtype.

    weight: Parameter (Vp/tp, C), this rank's rows of the padded table (`vocab_parameter`,
    padded to a multiple of `multiple` x tp). Forward: `vocab_lookup` (one allreduce over tp);
    backward: `vocab_lookup_backward` (no communication); returns None.
    """

    def __init__(self, vocab_size, d_model, tp, rng=None, dtype=numpy.float32, std=0.02,
                 multiple=1):
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab_size, self.start, self.rows = vocab_shard(vocab_size, tp.size, tp.rank,
                                                                    multiple)
        self.weight = vocab_parameter(vocab_size, d_model, tp, rng, dtype, std, multiple)

    @property
    def real_rows(self) -> int:
        """Rows of `weight` that are real ids; the last rows - real_rows are padding."""
        return _real_rows(self.vocab_size, self.start, self.rows)

    def forward(self, idx, check: bool = True):
        y, cache = vocab_lookup(self.weight, idx, self.tp, self.vocab_size, check)
        self._save(cache)
        return y

    def backward(self, dy):
        vocab_lookup_backward(self.weight, dy, self._pop())
        return None


class VocabParallelLMHead(Module):
    """logits_local = h @ weight.T with `weight` the embedding's local rows (tied, as
    models/gpt.py's LMHead borrows wte).  h (..., C), replicated -> (..., Vp/tp), this rank's
    slice of the padded logits (padding columns -inf: `F.mask_padding`).

    Borrows the embedding (`shared_units`), reads its weight at call time and accumulates into
    the same weight.grad (padding rows get none). Backward returns the full dh: each rank's
    dlogits_local @ weight is a partial sum over its vocabulary rows, allreduced over tp
    (Megatron's copy-to-tensor-parallel-region before the LM head's matmul).
    """

    def __init__(self, embedding: VocabParallelEmbedding):
        self.shared_units = (embedding,)

    @property
    def embedding(self) -> VocabParallelEmbedding:
        return self.shared_units[0]

    def forward(self, h):
        emb = self.embedding
        W = compute_data(emb.weight)  # (Vp/tp, C)
        logits, (h, _) = F.linear_forward(h.astype(W.dtype, copy=False), W.T)
        self._save(h)
        return F.mask_padding(logits, emb.real_rows)

    def backward(self, dlogits):
        emb = self.embedding
        return vocab_head_backward(emb.weight, self._pop(), dlogits, emb.tp)


def vocab_head_backward(weight, h, dlogits, tp, reduce=True):
    """Backward of logits_local = h @ weight.T with `weight` this rank's rows of a padded
    (V, C) table: accumulates into weight.grad and returns dh, summed over tp (each rank's is a
    partial sum over its vocabulary rows); reduce=False: this rank's partial dh (the caller sums
    it, e.g. by a reduce-scatter along the sequence). dlogits is 0 at padding columns (the
    softmax of -inf), so padding rows get a gradient of exactly 0."""
    WT = compute_data(weight).T  # (C, Vp/tp)
    dh, dWT, _ = F.linear_backward(dlogits.astype(WT.dtype, copy=False), (h, WT))
    accumulate_grad_(weight, dWT.T)
    return _allreduce(tp, dh) if reduce else dh


class VocabParallelCrossEntropy(Loss):
    """Softmax cross-entropy of vocabulary-parallel logits: `outputs` (..., Vp/tp) is this
    rank's slice of the padded logits (as VocabParallelLMHead makes), `targets` (...) the full
    int targets (the same on every rank). Returns what zmpi.nn.CrossEntropyLoss returns on the
    gathered (..., V) logits (same ignore_index, normalizer and count contract; float32, or
    float64 for float64 logits), without gathering them: three allreduces of one value per
    position over tp (the max, the sum of exp, the target's logit, to which only the rank
    holding the target contributes). Padding columns (`multiple`: as the embedding's) are -inf
    in the softmax whatever they hold (`F.mask_padding`). Backward returns this rank's slice of
    dloss (softmax - onehot) / normalizer (zero at padding columns and at ignored positions)
    and communicates nothing.
    """

    def __init__(self, tp, vocab_size, ignore_index=None, multiple=1):
        self.tp = tp
        self.vocab_size = vocab_size
        self.ignore_index = ignore_index
        self.padded_vocab_size, self.start, self.rows = vocab_shard(vocab_size, tp.size, tp.rank,
                                                                    multiple)

    def forward(self, outputs, targets, normalizer=None):
        xp = array_module(outputs)
        if outputs.shape[-1] != self.rows:
            raise ValueError(f"vocab-parallel logits must have {self.rows} = "
                             f"{self.padded_vocab_size} / {self.tp.size} columns (this rank's "
                             f"slice), got shape {outputs.shape}")
        dtype = xp.promote_types(outputs.dtype, xp.float32)
        shape = outputs.shape
        z = outputs.reshape(-1, self.rows).astype(dtype)  # (N, Vp/tp), a copy we overwrite
        N = z.shape[0]
        targets = xp.asarray(targets).reshape(-1)  # (N,)
        if targets.shape[0] != N:
            raise ValueError(f"targets have {targets.shape[0]} positions, logits {N}")
        F.check_indices(targets, self.vocab_size, "cross-entropy targets", self.ignore_index)
        mask = None if self.ignore_index is None else targets != self.ignore_index
        if mask is not None:
            targets = xp.where(mask, targets, 0)  # any valid index; masked out below
        if normalizer is None:
            normalizer = N if mask is None else max(int(mask.sum()), 1)
        F.mask_padding(z, _real_rows(self.vocab_size, self.start, self.rows))
        zmax = z.max(axis=-1)  # (N,)
        _allreduce(self.tp, zmax, "max")  # 1: the global max of each position
        z -= zmax[:, None]
        local, held = _local_ids(targets, self.start, self.rows, xp)
        # the shifted target logit where this rank holds the target, else 0 (never read a
        # -inf padding column through the fallback index)
        zt = xp.where(held, z[xp.arange(N), xp.minimum(local, self.rows - 1)], 0.0)
        xp.exp(z, out=z)
        sumexp = z.sum(axis=-1)  # (N,)
        _allreduce(self.tp, sumexp)  # 2: the softmax denominator
        _allreduce(self.tp, zt)  # 3: the target logit, from the rank that holds it
        lse = xp.log(sumexp)  # of the shifted logits
        # as F.cross_entropy_forward computes it (so tp = 1 is the serial loss bit for bit):
        # each position's loss / normalizer, summed; backward recomputes this rank's slice of
        # the softmax from the logits and the log-sum-exp
        per_position = (lse - zt) * dtype.type(1.0 / normalizer)
        if mask is not None:
            per_position = xp.where(mask, per_position, 0)
        self._save(outputs.reshape(-1, self.rows), lse + zmax, local, held, mask, normalizer,
                   shape)
        return per_position.sum()

    def backward(self, dloss=1.0):
        logits, lse, local, held, mask, normalizer, shape = self._pop()
        xp = array_module(logits)
        dlogits = logits.astype(lse.dtype)  # (N, Vp/tp), a copy we overwrite
        dlogits -= lse[:, None]
        xp.exp(dlogits, out=dlogits)  # this rank's slice of the softmax
        dlogits[:, _real_rows(self.vocab_size, self.start, self.rows):] = 0  # padding columns
        rows = xp.arange(dlogits.shape[0])
        cols = xp.minimum(local, self.rows - 1)
        dlogits[rows, cols] -= held.astype(dlogits.dtype)
        dlogits *= lse.dtype.type(dloss / normalizer)
        if mask is not None:
            dlogits *= mask[:, None]
        return dlogits.reshape(shape)

    def count(self, targets):
        if self.ignore_index is None:
            return None
        return int((targets != self.ignore_index).sum())

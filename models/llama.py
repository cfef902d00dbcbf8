"""The Llama family (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) as ZeRO units, the
GPT's way (models/gpt.py; no dropout, no biases).

Units: [TokenPositionEmbedding without positions, LlamaBlock x num_hidden_layers, LMHead with
an RMSNorm]. Each block is pre-norm: x = x + attn(rmsnorm(x)); x = x + swiglu(rmsnorm(x)),
the attention grouped-query (num_key_value_heads key/value heads) with rotary position
embeddings (rope_theta, rope_scaling) shared by every block. The output head owns its own
projection (`lm_head`, untied, Llama's default); tie_word_embeddings=True reads the token
embedding instead, as the GPT does.

    model = Llama(LlamaConfig(vocab_size=65, hidden_size=64, intermediate_size=172,
                              num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64))
    loss = model.loss(idx, targets)   # idx, targets (B, T) int, T <= seq_len
    model.backward_loss()

Every parallel dimension sees the units as the GPT's: ZeRO partitions them, pipelines split
them, tensor parallelism splits each block by its layers' plans (zmpi.parallel.tensor.plan:
q, k, v, gate, up column-parallel; o, down row-parallel; key/value heads split over the tensor
ranks where tp divides num_key_value_heads, replicated where num_key_value_heads < tp) and
the vocabulary by rows; docs/models.md. Attention takes the GPT's three paths: zmpi.nn.gqa's
blocked one, block-sparse over a `sparse_attention` layout of num_attention_heads heads, and
the fused flash kernels (the config's attention_kernel "flash", on a GPU), each reading a
query head's key/value head by index.
"""

from dataclasses import dataclass

import numpy

from zmpi.models.gpt import GPT, LMHead, TokenPositionEmbedding, _sparsity
from zmpi.models.gpt_counts import gpt_activation_bytes
from zmpi.nn import Block, UnitModel
from zmpi.nn.llama_layers import GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLU
from zmpi.parallel.tensor.plan import parallelize
from zmpi.parallel.tensor.vocab import VocabParallelCrossEntropy, vocab_shard


@dataclass
class LlamaConfig:
    """A Llama's shape, in transformers' LlamaConfig names (their defaults where they have a
    small-model meaning; a 65-token toy otherwise), plus zmpi's `seq_len` (the longest
    sequence a batch may hold; None: max_position_embeddings, which it may not pass) and
    `vocab_multiple` (the GPT's: the vocabulary tables padded to a multiple of it times tp;
    None: the backend's default)."""

    vocab_size: int = 65
    hidden_size: int = 128
    intermediate_size: int | None = None  # None: `default_intermediate_size(hidden_size)`
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None: num_attention_heads (multi-head)
    max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    seq_len: int | None = None
    vocab_multiple: int | None = None

    model_type = "llama"  # transformers' name (not a field: it names the class)

    def __post_init__(self):
        if self.intermediate_size is None and type(self.hidden_size) is int:
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.seq_len is None:
            self.seq_len = self.max_position_embeddings
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                    "seq_len"):
            value = getattr(self, key)
            if type(value) is not int or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} > max_position_embeddings "
                             f"{self.max_position_embeddings}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got "
                             f"{self.tie_word_embeddings!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} does not divide "
                             f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                             f"num_attention_heads={self.num_attention_heads}: each key/value "
                             "head serves a whole group of query heads")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"hidden_size / num_attention_heads = head size "
                             f"{self.hidden_size / self.num_attention_heads:g} must be even "
                             "(RoPE rotates pairs of channels)")


def default_intermediate_size(hidden_size: int) -> int:
    """SwiGLU's hidden units when none are given: 8/3 of hidden_size (the 4 d of a GPT's MLP
    times 2/3, so the three matrices hold what its two do), rounded up to a multiple of 8;
    344 at 128 (Llama 2 itself rounds to a multiple of 256: 11008 at 4096)."""
    return -(-8 * hidden_size // 24) * 8


def llama_unit_numels(config: LlamaConfig, tp: int = 1, vocab_multiple: int = 1) -> list[int]:
    """Parameters one rank allocates in each of zmpi's Llama units, [embedding, block x L,
    head], over `tp` tensor ranks with the vocabulary padded to a multiple of vocab_multiple x
    tp: the token table's Vp / tp rows of d; per block the attention's q and o (2 d^2 / tp),
    k and v (2 d kv hd: split over tp where it divides n_kv_head, else whole on every rank),
    SwiGLU's three matrices (3 d f / tp) and the two RMSNorms (2 d); the head's RMSNorm (d)
    and, untied, its own Vp / tp rows."""
    c = config
    d, f, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads
    hd = d // c.num_attention_heads
    rows = vocab_shard(c.vocab_size, tp, 0, vocab_multiple)[2] * d
    kv_numel = 2 * d * kv * hd // (tp if kv % tp == 0 else 1)
    block = (2 * d * d + 3 * d * f) // tp + kv_numel + 2 * d
    return [rows, *[block] * c.num_hidden_layers, d + (0 if c.tie_word_embeddings else rows)]


def llama_num_params(config: LlamaConfig, tp: int = 1, vocab_multiple: int = 1) -> int:
    """The sum of `llama_unit_numels`: at tp 1 and vocab_multiple 1 the model's parameters,
    V d (1 + untied) + L (2 d^2 + 2 d kv hd + 3 d f + 2 d) + d."""
    return sum(llama_unit_numels(config, tp, vocab_multiple))


def llama_flops_per_token(config: LlamaConfig, seq_len: int) -> int:
    """Forward FLOPs per token (2 per multiply-add) of the matrices and the causal attention
    at `seq_len`: 2 (2 d^2 + 2 d kv hd + 3 d f) per block (q, o; k, v; gate, up, down), the
    attention's q k^T and p v over (seq_len + 1) / 2 keys on average, 2 x 2 d (s + 1) / 2,
    and the head's 2 d V. Training is about three times this (backward twice the forward)."""
    c = config
    d, f = c.hidden_size, c.intermediate_size
    kv_width = c.num_key_value_heads * (d // c.num_attention_heads)
    block = 2 * (2 * d * d + 2 * d * kv_width + 3 * d * f) + 2 * d * (seq_len + 1)
    return c.num_hidden_layers * block + 2 * d * c.vocab_size


def llama_activation_bytes(config: LlamaConfig, micro_batch: int, act_bytes: int = 4,
                           tp: int = 1, **options) -> dict:
    """The activations one rank of zmpi's Llama keeps for backward for one micro-batch of
    `micro_batch` sequences of config.seq_len tokens: zmpi.models.gpt_counts.gpt_activation_bytes's
    count (its keyword `options`: sequence_parallel, recompute, partition, cpu, id_bytes,
    block, vocab_multiple, sparsity; the same dict back) with Llama's block: RMSNorms, this
    rank's q and the key/value heads it computes (n_kv_head / tp, or one where tp is a
    multiple of n_kv_head), SwiGLU's gate and up outputs and down input (3 intermediate_size
    / tp per token), no position table; under sequence parallelism q, k, v, gate and up each
    keep the sequence they gathered."""
    c = config
    return gpt_activation_bytes(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                c.vocab_size, c.seq_len, micro_batch, act_bytes, tp,
                                n_kv_head=c.num_key_value_heads,
                                swiglu_hidden=c.intermediate_size, positions=False,
                                separate_projections=True, **options)


# What a Llama block sends over the tensor group per micro-batch, in B T C elements (the GPT's
# is 4: zmpi/cli/estimate.py's tensor_traffic): the attention's and SwiGLU's row-parallel
# outputs forward, and backward the input gradients of q, k, v, gate and up, each its own
# column-parallel layer (docs/models.md)
TENSOR_REDUCTIONS_PER_BLOCK = 7


class LlamaBlock(Block):
    """Llama's pre-norm block, Block's forward and backward over Llama's layers:
    x = x + attn(ln1(x)); x = x + mlp(ln2(x)) with ln1, ln2 RMSNorms, attn a
    GroupedQueryAttention (RoPE from `rope`; block-sparse over `sparsity`'s layout when
    given), mlp a SwiGLU of `hidden` units. x (B, T, C) -> (B, T, C); under sequence
    parallelism the sequence shard, as Block's."""

    def __init__(self, d_model, n_head, n_kv_head, hidden, rope, eps, rng, dtype, std=0.02,
                 sparsity=None):
        self.ln1 = RMSNorm(d_model, eps, dtype)
        self.attn = GroupedQueryAttention(d_model, n_head, n_kv_head, rope, rng, dtype, std,
                                          sparsity=sparsity)
        self.ln2 = RMSNorm(d_model, eps, dtype)
        self.mlp = SwiGLU(d_model, hidden, rng, dtype, std)


class Llama(GPT):
    """A Llama: token embedding, num_hidden_layers LlamaBlocks, final RMSNorm, output head
    (untied unless config.tie_word_embeddings). Parameters in `dtype`, initialised as
    transformers' Llama from `seed` (weights normal(0, 0.02), RMSNorm weights 1).

    tp, sequence_parallel: as the GPT's (the mesh's tensor-parallel Comm; each block split by
    its layers' plans as it is built, the vocabulary by rows, the loss vocabulary-parallel).
    n_head must be a multiple of tp, and num_key_value_heads a multiple or a divisor of it.

    sparse_attention: as the GPT's (None, a DeepSpeed `sparse_attention` section or a
    SparsityConfig) for num_attention_heads query heads: every block's attention block-sparse
    over that layout intersected with the causal mask, each query head reading its key/value
    head, each tensor rank running its own query heads' layouts; the batch's T a multiple of
    the layout's block. The GPT's generate, check_batch and inference serve it unchanged;
    there is no MoE (`moe` is None)."""

    moe = None

    def __init__(self, config, seed=0, dtype=numpy.float32, tp=None, sequence_parallel=False,
                 sparse_attention=None):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama takes a LlamaConfig, got {type(config).__name__}")
        self.config = c = self._setup(config, tp, sequence_parallel)
        sp = self.sequence_parallel
        self.sparse_attention = sparsity = _sparsity(sparse_attention, c.num_attention_heads)
        if self.tp is not None and c.num_attention_heads % tp.size:
            raise ValueError(f"num_attention_heads={c.num_attention_heads} is not divisible by "
                             f"the tensor-parallel size {tp.size}")
        rng = numpy.random.default_rng(seed)
        hd = c.hidden_size // c.num_attention_heads
        rope = RotaryEmbedding(hd, c.rope_theta, c.rope_scaling)  # checks theta and scaling
        embedding = TokenPositionEmbedding(c.vocab_size, c.seq_len, c.hidden_size, rng, dtype,
                                           self.tp, sp, c.vocab_multiple, positions=False)
        blocks = [parallelize(LlamaBlock(c.hidden_size, c.num_attention_heads,
                                         c.num_key_value_heads, c.intermediate_size, rope,
                                         c.rms_norm_eps, rng, dtype, sparsity=sparsity),
                              self.tp, sp)
                  for _ in range(c.num_hidden_layers)]
        head = LMHead(embedding, c.hidden_size, dtype, sp,
                      norm=RMSNorm(c.hidden_size, c.rms_norm_eps, dtype),
                      tied=c.tie_word_embeddings, rng=rng)
        loss = None if self.tp is None else VocabParallelCrossEntropy(
            self.tp, c.vocab_size, multiple=c.vocab_multiple)
        UnitModel.__init__(self, [embedding, *blocks, head], loss=loss)

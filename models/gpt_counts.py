"""Closed-form counts of zmpi's GPT (models/gpt.py), without building it: the parameters each
rank allocates per unit (`gpt_unit_numels`, `gpt_num_params`; MoE blocks by `moe_block_numel`,
their experts by `gpt_expert_numel`), and the activations one rank keeps for backward
(`gpt_activation_bytes`, beside Korthikanti et al.'s `korthikanti_activation_bytes`). What
`zmpi estimate`, `zmpi plan`, `zmpi train`'s size check and the ledger tests count with;
models/moe_counts.py counts what MoE blocks cost beyond their parameters, models/llama.py a
Llama's."""
import functools
from collections import Counter

from zmpi import backend
from zmpi.config.moe import MoEConfig
from zmpi.models.moe_counts import block_activation_bytes
from zmpi.nn import attention as A
from zmpi.nn import sparse_attention as S
from zmpi.nn.sparsity import model_layout
from zmpi.parallel.tensor.vocab import vocab_shard


def moe_config(spec) -> MoEConfig | None:
    """The MoEConfig of GPT's `moe` argument (None, a `moe` config section or a MoEConfig);
    None without experts."""
    if spec is None:
        return None
    section = spec if isinstance(spec, MoEConfig) else MoEConfig.from_dict(spec)
    return section if section.enabled else None


def gpt_unit_numels(n_layer: int, d_model: int, vocab_size: int, seq_len: int,
                    tp: int = 1, vocab_multiple: int = 1, moe=None) -> list[int]:
    """Parameters one rank allocates in each of zmpi's GPT units, [embedding, block x n_layer,
    LM head], with tensor parallelism over `tp` ranks and the vocabulary padded to a multiple
    of vocab_multiple x tp (`vocab_shard`): the token embedding's Vp / tp rows and the position
    embedding's seq_len d; per block
    (12 d^2 + 7 d) / tp split (qkv, fc with biases; proj, mlp.proj weights) and 6 d replicated
    (two LayerNorms, the two row-parallel biases); the head's final LayerNorm, 2 d (it reads
    the tied embedding). moe: a `moe` config section (dict or MoEConfig): its MoE blocks hold
    `moe_block_numel` parameters (each tensor rank's share at tp)."""
    d = d_model
    embedding = (vocab_shard(vocab_size, tp, 0, vocab_multiple)[2] + seq_len) * d
    blocks = [(12 * d * d + 7 * d) // tp + 6 * d] * n_layer
    section = moe_config(moe)
    for i, experts in ({} if section is None else section.layer_experts(n_layer)).items():
        blocks[i] = moe_block_numel(d, experts, section.use_residual,
                                    section.num_shared_experts, tp)
    return [embedding, *blocks, 2 * d]


def moe_block_numel(d_model: int, num_experts: int, use_residual: bool = False,
                    num_shared_experts: int = 0, tp: int = 1) -> int:
    """Parameters one tensor rank of `tp` holds of a GPT block whose MLP is a mixture of
    `num_experts` experts of 4 d hidden units (zmpi.nn.moe.MoE): the attention and LayerNorms'
    (4 d^2 + 3 d) / tp + 5 d (split as a dense block's), the gate's d E (whole), E experts of
    (8 d^2 + 4 d) / tp + d each (split as the dense MLP: zmpi.parallel.expert.tensor, the
    second bias whole), PR-MoE's residual MLP as one expert and its coefficient's 2 d + 2
    (whole) with use_residual, and the shared experts' one MLP of 4 d s hidden units,
    (8 s d^2 + 4 s d) / tp + d. At tp 1: 4 d^2 + 8 d + d E + E (8 d^2 + 5 d) + ..."""
    d, E, s = d_model, num_experts, num_shared_experts
    mlp = _mlp_numel(d, 4 * d, tp)
    return ((4 * d * d + 3 * d) // tp + 5 * d + d * E + E * mlp
            + (mlp + 2 * d + 2 if use_residual else 0)
            + (_mlp_numel(d, 4 * d * s, tp) if s else 0))


def gpt_expert_numel(n_layer: int, d_model: int, moe, tp: int = 1) -> int:
    """The expert parameters among `gpt_num_params`' that one tensor rank of `tp` holds (E
    experts of (8 d^2 + 4 d) / tp + d in each MoE block of the `moe` section; the gate, PR-MoE's
    residual MLP and shared experts are dense): what the engine's expert strategy holds, split
    over moe.ep_size ranks (docs/moe.md)."""
    section = moe_config(moe)
    return sum(experts * _mlp_numel(d_model, 4 * d_model, tp)
               for experts in section.layer_experts(n_layer).values())


def _mlp_numel(d: int, hidden: int, tp: int = 1) -> int:
    """One tensor rank's parameters of an MLP Linear(d, hidden), GELU, Linear(hidden, d) (an
    expert, the GPT's MLP at hidden 4 d): the first layer's weight and bias and the second's
    weight split over tp by the hidden axis, the second bias whole."""
    return (2 * d * hidden + hidden) // tp + d


def gpt_num_params(n_layer: int, d_model: int, vocab_size: int, seq_len: int,
                   tp: int = 1, vocab_multiple: int = 1, moe=None) -> int:
    """Parameters of zmpi's GPT (tied LM head) that one rank allocates with tensor parallelism
    over `tp` ranks and the vocabulary padded to a multiple of vocab_multiple x tp, the sum of
    `gpt_unit_numels`. At tp = 1 and vocab_multiple 1 it is the model's parameters,
    V d + T d + L (12 d^2 + 13 d) + 2 d; otherwise what a rank allocates (padding included).
    moe: the `moe` config section, if any (its blocks counted by `moe_block_numel`). Closed
    form: no list of n_layer blocks, so an absurd n_layer is counted at once (the size check
    of `zmpi train`)."""
    d = d_model
    embedding = (vocab_shard(vocab_size, tp, 0, vocab_multiple)[2] + seq_len) * d
    section = moe_config(moe)
    moe_blocks = {} if section is None else _moe_block_counts(section, n_layer)
    dense_blocks = n_layer - sum(moe_blocks.values())
    return (embedding + dense_blocks * ((12 * d * d + 7 * d) // tp + 6 * d) + 2 * d
            + sum(count * moe_block_numel(d, experts, section.use_residual,
                                          section.num_shared_experts, tp)
                  for experts, count in moe_blocks.items()))


def _moe_block_counts(section, n_layer: int) -> dict[int, int]:
    """{expert count: how many MoE blocks have it} of a GPT of n_layer blocks, without a list
    of the blocks where every block of an interval has the same count (ConfigError, from
    `layer_experts`, where the section does not fit the model)."""
    if section.layers is None and not isinstance(section.num_experts, tuple):
        interval = section.moe_layer_interval
        blocks = len(range(interval - 1, n_layer, interval))
        if blocks:
            return {section.num_experts: blocks}
    return dict(Counter(section.layer_experts(n_layer).values()))


def gpt_activation_bytes(n_layer: int, d_model: int, n_head: int, vocab_size: int,
                         seq_len: int, micro_batch: int, act_bytes: int = 4, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         partition: bool = False, cpu: bool = False, id_bytes: int = 8,
                         block: int | None = None, vocab_multiple: int = 1,
                         sparsity=None, moe=None, kept_rows=None, n_kv_head=None,
                         swiglu_hidden=None, positions=True,
                         separate_projections=False) -> dict:
    """The activations one rank of zmpi's GPT keeps for backward for one micro-batch of
    `micro_batch` sequences of `seq_len` tokens: what the ledger counts as "activation", array
    by array as the layers cache them (docs/activation-memory.md lists every one).

    act_bytes: the activations' itemsize, the compute dtype's (4: fp32, and fp16 or bf16 on
    the host; 2: fp16 or bf16 on a GPU; 8: fp64), the dense attention's probabilities' too;
    LayerNorm's statistics, GELU's tanh, block-sparse probabilities and the loss's
    log-sum-exp are float32 at least. id_bytes: the token ids'
    itemsize (int64). tp: the tensor-parallel degree (it must divide n_head, and seq_len with
    sequence_parallel). recompute: "none", "selective" or "full"; partition and cpu (with
    "full" only): each kept input split over the tp ranks (ceil(n / tp) elements each; not
    with sequence_parallel) / kept on the host. block: the attention's query rows per block
    (its probabilities are the lower-triangular blocks of the s x s matrix); None: this
    backend's, `A.attention_block`. vocab_multiple: the vocabulary's padding (the logits
    have Vp / tp columns, `vocab_shard`). sparsity: a zmpi.nn.sparsity SparsityConfig for
    n_head heads (block-sparse attention): the probabilities are the causal layout's kept
    blocks, padded per row as `sparse_attention_entries` says, of the tensor rank whose heads
    keep the most (with different_layout_per_head ranks differ); `block` is then unused.
    moe: the `moe` config section (tp 1): its MoE blocks keep the MoE layer's arrays in place
    of the MLP's (models/moe_counts.py), their kept assignments `kept_rows` ({block: rows},
    from the routing) or, None, every capacity slot filled (a bound).
    A Llama's blocks (models/llama.py's `llama_activation_bytes`): n_kv_head key/value heads
    (None: n_head; each tensor rank keeps n_kv_head / tp of them, or one where tp is a
    multiple of n_kv_head), a SwiGLU MLP of swiglu_hidden units (None: the GPT's GELU MLP of
    4 d), RMSNorms (the LayerNorms' statistics, without a mean), no position table
    (positions=False), and q, k, v (gate, up) separate layers (separate_projections), each
    keeping its own gathered input under sequence parallelism.

    Returns bytes per rank, {
      "layer": one transformer block's caches (with "full": only while it runs, in its forward
               and again in its recompute); "A", "B": layer = s b h (A + B a s / h) with s
               seq_len, b micro_batch, h d_model, a n_head (Korthikanti et al. 2022's form);
      "embedding", "head", "loss": the embedding's, the final LayerNorm and LM head's, the
               cross-entropy's caches;
      "kept_per_layer", "kept": a block's kept input, and every kept input (the token ids
               and n_layer block inputs), with "full" (else 0);
      "device": the peak on the device, "host": the kept inputs with cpu (else 0),
      "peak_at": when the device peak happens,
      "blocks": each block's caches, [block 0, ...] ("layer" each without MoE blocks)}.
    Without "full" the peak is the end of the loss's forward: everything cached at once.
    With "full" it is the kept inputs (on the device unless cpu) plus one unit's working set
    at its largest: the last block's forward (its recompute in backward holds no more) or the
    LM head and loss at the end of the forward. (The embedding's working set, ids and
    positions, is always smaller than a block's.)
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute {recompute!r}: use 'none', 'selective' or 'full'")
    if (partition or cpu) and recompute != "full":
        raise ValueError("partition and cpu act on the inputs that full recompute keeps")
    if moe is not None and tp > 1:
        raise ValueError("MoE blocks' activations are counted at tp 1 only")
    if d_model % n_head or n_head % tp:
        raise ValueError(f"n_head={n_head} must divide d_model={d_model} and be a multiple of "
                         f"tp={tp}")
    shard = tp if sequence_parallel and tp > 1 else 1  # the sequence shard's divisor
    if seq_len % shard:
        raise ValueError(f"seq_len={seq_len} is not divisible by tp={tp} (sequence parallel)")
    if partition and shard > 1:
        raise ValueError("partition: with sequence parallelism the kept inputs are already "
                         "each rank's share")
    s, b, h, a = seq_len, micro_batch, d_model, n_head
    if block is None:
        block = A.attention_block(s, b * a // tp, backend.is_gpu)
    p, f = act_bytes, max(4, act_bytes)
    n = b * s  # positions
    entries = (a // tp) * A.causal_entries(s, block) if sparsity is None else \
        _sparse_entries(sparsity, s, tp)  # this rank's heads' probabilities
    probs = 0 if recompute == "selective" else (p if sparsity is None else f) * b * entries
    layernorm = f * (n // shard) * (h + 1)  # xhat (b, s, h) and rstd (b, s, 1), or the shard
    kv = h // tp if n_kv_head is None else max(n_kv_head // tp, 1) * (h // a)  # k's columns
    # this rank's q, k, v and proj input; the MLP's GELU input, tanh (f) and mlp.proj input,
    # or SwiGLU's gate and up outputs and down input
    attention = p * n * (2 * (h // tp) + 2 * kv)
    mlp = (8 * p + 4 * f) * n * (h // tp) if swiglu_hidden is None else \
        3 * p * n * (swiglu_hidden // tp)
    # ln1, ln2; the inputs of qkv and fc, whole (gathered under sequence parallelism)
    inputs = 5 if separate_projections and shard > 1 else 2
    layer = 2 * layernorm + inputs * p * n * h + attention + mlp + probs
    # the ids (tp > 1: this rank's local ids), the positions
    embedding = id_bytes * n + (8 * s if positions else 0)
    head = layernorm + p * n * h  # ln_f, the LM head's (gathered) input
    columns = vocab_shard(vocab_size, tp, 0, vocab_multiple)[2]  # the padded vocabulary's
    if tp == 1:  # the logits (n, Vp), each row's log-sum-exp and the targets
        loss = p * n * columns + f * n + id_bytes * n
    else:  # this rank's logit columns, log-sum-exp, local target ids and the held mask
        loss = p * n * columns + f * n + id_bytes * n + n
    out = {"layer": layer, "A": (layer - probs) / (s * b * h), "B": probs / (a * s * s * b),
           "embedding": embedding, "head": head, "loss": loss,
           "kept_per_layer": 0, "kept": 0, "host": 0}
    out["blocks"] = blocks = block_activation_bytes(
        layer, p * n * h + mlp, n_layer, d_model, s, b, moe, p, kept_rows)
    if recompute != "full":
        out.update(device=embedding + sum(blocks) + head + loss,
                   peak_at="the end of the loss's forward")
        return out
    split = tp if partition else 1

    def kept(elements, itemsize):
        return -(-elements // split) * itemsize

    x = kept(n // shard * h, p)  # a block's input (b, s, h), or its sequence shard
    out["kept_per_layer"], out["kept"] = x, kept(n, id_bytes) + n_layer * x
    work = max(*blocks, head + loss)
    out.update(device=work + (0 if cpu else out["kept"]), host=out["kept"] if cpu else 0,
               peak_at=("the last block's forward" if moe is None else
                        "the largest block's forward") if max(blocks) >= head + loss
               else "the end of the loss's forward")
    return out


@functools.lru_cache(maxsize=64)
def _sparse_entries(sparsity, seq_len: int, tp: int) -> int:
    """Probability entries per sequence of the tensor rank whose heads keep the most of
    `sparsity`'s causal layout at seq_len (S.sparse_attention_entries; made once)."""
    layout, heads = model_layout(sparsity, seq_len), sparsity.num_heads // tp
    return max(S.sparse_attention_entries(layout[r * heads:(r + 1) * heads], sparsity.block)
               for r in range(tp))


def korthikanti_activation_bytes(n_layer: int, d_model: int, n_head: int, seq_len: int,
                                 micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                                 recompute: str = "none") -> dict:
    """Korthikanti et al. 2022's activation memory per transformer layer (their Table 2;
    16-bit activations, dropout masks of one byte), bytes per rank: {"A", "B", "layer",
    "total"}, layer = s b h (A + B a s / h) and total = n_layer layers (the paper counts the
    embedding and the output layer apart). A = 10 + 24 / t, or 34 / t with sequence
    parallelism; B = 5 / t, 0 with selective recompute; full recompute keeps the layer's
    input, A = 2 (2 / t with sequence parallelism: the input is the sequence shard), B = 0."""
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        A, B = (2 / tp if sp else 2), 0
    else:
        A, B = (34 / tp if sp else 10 + 24 / tp), (0 if recompute == "selective" else 5 / tp)
    s, b, h = seq_len, micro_batch, d_model
    layer = s * b * h * (A + B * n_head * s / h)
    return {"A": A, "B": B, "layer": layer, "total": n_layer * layer}

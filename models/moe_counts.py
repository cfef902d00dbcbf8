"""What a GPT's MoE blocks cost beyond their parameters (models/gpt_counts.py's `moe_block_numel`
counts those): the all-to-all traffic of expert parallelism and the activations an MoE layer
keeps for backward, per rank and micro-batch, by the arrays zmpi.nn.moe and
zmpi.parallel.expert build (docs/moe.md, "Checkpoints and accounting").

Both depend on the routing groups: the GPT routes each sequence as one group of S = seq_len
tokens, so a micro-batch of b sequences is G = b groups, and every expert keeps at most

    capacity = max(ceil(k S / E x capacity_factor), min_capacity)

assignments of a group (`expert_capacity`). Without drops (`drop_tokens` false) the capacity
is the busiest expert's, known only after routing; it is at most S (a token's k choices are
distinct experts), and that bound is what is counted then (`upper_bound` says so).
"""
from __future__ import annotations

from zmpi.config.moe import MoEConfig
from zmpi.nn.moe.router import expert_capacity


def _section(moe) -> MoEConfig:
    return moe if isinstance(moe, MoEConfig) else MoEConfig.from_dict(moe)


def layer_capacity(moe, num_experts: int, seq_len: int) -> int:
    """The capacity buffers' rows per expert and group of one MoE layer of `num_experts`
    experts, for groups of seq_len tokens (training's capacity factor); dropless, its bound
    seq_len."""
    section = _section(moe)
    if not section.drop_tokens:
        return seq_len
    return expert_capacity(seq_len, num_experts, section.k, section.capacity_factor,
                           section.min_capacity)


def moe_alltoall(n_layer: int, d_model: int, seq_len: int, micro_batch: int, moe,
                 recompute: str = "none") -> dict:
    """The all-to-alls one rank makes over its expert-parallel group (moe.ep_size ranks) for
    one micro-batch, forward and backward, as the counters of the group count them
    (zmpi.parallel.expert.dispatcher): per MoE layer 4 calls (dispatch and combine forward,
    their gradients backward; 6 with full recompute, whose second forward exchanges again),
    each of a capacity buffer of E x G x capacity x d_model elements, of which (ep - 1) / ep
    leave the rank. Dropless, one allreduce_scalar of the capacity per forward as well.

    Returns {"calls", "elements" (the buffers' elements, the counters' `bytes` over the
    itemsize), "sent_elements" ((ep - 1) / ep of them), "scalar_calls" (dropless's),
    "upper_bound" (dropless: the capacity bound S is counted)}; all 0 at ep_size 1 (nothing
    travels)."""
    section = _section(moe)
    ep = section.ep_size
    forwards = 2 if recompute == "full" else 1
    out = {"calls": 0, "elements": 0, "sent_elements": 0, "scalar_calls": 0,
           "upper_bound": not section.drop_tokens}
    if ep == 1:
        return out
    for experts in section.layer_experts(n_layer).values():
        buffer = experts * micro_batch * layer_capacity(section, experts, seq_len) * d_model
        calls = 2 * forwards + 2
        out["calls"] += calls
        out["elements"] += calls * buffer
        out["sent_elements"] += calls * buffer * (ep - 1) // ep
        out["scalar_calls"] += 0 if section.drop_tokens else forwards
    return out


def moe_layer_activation_bytes(d_model: int, num_experts: int, seq_len: int,
                               micro_batch: int, moe, act_bytes: int = 4,
                               kept_rows: int | None = None) -> int:
    """Bytes one MoE layer (and the LayerNorm output it reads) keeps for backward for one
    micro-batch, array by array as the ledger counts them (each owning buffer once), with
    n = micro_batch x seq_len tokens, C = d_model, H = 4 C, E = num_experts, k choices, p =
    act_bytes and f = max(4, p) (the router computes in float32 at least):

        the layer's input (the LayerNorm's output)      p n C
        router: probabilities, log-sum-exp, chosen p    f n (E + 1 + k), and Jitter's
                factors f n C; the choices (int64)      8 n k; f per group (float64) 8 G E
        combine weights (k > 1: normalised)             f n k
        permutation: row_choice, row_of (int64)         16 n k, row_token 8 M
        experts, on R rows: input, GELU's input, tanh,
                output, and the output                  R (2 p C + (2 p + f) H)
        expert parallel: each kept row's place (int64)
                and the output it got back              M (8 + p C)
        PR-MoE: the residual MLP, its and the experts'
                outputs, the coefficients               (2 p + f) n H + 2 p n C + 2 p n
        shared experts: one MLP of s H                  (2 p + f) n s H

    M: the kept assignments; R: the rows the experts run on, M in one process, every slot of
    the capacity buffers (E G capacity) at ep_size above 1. M depends on the routing: give
    `kept_rows` (the layer's routing.kept.sum()) for the exact count, or None for its bound,
    every slot filled (M = min(k S, E capacity) G)."""
    section = _section(moe)
    p, f, C, E, k = act_bytes, max(4, act_bytes), d_model, num_experts, section.k
    H, G, n = 4 * d_model, micro_batch, micro_batch * seq_len
    M, R = _rows(section, E, seq_len, micro_batch, kept_rows)
    expert_parallel = section.ep_size > 1
    total = p * n * C + f * n * (E + 1 + k) + 8 * n * k + 8 * G * E
    total += f * n * C if section.noisy_gate_policy == "Jitter" else 0
    total += f * n * k if k > 1 else 0
    total += 16 * n * k + 8 * M
    total += R * (2 * p * C + (2 * p + f) * H)
    total += M * (8 + p * C) if expert_parallel else 0
    total += (2 * p + f) * n * H + 2 * p * n * C + 2 * p * n if section.use_residual else 0
    total += (2 * p + f) * n * section.num_shared_experts * H
    return total


def _rows(section: MoEConfig, num_experts: int, seq_len: int, micro_batch: int,
          kept_rows: int | None = None) -> tuple[int, int]:
    """(M, R): the kept assignments (`kept_rows`, or None: the bound, every capacity slot
    filled, min(k S, E capacity) per group) and the rows the experts run on (M in one
    process, E G capacity at ep_size above 1)."""
    E, G = num_experts, micro_batch
    capacity = layer_capacity(section, E, seq_len)
    M = min(section.k * seq_len, E * capacity) * G if kept_rows is None else kept_rows
    return M, (E * G * capacity if section.ep_size > 1 else M)


def moe_extra_flops(n_layer: int, d_model: int, seq_len: int, micro_batch: int, moe,
                    useful: bool = False) -> int:
    """Forward FLOPs (2 a multiply-add) one rank's MoE blocks add to one micro-batch beyond
    the dense MLPs they replace (2 x 8 d^2 a token each): per MoE layer the gate's d E a
    token, the experts' 8 d^2 on each of the R rows they run on (every capacity slot filled
    in one process: a bound; every slot of the buffers at ep_size above 1; `useful`: the k
    assignments of every token, none dropped or padded: the model's FLOPs), PR-MoE's residual
    MLP and coefficient, the shared experts' MLP."""
    section = _section(moe)
    C, n, mlp = d_model, micro_batch * seq_len, 8 * d_model * d_model
    extra = 0
    for experts in section.layer_experts(n_layer).values():
        rows = section.k * n if useful else _rows(section, experts, seq_len, micro_batch)[1]
        extra += n * C * experts + rows * mlp - n * mlp
        extra += n * (mlp + 2 * C) if section.use_residual else 0
        extra += n * section.num_shared_experts * mlp
    return 2 * extra


def block_activation_bytes(layer: int, mlp: int, n_layer: int, d_model: int, seq_len: int,
                           micro_batch: int, moe, act_bytes: int = 4,
                           kept_rows: dict | None = None) -> list[int]:
    """Each block's activations, [block 0, ..., block n_layer - 1], for a GPT whose dense block
    keeps `layer` bytes of which `mlp` are its MLP's (and its input's): the MoE blocks of the
    `moe` section (None: none) keep `moe_layer_activation_bytes` in place of the MLP's.
    kept_rows: {block index: its kept assignments} for the exact count, None for the bound."""
    blocks = [layer] * n_layer
    if moe is None:
        return blocks
    section = _section(moe)
    for i, experts in section.layer_experts(n_layer).items():
        rows = None if kept_rows is None else kept_rows[i]
        blocks[i] = layer - mlp + moe_layer_activation_bytes(
            d_model, experts, seq_len, micro_batch, section, act_bytes, rows)
    return blocks

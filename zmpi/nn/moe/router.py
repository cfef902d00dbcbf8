"""The router of a mixture of experts: which experts each token goes to, with what weight, and
which of those assignments the experts' capacity keeps. It knows nothing of ranks.

Tokens are routed in *groups* of S consecutive tokens (GShard's groups): capacity, the tokens
each expert takes from a group, is counted per group, and a group's random draws depend only
on the seed, the routing key and the group's index in the global batch. A layout that splits
the batch differently (data or expert parallel ranks, micro-batches) therefore routes and
drops exactly the tokens one process does, as long as it gives each rank's groups their global
index (`Router.group_offset`).

Per token t of x (N, C), with the gate W (C, E):

    logits = (x * u) @ W      u = 1 without Jitter, else uniform(1 - 0.01, 1 + 0.01) (N, C)
    p      = softmax(logits)  (N, E), float32 at least
    choice j of token t: argmax of the scores over the experts not chosen before, the scores
        being the logits, plus Gumbel noise g (N, E) under RSample (every choice) or
        second-expert sampling (choices after the first): top-k of logits + g samples k
        experts without replacement in proportion to p (the Gumbel top-k trick)
    weight of choice j:  p[t, e_j] (k = 1, Switch)  or  p[t, e_j] / sum_i p[t, e_i] (k > 1)

Capacity: in each group, the assignments (token, choice) of one expert are ranked by choice
(every first choice before any second one, as GShard and DeepSpeed), then by position in the
group, or at random under use_rts (DeepSpeed's random token selection); an expert keeps the
first `capacity` of them (`expert_capacity`). Without drop_tokens every assignment is kept.

Losses (each enters backward with its coefficient; `Router.aux_loss` and `Router.z_loss` hold
their values, coefficient included, after each forward):
    load balancing  aux_coef * mean over groups of E * sum_e f_e * P_e   (Switch)
                    f_e: the share of the group's k*S assignments that chose e (before any
                    drop; constant for the gradient); P_e: the mean of p[:, e] over the group
    z-loss          z_coef * mean over tokens of logsumexp(logits)^2     (ST-MoE)
"""

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy

from zmpi.backend import array_module
from zmpi.nn.base import Module
from zmpi.nn.checks import check_int, check_number
from zmpi.nn.layers import normal_parameter
from zmpi.nn.parameter import accumulate_grad_, compute_data

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPS = 1e-2  # DeepSpeed's multiplicative_jitter epsilon
# independent random streams of a group's draws: switching one option on leaves the others'
STREAM_JITTER, STREAM_GUMBEL, STREAM_RTS = 0, 1, 2


def expert_capacity(tokens: int, num_experts: int, k: int, capacity_factor: float,
                    min_capacity: int) -> int:
    """Assignments each expert keeps from a group of `tokens` tokens:
    max(ceil(k * tokens / num_experts * capacity_factor), min_capacity), computed exactly with
    the capacity factor as written (1.1 is 11/10, not the binary float just above it, so 10
    tokens at 1.1 give 11, not 12)."""
    exact = Fraction(k * tokens, num_experts) * Fraction(repr(float(capacity_factor)))
    return max(math.ceil(exact), min_capacity)


@dataclass
class Routing:
    """What the router decided for N tokens in G groups of S, each with k choices among E.

    experts (N, k) int64: the expert of each choice.
    weights (N, k): each choice's combine weight, before any drop (the compute dtype of the
        router: float32 at least).
    kept (N, k) bool: the choice is within its expert's capacity (all True without drops).
    slot (N, k) int64: the choice's rank among its expert's assignments in its group (< capacity
        where kept): its row in that expert's capacity buffer for the group.
    capacity: assignments an expert keeps per group; without drop_tokens, the largest number
        any expert received from a group.
    load (E,) int64: assignments each expert received, before drops (the load histogram).
    """

    experts: object
    weights: object
    kept: object
    slot: object
    capacity: int
    group_size: int
    num_experts: int
    load: object

    @property
    def k(self) -> int:
        return self.experts.shape[1]

    @property
    def groups(self) -> int:
        return self.experts.shape[0] // self.group_size

    @property
    def dropped(self):
        """Assignments over their expert's capacity (0-d int array, on the routing's device;
        tokens for k = 1): the experts skipped them, the residual carries their token."""
        return (~self.kept).sum()


def _f32(dtype):
    return numpy.promote_types(dtype, numpy.float32)


class Router(Module):
    """Linear gate (C, E) without bias, softmax, top-k with capacity (see the module's doc).

    forward(x (N, C), group_size) -> Routing; backward(dweights (N, k), scale) -> dx (N, C):
    dweights is the gradient of the combined output with respect to `Routing.weights` (zero
    where dropped), `scale` multiplies the gradients of the auxiliary and z losses (the factor
    the main loss's gradient carries: the loss scale over the micro-batches).

    Random draws (Jitter, Gumbel noise, random token selection) come only while `training`,
    from a NumPy Philox stream keyed by (seed, *routing_key, group_offset + group, stream):
    the same on every layout and on NumPy and CuPy (drawn on the host).
    """

    def __init__(self, d_model, num_experts, k=1, *, capacity_factor=1.0,
                 eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_rts=True,
                 noisy_gate_policy=None, top2_2nd_expert_sampling=None, aux_loss_coef=0.01,
                 z_loss_coef=0.0, seed=0, rng=None, dtype=numpy.float32, std=0.02):
        check_int("d_model", d_model, 1)
        check_int("num_experts", num_experts, 1)
        check_int("k", k, 1)
        if k > num_experts:
            raise ValueError(f"k={k} experts per token, but only num_experts={num_experts}")
        check_number("capacity_factor", capacity_factor, strict=True)
        check_number("eval_capacity_factor", eval_capacity_factor, strict=True)
        check_int("min_capacity", min_capacity, 0)
        for name, value in (("drop_tokens", drop_tokens), ("use_rts", use_rts)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES + ("None",):
            raise ValueError(f"noisy_gate_policy {noisy_gate_policy!r}: use None, 'Jitter' or "
                             "'RSample'")
        if not (top2_2nd_expert_sampling is None or isinstance(top2_2nd_expert_sampling, bool)):
            raise ValueError("top2_2nd_expert_sampling must be True, False or None (on for "
                             f"k > 1), got {top2_2nd_expert_sampling!r}")
        if top2_2nd_expert_sampling and k == 1:
            raise ValueError("top2_2nd_expert_sampling samples the choices after the first: "
                             "it needs k >= 2 (k=1 here)")
        check_number("aux_loss_coef", aux_loss_coef)
        check_number("z_loss_coef", z_loss_coef)
        check_int("seed", seed, 0)
        self.num_experts, self.k = num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens, self.use_rts = min_capacity, drop_tokens, use_rts
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.second_expert_sampling = (k > 1 if top2_2nd_expert_sampling is None
                                       else top2_2nd_expert_sampling)
        self.aux_loss_coef, self.z_loss_coef, self.seed = aux_loss_coef, z_loss_coef, seed
        self.weight = normal_parameter(rng, (d_model, num_experts), std, dtype)
        self.training = True
        self.routing_key = (0,)
        self.group_offset = 0
        self.aux_loss = self.z_loss = None

    # -- random draws -------------------------------------------------------------------------
    def _draw(self, groups, stream, draw):
        """One host array per group, concatenated: `draw(generator)` with the generator of
        (seed, *routing_key, group_offset + g, stream)."""
        out = []
        for g in range(groups):
            key = [self.seed, *self.routing_key, self.group_offset + g, stream]
            out.append(draw(numpy.random.Generator(numpy.random.Philox(key))))
        return numpy.concatenate(out)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x, group_size):
        xp, (N, C), E, k = array_module(x), x.shape, self.num_experts, self.k
        G, S = N // group_size, group_size
        f = _f32(x.dtype)
        W = compute_data(self.weight).astype(f, copy=False)
        xg = x.astype(f, copy=False)
        jitter = None
        if self.training and self.noisy_gate_policy == "Jitter":
            jitter = xp.asarray(self._draw(G, STREAM_JITTER, lambda r: r.uniform(
                1.0 - JITTER_EPS, 1.0 + JITTER_EPS, (S, C))), dtype=f)
            xg = xg * jitter
        logits = xg @ W  # (N, E)
        m = logits.max(axis=1, keepdims=True)
        p = xp.exp(logits - m)
        total = p.sum(axis=1, keepdims=True)
        p /= total
        lse = (xp.log(total) + m)[:, 0]  # (N,)

        experts = self._choose(logits, G, S)  # (N, k)
        chosen = p[xp.arange(N)[:, None], experts]  # (N, k)
        weights = chosen if k == 1 else chosen / chosen.sum(axis=1, keepdims=True)

        slot, counts = self._rank(experts, G, S)  # (N, k), (G, E) assignments before drops
        if self.drop_tokens:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            capacity = expert_capacity(S, E, k, factor, self.min_capacity)
            kept = slot < capacity
        else:
            capacity = max(int(counts.max()), 1)
            kept = xp.ones(experts.shape, dtype=bool)
        share = counts / (k * S)  # f (G, E)
        balance = E * (share * p.reshape(G, S, E).mean(axis=1)).sum(axis=1).mean()
        self.aux_loss = self.aux_loss_coef * balance
        self.z_loss = self.z_loss_coef * (lse * lse).mean()
        self._save(x, jitter, p, lse, experts, chosen, share)
        return Routing(experts, weights, kept, slot, capacity, S, E, counts.sum(axis=0))

    def _choose(self, logits, G, S):
        """(N, k) experts: successive argmaxes of the scores, each over the experts not yet
        chosen; Gumbel noise on the choices it applies to (the module's doc)."""
        xp, k = array_module(logits), self.k
        noisy = self.training and (self.noisy_gate_policy == "RSample"
                                   or self.second_expert_sampling)
        noise = xp.asarray(self._draw(G, STREAM_GUMBEL, lambda r: r.gumbel(
            size=(S, self.num_experts))), dtype=logits.dtype) if noisy else None
        rows = xp.arange(logits.shape[0])
        scores = logits.copy()
        if noise is not None and self.noisy_gate_policy == "RSample":
            scores += noise
        experts = xp.empty((logits.shape[0], k), dtype=xp.int64)
        for j in range(k):
            if j == 1 and noise is not None and self.noisy_gate_policy != "RSample":
                scores += noise  # second-expert sampling: from the second choice on
            experts[:, j] = scores.argmax(axis=1)
            scores[rows, experts[:, j]] = -xp.inf
        return experts

    def _rank(self, experts, G, S):
        """Each assignment's rank among its expert's in its group (slot (N, k)), and the
        number each expert received from each group (counts (G, E)). Priority: the choice,
        then the position in the group, or a random order under use_rts while training."""
        xp, E, k = array_module(experts), self.num_experts, self.k
        if self.use_rts and self.training:
            u = xp.asarray(self._draw(G, STREAM_RTS, lambda r: r.random((1, k, S))))
            position = xp.argsort(xp.argsort(u, axis=2), axis=2)  # (G, k, S) random ranks
        else:
            position = xp.broadcast_to(xp.arange(S), (G, k, S))
        priority = xp.arange(k)[None, :, None] * S + position  # (G, k, S), distinct per group
        e = experts.reshape(G, S, k).transpose(0, 2, 1)  # (G, k, S)
        segment = xp.arange(G)[:, None, None] * E + e  # (group, expert)
        order = xp.argsort((segment * (k * S) + priority).ravel())
        counts = xp.bincount(segment.ravel(), minlength=G * E)
        start = xp.cumsum(counts) - counts
        rank = xp.empty(G * k * S, dtype=xp.int64)
        rank[order] = xp.arange(G * k * S) - start[segment.ravel()[order]]
        slot = rank.reshape(G, k, S).transpose(0, 2, 1).reshape(G * S, k)
        return slot, counts.reshape(G, E)

    # -- backward -----------------------------------------------------------------------------
    def backward(self, dweights, scale=1.0):
        x, jitter, p, lse, experts, chosen, share = self._pop()
        xp, (N, E), k = array_module(p), p.shape, self.k
        G = share.shape[0]
        dw = dweights.astype(p.dtype, copy=False)
        if k > 1:  # w_j = p_j / s: dp_j = (dw_j - sum_i dw_i w_i) / s
            s = chosen.sum(axis=1, keepdims=True)
            dw = (dw - (dw * chosen).sum(axis=1, keepdims=True) / s) / s
        dp = xp.zeros_like(p)
        dp[xp.arange(N)[:, None], experts] = dw  # a token's k experts are distinct
        if self.aux_loss_coef:  # d/dp[t, e] of aux_coef * mean_g E sum_e f_ge P_ge
            aux = (self.aux_loss_coef * scale * E / N) * share  # (G, E)
            dp.reshape(G, N // G, E)[...] += aux[:, None, :]
        dlogits = p * (dp - (dp * p).sum(axis=1, keepdims=True))
        if self.z_loss_coef:
            dlogits += ((2.0 * self.z_loss_coef * scale / N) * lse)[:, None] * p
        W = compute_data(self.weight).astype(p.dtype, copy=False)
        xg = x.astype(p.dtype, copy=False)
        if jitter is not None:
            xg = xg * jitter
        accumulate_grad_(self.weight, xg.T @ dlogits)
        dx = dlogits @ W.T
        if jitter is not None:
            dx *= jitter
        return dx.astype(x.dtype, copy=False)

"""The mixture-of-experts layer: router, token dispatcher and experts behind one Module
(Megatron-Core's split), with DeepSpeed-MoE's residual MoE and DeepSeek-MoE's shared experts.

    y = sum over the kept choices j of token t of  weight_tj * expert_{e_tj}(x_t)
    PR-MoE (use_residual):   y = y * c_0 + mlp(x_t) * c_1,   c = softmax(x_t @ Wc + bc) (2,)
    shared experts:          y = y + shared(x_t)   (one MLP of num_shared_experts * hidden)

A token whose every choice was dropped gets y = 0 from the experts: in a pre-LN block
(x + moe(ln(x))) it passes through on the residual. See docs/moe.md.
"""

import numpy

from zmpi.backend import array_module
from zmpi.nn.base import Module
from zmpi.nn.checks import check_int
from zmpi.nn.layers import Linear
from zmpi.nn.moe.dispatcher import TokenDispatcher
from zmpi.nn.moe.experts import Experts
from zmpi.nn.moe.router import Router


class MoE(Module):
    """Mixture of experts.  x (..., C) -> y (..., C); the tokens are x's leading axes.

    num_experts E, k experts per token, each expert an MLP of `hidden` units (default 4 C).
    Routing options (DeepSpeed's names; zmpi.nn.moe.router says what each does):
    capacity_factor, eval_capacity_factor, min_capacity, drop_tokens, use_rts,
    noisy_gate_policy (None, "Jitter", "RSample"), top2_2nd_expert_sampling (None: on for
    k > 1), aux_loss_coef, z_loss_coef, seed. use_residual: PR-MoE's dense MLP beside the
    experts with a learned mixing coefficient; num_shared_experts: always-on experts.

    group_size: tokens per routing group (capacity is counted per group); None for one
    sequence, x's second-to-last axis (all of a 2-D x). It must divide the number of tokens.

    Set by whoever runs the layer (the model or the engine), never by the layer itself:
      training          False for evaluation: eval_capacity_factor, and no random draw
      set_routing(key, group_offset)
                        the routing key (e.g. (step, micro-batch)) the random draws depend
                        on, and the global index of this call's first group (a rank with
                        the second half of a batch of 2 G groups passes G): the same key and
                        global groups route the same tokens on every layout, and the
                        forward that recompute repeats draws the same numbers
      aux_loss_scale    what the main loss's gradient is multiplied by (the loss scale over
                        the micro-batches): the auxiliary and z losses' gradients get it too
    After forward: aux_loss and z_loss (0-d arrays, coefficients included, to add to the
    reported loss) and routing (zmpi.nn.moe.router.Routing: choices, drops, expert load).

    `experts` and `dispatcher` are the layer's two replaceable parts: expert parallelism
    (zmpi.parallel.expert.expert_parallel) swaps in this rank's share of the experts and a
    dispatcher with TokenDispatcher's interface that moves rows between ranks.
    `sequence_in`, `sequence_out`: None, or set by tensor parallelism with sequence
    parallelism (zmpi.parallel.expert.tensor): x and y are then this rank's sequence shard
    (B, T/tp, C), the layer running on the whole sequence between them.
    """

    def __init__(self, d_model, num_experts, k=1, *, hidden=None, capacity_factor=1.0,
                 eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_rts=True,
                 noisy_gate_policy=None, top2_2nd_expert_sampling=None, aux_loss_coef=0.01,
                 z_loss_coef=0.0, use_residual=False, num_shared_experts=0, group_size=None,
                 seed=0, rng=None, dtype=numpy.float32, std=0.02, proj_std=None):
        hidden = 4 * d_model if hidden is None else hidden
        check_int("hidden", hidden, 1)
        check_int("num_shared_experts", num_shared_experts, 0)
        if group_size is not None:
            check_int("group_size", group_size, 1)
        if not isinstance(use_residual, bool):
            raise ValueError(f"use_residual must be True or False, got {use_residual!r}")
        rng = numpy.random.default_rng(rng)
        self.router = Router(d_model, num_experts, k, capacity_factor=capacity_factor,
                             eval_capacity_factor=eval_capacity_factor,
                             min_capacity=min_capacity, drop_tokens=drop_tokens,
                             use_rts=use_rts, noisy_gate_policy=noisy_gate_policy,
                             top2_2nd_expert_sampling=top2_2nd_expert_sampling,
                             aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, seed=seed,
                             rng=rng, dtype=dtype, std=std)
        mlp = {"rng": rng, "dtype": dtype, "std": std, "proj_std": proj_std}
        self.experts = Experts(num_experts, d_model, hidden, **mlp)
        self.residual_mlp = Experts(1, d_model, hidden, **mlp) if use_residual else None
        self.coefficient = Linear(d_model, 2, rng=rng, dtype=dtype) if use_residual else None
        self.shared_experts = (Experts(1, d_model, num_shared_experts * hidden, **mlp)
                               if num_shared_experts else None)
        self.dispatcher = TokenDispatcher()
        # sequence parallelism's entry and exit (zmpi.parallel.expert.tensor), None without
        self.sequence_in = self.sequence_out = None
        self.d_model, self.group_size = d_model, group_size
        self.aux_loss_scale = 1.0
        self.routing = None

    # -- what the caller sets -----------------------------------------------------------------
    @property
    def training(self) -> bool:
        return self.router.training

    @training.setter
    def training(self, value: bool) -> None:
        self.router.training = bool(value)

    def set_routing(self, key=(0,), group_offset=0) -> None:
        """The routing key (a tuple of ints >= 0) and the global index of the first group."""
        key = tuple(key) if isinstance(key, (tuple, list)) else (key,)
        for i, part in enumerate(key):
            check_int(f"routing key[{i}]", part, 0)
        check_int("group_offset", group_offset, 0)
        self.router.routing_key, self.router.group_offset = key, group_offset

    @property
    def aux_loss(self):
        return self.router.aux_loss

    @property
    def z_loss(self):
        return self.router.z_loss

    # -- forward / backward -------------------------------------------------------------------
    def forward(self, x):
        if self.sequence_in is not None:  # the whole sequence from this rank's shard
            x = self.sequence_in.forward(x)
        C = self.d_model
        if x.ndim < 2 or x.shape[-1] != C:
            raise ValueError(f"MoE input must be (..., tokens, {C}), got shape {x.shape}")
        x2 = x.reshape(-1, C)
        if x2.shape[0] == 0:
            raise ValueError(f"MoE input has no tokens (shape {x.shape})")
        S = x.shape[-2] if self.group_size is None else self.group_size
        if x2.shape[0] % S:
            raise ValueError(f"{x2.shape[0]} tokens do not split into routing groups of "
                             f"group_size={S}")
        self.routing = routing = self.router.forward(x2, S)
        rows, perm = self.dispatcher.dispatch(x2, routing)
        out = self.experts.forward(rows, perm.counts)
        y = self.dispatcher.combine(out, perm, routing.weights)
        mix = None
        if self.residual_mlp is not None:
            r = self.residual_mlp.forward(x2)
            c = _softmax(self.coefficient.forward(x2))  # (N, 2)
            mix = (y, r, c)
            y = y * c[:, :1] + r * c[:, 1:]
        if self.shared_experts is not None:
            y = y + self.shared_experts.forward(x2)
        self._save(out, perm, routing.weights, mix)
        y = y.reshape(x.shape)
        return y if self.sequence_out is None else self.sequence_out.forward(y)

    def backward(self, dy):
        out, perm, weights, mix = self._pop()
        if self.sequence_out is not None:  # the whole sequence's gradient
            dy = self.sequence_out.backward(dy)
        dy2 = dy.reshape(-1, self.d_model)
        dx = self.shared_experts.backward(dy2) if self.shared_experts is not None else 0
        dmoe = dy2
        if mix is not None:
            y, r, c = mix
            dmoe, dr = dy2 * c[:, :1], dy2 * c[:, 1:]
            dc = array_module(dy2).stack([(dy2 * y).sum(axis=1), (dy2 * r).sum(axis=1)], axis=1)
            dlogits = c * (dc - (dc * c).sum(axis=1, keepdims=True))
            dx = dx + self.coefficient.backward(dlogits) + self.residual_mlp.backward(dr)
        dout, dweights = self.dispatcher.combine_backward(dmoe, out, perm, weights)
        dx = dx + self.dispatcher.dispatch_backward(self.experts.backward(dout), perm)
        dx = dx + self.router.backward(dweights, self.aux_loss_scale)
        dx = dx.reshape(dy.shape)
        return dx if self.sequence_in is None else self.sequence_in.backward(dx)


def _softmax(z):
    """Softmax over the last axis, in float32 at least, returned in z's dtype."""
    xp = array_module(z)
    f = xp.promote_types(z.dtype, xp.float32)
    e = xp.exp(z.astype(f) - z.max(axis=-1, keepdims=True).astype(f))
    return (e / e.sum(axis=-1, keepdims=True)).astype(z.dtype, copy=False)

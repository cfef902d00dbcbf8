"""`moe` (zmpi's top-level section, with DeepSpeed-MoE's key names): mixture-of-experts layers
in the GPT (docs/moe.md). Empty, or without `num_experts`, the model is dense. This module
imports no MPI.

    "moe": {"num_experts": 8, "k": 2, "capacity_factor": 1.25, "moe_layer_interval": 2}

`layer_experts(n_layer)` says which blocks are MoE blocks and how many experts each has;
`layer_options()` are the keyword arguments of zmpi.nn.moe.MoE every MoE block shares;
`check_moe_layout(config)` refuses, one line each, what zmpi cannot do with MoE yet.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .base import _check, _Section

__all__ = ["MoEConfig", "check_moe_layout"]

# zmpi.nn.moe.NOISY_GATE_POLICIES (tests/test_moe_gpt.py holds them equal): the config
# package imports no layer
NOISY_GATE_POLICIES = (None, "Jitter", "RSample")


@dataclass(frozen=True)
class MoEConfig(_Section):
    """`moe`: `num_experts` E (an int: every MoE block has E experts; a list: one count per
    MoE block, in block order or in the order of `layers`, for PR-MoE's pyramid), which
    blocks (`moe_layer_interval` K: blocks K-1, 2K-1, ... as Megatron-DeepSpeed's
    --expert-interval; or `layers`, a list of block indices), and the layer's options under
    DeepSpeed's names (zmpi.nn.moe.MoE says what each does): k, capacity_factor,
    eval_capacity_factor, min_capacity, drop_tokens, use_rts, noisy_gate_policy,
    top2_2nd_expert_sampling, use_residual, num_shared_experts, aux_loss_coef (DeepSpeed's
    Megatron `moe_loss_coeff`), z_loss_coef. `ep_size`: the expert-parallel degree (it must
    divide every expert count, and the data-parallel size: zmpi.parallel.mesh)."""

    num_experts: object = None  # None: no MoE; an int or a list of ints (pyramid)
    ep_size: int = 1
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = True
    use_rts: bool = True
    noisy_gate_policy: str | None = None
    top2_2nd_expert_sampling: bool | None = None
    use_residual: bool = False
    num_shared_experts: int = 0
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    moe_layer_interval: int = 1
    layers: object = None  # None: every moe_layer_interval blocks; else a list of indices

    _COUNTS = ("ep_size", "k", "min_capacity", "num_shared_experts", "moe_layer_interval")

    @property
    def enabled(self) -> bool:
        return self.num_experts is not None

    def _validate(self):
        if not self.enabled:
            defaults = {f.name: f.default for f in fields(self)}
            for key, default in defaults.items():
                _check(getattr(self, key) == default, key,
                       "acts on MoE layers: give moe.num_experts too")
            return
        for key in ("num_experts", "layers"):
            value = getattr(self, key)
            if isinstance(value, list):
                object.__setattr__(self, key, tuple(value))
        experts = self.num_experts
        counts = experts if isinstance(experts, tuple) else (experts,)
        _check(len(counts) > 0 and all(_is_int(e) and e >= 1 for e in counts), "num_experts",
               f"must be an integer >= 1 or a non-empty list of them, got {_show(experts)}")
        if self.layers is not None:
            layers = self.layers
            _check(isinstance(layers, tuple) and len(layers) > 0
                   and all(_is_int(i) and i >= 0 for i in layers), "layers",
                   f"must be a non-empty list of block indices >= 0, got {_show(layers)}")
            _check(len(set(layers)) == len(layers), "layers",
                   f"lists a block twice: {list(layers)}")
            _check(self.moe_layer_interval == 1, "moe_layer_interval",
                   "give moe_layer_interval or layers, not both")
        self._at_least(1, "ep_size", "k", "moe_layer_interval")
        self._at_least(0, "min_capacity", "num_shared_experts", "aux_loss_coef", "z_loss_coef")
        self._at_least(0, "capacity_factor", "eval_capacity_factor", strict=True)
        _check(self.k <= min(counts), "k", f"{self.k} experts per token, but a layer has only "
               f"{min(counts)}")
        _check(self.noisy_gate_policy in NOISY_GATE_POLICIES, "noisy_gate_policy",
               f"{self.noisy_gate_policy!r}: use null, \"Jitter\" or \"RSample\"")
        _check(not (self.top2_2nd_expert_sampling and self.k == 1), "top2_2nd_expert_sampling",
               "samples the choices after the first: it needs k >= 2")
        uneven = [e for e in counts if e % self.ep_size]
        _check(not uneven, "ep_size", f"{self.ep_size} does not divide num_experts "
               f"{uneven[0] if uneven else ''}: every rank of an expert-parallel group holds "
               "an equal share of each layer's experts")

    def notes(self) -> list[str]:
        out = super().notes()
        if self.enabled and not self.drop_tokens:
            out += self._idle(("capacity_factor", "eval_capacity_factor", "min_capacity",
                               "use_rts"), "with drop_tokens false (no expert drops a token)")
        return out

    def layer_experts(self, n_layer: int) -> dict[int, int]:
        """{block index: its number of experts} for a GPT of n_layer blocks ({} without MoE).
        ConfigError naming moe.layers, moe.moe_layer_interval or moe.num_experts if they do
        not fit the model."""
        if not self.enabled:
            return {}
        if self.layers is None:
            blocks = list(range(self.moe_layer_interval - 1, n_layer, self.moe_layer_interval))
            _check(bool(blocks), "moe.moe_layer_interval", f"{self.moe_layer_interval} puts no MoE "
                   f"layer in a model of {n_layer} blocks")
        else:
            blocks = list(self.layers)  # a list of num_experts follows this order
            _check(max(blocks) < n_layer, "moe.layers", f"block {max(blocks)} is not in a model "
                   f"of {n_layer} blocks (0 to {n_layer - 1})")
        experts = self.num_experts
        if isinstance(experts, tuple):
            _check(len(experts) == len(blocks), "moe.num_experts", f"{len(experts)} counts for "
                   f"{len(blocks)} MoE blocks ({blocks}): give one per block, or one int")
            return dict(sorted(zip(blocks, experts, strict=True)))
        return dict.fromkeys(sorted(blocks), experts)

    def layer_options(self) -> dict:
        """The keyword arguments of zmpi.nn.moe.MoE every MoE block takes from this section
        (the expert count and the layer's seed are each block's own)."""
        keys = ("k", "capacity_factor", "eval_capacity_factor", "min_capacity", "drop_tokens",
                "use_rts", "noisy_gate_policy", "top2_2nd_expert_sampling", "use_residual",
                "num_shared_experts", "aux_loss_coef", "z_loss_coef")
        return {key: getattr(self, key) for key in keys}


# what the engine's expert states (zmpi.engine.moe.ExpertStates) are built for at ep > 1
# (the built-in ones: a plugin's groups inside edp are not known)
EXPERT_STRATEGIES = ("stage0", "stage1", "stage2", "stage3", "hybrid", "zeropp")


def check_moe_layout(config) -> None:
    """ConfigError, one line naming the key, for what the engine cannot do with MoE layers
    yet: at moe.ep_size > 1 a plugin strategy and 1-bit Adam (the expert parameters are a
    second instance of the engine's strategy over the expert-data-parallel group: ZeRO 0-3
    with or without offload, hybrid sharding and ZeRO++ with their groups cut inside it, are
    built). Tensor and pipeline parallelism compose with MoE blocks, together too."""
    if not config.moe.enabled:
        return
    ep, zero = config.moe.ep_size, config.zero_optimization
    if ep > 1:
        combination = f"with moe.ep_size {ep} (docs/moe.md); use ep_size 1 for it"
        _check(zero.strategy_name in EXPERT_STRATEGIES, "zero_optimization.strategy",
               f"{zero.strategy_name!r} is not built {combination}")
        _check(config.optimizer.type != "OneBitAdam", "optimizer.type",
               f"OneBitAdam is not built {combination}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


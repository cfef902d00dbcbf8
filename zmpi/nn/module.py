"""UnitModel, a model made of ZeRO units, and UnitHooks (Module itself is in zmpi.nn.base and
is importable from here too).

UnitModel is an ordered list of units, the granularity at which ZeRO-3 gathers and releases
parameters. It runs the units with engine hooks around each call, and owns the loss
(zmpi.nn.losses; softmax cross-entropy unless given):

    loss = model.loss(inputs, targets)   # forward + loss, a float
    model.backward_loss(scale=1.0)       # backward from dloss = scale (the loss scale)
"""

from contextlib import contextmanager

from zmpi.nn.base import ACTIVATIONS, Module, activations_counted_in  # noqa: F401
from zmpi.nn.checkpointing import InputStore, Kept
from zmpi.nn.losses import CrossEntropyLoss


class UnitHooks:
    """Engine hooks around each unit call. These do nothing; a ZeRO strategy overrides them."""

    def before_forward(self, unit):
        pass

    def after_forward(self, unit):
        pass

    def before_backward(self, unit):
        pass

    def after_backward(self, unit):
        pass

    def before_recompute(self, unit):
        """Before a unit's forward runs again in backward (a group's units but its last,
        whose recompute follows `before_backward`)."""

    def after_recompute(self, unit):
        pass


class UnitModel(Module):
    """A model as an ordered list of units, run with `self.hooks` around each unit call.

    Parameters are named `units.{i}.<name in unit>`. `loss` and `backward_loss` add the loss
    `loss_fn` (a zmpi.nn.losses.Loss; default CrossEntropyLoss(): the last unit produces
    logits (..., V)) on top of the last unit's output. Assign `model.hooks` to install engine
    hooks.
    """

    checkpoint_every = 0  # full recompute: units per recomputed group, 0 for none (set_recompute)
    saved_inputs = None  # where recomputed units' inputs wait: an InputStore (set_recompute)
    computes_loss = True  # its last unit's output goes to the loss (not a pipeline stage's)

    def __init__(self, units, loss=None):
        self.units = list(units)
        self.hooks = UnitHooks()
        self.loss_fn = CrossEntropyLoss() if loss is None else loss

    def _recomputed(self) -> int:
        """How many leading units full recompute covers: all but the last when its output
        goes to the loss (its backward follows at once); none without recompute, and none
        `inference()`."""
        if not self.checkpoint_every or self._inference:
            return 0
        return len(self.units) - self.computes_loss

    _inference = False

    @contextmanager
    def inference(self):
        """Forwards with no backward to follow (evaluation, sampling): full recompute keeps no
        input for them, and every module with a `training` flag (one whose forward differs in
        evaluation: zmpi.nn.moe.MoE's routing, eval_capacity_factor and no random draw) runs
        with it False; each flag is restored when it ends."""
        flagged = [(m, m.training) for m in self.modules() if hasattr(m, "training")]
        previous, self._inference = self._inference, True
        try:
            for m, _ in flagged:
                m.training = False
            yield
        finally:
            self._inference = previous
            for m, was in reversed(flagged):  # an MoE layer's flag is its router's: outer last
                m.training = was

    def inputs_kept(self) -> int:
        """How many inputs one forward keeps for full recompute: one per group of recomputed
        units (see `forward`); 0 without it."""
        every = self.checkpoint_every
        return -(-self._recomputed() // every) if every else 0

    def forward(self, x):
        """Run the units in order; returns the last unit's output (logits).

        With full recompute (`checkpoint_every` k > 0), the recomputed units (`_recomputed`)
        form groups of k: each group keeps only its input (in `saved_inputs`), and what its
        units saved for backward is dropped after their forward. Backward runs the group's
        forward again from that input before the backward of its last unit (the same
        operations in the same order: the same gradients, bit for bit)."""
        recomputed, every = self._recomputed(), self.checkpoint_every
        if recomputed and self._cache is not None:
            self.clear_cache()  # a forward without its backward: what it kept is dropped
        kept = []
        for i, u in enumerate(self.units):
            self.hooks.before_forward(u)
            if i < recomputed:
                if i % every == 0:
                    kept.append(self.saved_inputs.keep(x))  # counted from now on
                    self._cache = tuple(kept)
                with self.saved_inputs.boundary():
                    x = u.forward(x)
                u.clear_cache()
            else:
                x = u.forward(x)
            self.hooks.after_forward(u)
        return x

    def backward(self, dy=None, *, scale=1.0):
        """Run the units in reverse from upstream gradient `dy` and return the input gradient.

        With dy=None this is `backward_loss(scale)`.
        """
        if dy is None:
            return self.backward_loss(scale)
        recomputed, every = self._recomputed(), self.checkpoint_every
        kept = self._pop(stay_counted=True) if recomputed else ()
        kept = list((kept,) if isinstance(kept, Kept) else kept)
        try:
            for i in reversed(range(len(self.units))):
                u = self.units[i]
                last_of_group = i < recomputed and (i % every == every - 1 or i == recomputed - 1)
                if last_of_group:  # run the group's forward again, up to this unit's input
                    x = self.saved_inputs.restore(kept[-1])
                    self._let_go(kept.pop())
                    for j in range(i - i % every, i):
                        self.hooks.before_recompute(self.units[j])
                        with self.saved_inputs.boundary(recompute_of=j):
                            x = self.units[j].forward(x)
                        self.hooks.after_recompute(self.units[j])
                self.hooks.before_backward(u)
                if last_of_group:
                    with self.saved_inputs.boundary(recompute_of=i):
                        u.forward(x)
                dy = u.backward(dy)
                self.hooks.after_backward(u)
        finally:
            for k in kept:  # a backward that raised: what it did not reach is let go too
                self._let_go(k)
        return dy

    def _let_go(self, kept: Kept) -> None:
        self.saved_inputs.release(kept)
        ACTIVATIONS.drop(kept)

    def clear_cache(self):
        """Drop every saved activation, and free the slots of the inputs kept for recompute."""
        for kept in self._cache or ():  # forward keeps a tuple of them
            self.saved_inputs.release(kept)
        super().clear_cache()

    def loss(self, inputs, targets, normalizer=None):
        """Forward, then `loss_fn` on the last unit's output; returns a Python float.

        inputs: what unit 0 takes; targets: what the loss takes (class indices for
        cross-entropy, values for MSE). normalizer: see zmpi.nn.losses (the engine passes it
        when the number of counted targets varies across ranks)."""
        return float(self.forward_loss(inputs, targets, normalizer))

    def forward_loss(self, inputs, targets, normalizer=None):
        """As `loss`, but the loss stays a 0-d array where it was computed (no device sync:
        the engine sums the micro-batches' losses and reads them once per step)."""
        return self.loss_fn.forward(self.forward(inputs), targets, normalizer)

    def backward_loss(self, scale=1.0):
        """Backward from dloss = `scale` after `loss` (scale: the loss scale, 1.0 without).

        Accumulates every parameter gradient (scaled by `scale`); returns the input gradient.
        RuntimeError without a preceding `loss`."""
        return self.backward(self.loss_fn.backward(scale))

    def set_recompute(self, policy: str = "none", interval: int = 0,
                      saved_inputs: InputStore | None = None) -> None:
        """Activation recompute (Korthikanti et al. 2022's granularities): "none"; "selective"
        (every module with a `recompute_core` attribute, the attention layers, drops its
        O(T^2) attention probabilities and recomputes them in backward); "full" (every unit
        but the last keeps only its input, see `forward`). `interval` k > 0 (DeepSpeed's
        pipeline activation_checkpoint_interval) recomputes groups of k units, keeping one
        input per group; "full" alone is k = 1. `saved_inputs`: where kept inputs wait (an
        InputStore: partitioned, on the host, in one buffer; default: kept as they are).
        Gradients are bit for bit those of "none"."""
        if policy not in ("none", "selective", "full"):
            raise ValueError(f"recompute {policy!r}: use 'none', 'selective' or 'full'")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"recompute interval must be an int >= 0, got {interval!r}")
        if policy == "selective" and interval:
            raise ValueError("selective recompute keeps every unit's activations but the "
                             "attention probabilities; it takes no interval of units")
        self.checkpoint_every = interval or (1 if policy == "full" else 0)
        self.saved_inputs = saved_inputs or InputStore()
        for m in self.modules():
            if hasattr(m, "recompute_core"):
                m.recompute_core = policy == "selective"

    def check_batch(self, inputs, targets) -> bool:
        """Raise a clear error (TypeError, ValueError, IndexError) naming `inputs` or
        `targets` if they are not what the model takes; the engine calls it on every rank
        before any collective. Return True when every token id was range-checked (then the
        layers skip their own check of the step's device copies, a device -> host transfer
        each: zmpi.nn.functional.ids_checked). Nothing is checked by default; models
        override."""
        return False

    def tied_parameters(self) -> dict[str, str]:
        """{alias: parameter name} for every weight a unit reads under another name than
        the one it is owned by (tied weights; checkpoints record them, consolidation keeps
        each once). None by default."""
        return {}

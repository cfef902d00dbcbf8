"""UnitModel, a model made of ZeRO units, and UnitHooks (Module itself is in zmpi.nn.base and
is importable from here too).

UnitModel is an ordered list of units, the granularity at which ZeRO-3 gathers and releases
parameters. It runs the units with engine hooks around each call, and owns the loss
(zmpi.nn.losses; softmax cross-entropy unless given):

    loss = model.loss(inputs, targets)   # forward + loss, a float
    model.backward_loss(scale=1.0)       # backward from dloss = scale (the loss scale)
"""

from zmpi.nn.base import Module, activations_counted_in  # noqa: F401  (importable from here)
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


class UnitModel(Module):
    """A model as an ordered list of units, run with `self.hooks` around each unit call.

    Parameters are named `units.{i}.<name in unit>`. `loss` and `backward_loss` add the loss
    `loss_fn` (a zmpi.nn.losses.Loss; default CrossEntropyLoss(): the last unit produces
    logits (..., V)) on top of the last unit's output. Assign `model.hooks` to install engine
    hooks.
    """

    recompute_units = False  # full activation recompute (set_recompute): see forward
    computes_loss = True  # its last unit's output goes to the loss (not a pipeline stage's)

    def __init__(self, units, loss=None):
        self.units = list(units)
        self.hooks = UnitHooks()
        self.loss_fn = CrossEntropyLoss() if loss is None else loss

    def forward(self, x):
        """Run the units in order; returns the last unit's output (logits).

        With `recompute_units` (full activation checkpointing), every unit keeps only its
        input (but the last when its output goes to the loss: its backward follows at once):
        what it saved for backward is dropped after its forward, and backward runs its forward
        again from that input before its backward (the same operations in the same order: the
        same gradients, bit for bit)."""
        inputs = []
        checkpointed = len(self.units) - self.computes_loss if self.recompute_units else 0
        for i, u in enumerate(self.units):
            self.hooks.before_forward(u)
            checkpoint = i < checkpointed
            if checkpoint:
                inputs.append(x)
            x = u.forward(x)
            if checkpoint:
                u.clear_cache()
            self.hooks.after_forward(u)
        if inputs:
            self._save(*inputs)
        return x

    def backward(self, dy=None, *, scale=1.0):
        """Run the units in reverse from upstream gradient `dy` and return the input gradient.

        With dy=None this is `backward_loss(scale)`.
        """
        if dy is None:
            return self.backward_loss(scale)
        checkpointed = len(self.units) - self.computes_loss if self.recompute_units else 0
        inputs = self._pop() if checkpointed else ()
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        for i in reversed(range(len(self.units))):
            u = self.units[i]
            self.hooks.before_backward(u)
            if i < len(inputs):
                u.forward(inputs[i])  # recompute what the forward dropped
            dy = u.backward(dy)
            self.hooks.after_backward(u)
        return dy

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

    def set_recompute(self, policy: str) -> None:
        """Activation recompute (Korthikanti et al. 2022's granularities): "none"; "selective"
        (every module with a `recompute_core` attribute, the attention layers, drops its
        O(T^2) attention probabilities and recomputes them in backward); "full" (every unit
        but the last keeps only its input, see `forward`). Gradients are bit for bit those
        of "none"."""
        if policy not in ("none", "selective", "full"):
            raise ValueError(f"recompute {policy!r}: use 'none', 'selective' or 'full'")
        self.recompute_units = policy == "full"
        for m in self.modules():
            if hasattr(m, "recompute_core"):
                m.recompute_core = policy == "selective"

    def check_batch(self, inputs, targets) -> None:
        """Raise a clear error (TypeError, ValueError, IndexError) naming `inputs` or
        `targets` if they are not what the model takes; the engine calls it on every rank
        before any collective. Nothing is checked by default; models override."""

    def tied_parameters(self) -> dict[str, str]:
        """{alias: parameter name} for every weight a unit reads under another name than
        the one it is owned by (tied weights; checkpoints record them, consolidation keeps
        each once). None by default."""
        return {}

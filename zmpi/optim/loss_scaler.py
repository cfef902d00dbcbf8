"""Loss scaling for fp16 training (Micikevicius et al., Mixed Precision Training, ICLR'18).

The loss is multiplied by `scale` before backward so small fp16 gradients do not flush to
zero; the optimizer divides it back out. With dynamic scaling an overflow (inf/nan in any
gradient on any rank) skips the step and halves the scale, after `hysteresis` consecutive
overflows; `window` clean steps in a row double it. Semantics follow DeepSpeed's
DynamicLossScaler, so its configs mean the same thing here. A static scale never changes:
`hysteresis` overflows in a row at it (`at_minimum`) end the run, as an overflow at the
dynamic scale's minimum does, rather than skip every step to the end.
"""
from __future__ import annotations


class LossScaler:
    """Scale state machine. `update(overflow)` is called once per optimizer step on every
    rank with the same (globally reduced) `overflow` flag, so all ranks agree."""

    def __init__(self, scale: float = 2.0**16, dynamic: bool = True, window: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, factor: float = 2.0):
        if scale <= 0 or min_scale <= 0 or window < 1 or hysteresis < 1 or factor <= 1:
            raise ValueError("loss scaler needs scale > 0, min_scale > 0, window >= 1, "
                             "hysteresis >= 1, factor > 1")
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.factor = factor
        self.hysteresis_left = hysteresis
        self.clean_steps = 0
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, fp16) -> LossScaler:
        """From a `zmpi.config.FP16Config` (static when `loss_scale` > 0: its own minimum)."""
        if fp16.loss_scale > 0:
            return cls(scale=fp16.loss_scale, dynamic=False, hysteresis=fp16.hysteresis,
                       min_scale=fp16.loss_scale)
        return cls(scale=2.0**fp16.initial_scale_power, window=fp16.loss_scale_window,
                   hysteresis=fp16.hysteresis, min_scale=fp16.min_loss_scale)

    @classmethod
    def disabled(cls) -> LossScaler:
        """Scale 1, never changes: fp32 and bf16 training."""
        return cls(scale=1.0, dynamic=False)

    @property
    def at_minimum(self) -> bool:
        """Whether an overflow now ends the run: the scale cannot go lower (a static scale
        never does) and the hysteresis is spent (a static scale's: overflows in a row)."""
        return self.scale <= self.min_scale and self.hysteresis_left <= 1

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if not self.dynamic:
                self.hysteresis_left = max(self.hysteresis_left - 1, 1)
                return
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / self.factor, self.min_scale)
            return
        self.clean_steps += 1
        if not self.dynamic:
            self.hysteresis_left = self.hysteresis  # a static scale counts overflows in a row
        elif self.clean_steps % self.window == 0:
            self.scale *= self.factor
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "hysteresis_left", "clean_steps",
                                               "skipped_steps")}

    def load_state_dict(self, state: dict) -> None:
        for k, val in state.items():
            setattr(self, k, type(getattr(self, k))(val))

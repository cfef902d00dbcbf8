"""Learning-rate schedules with DeepSpeed's names, parameters and formulas
(deepspeed.runtime.lr_schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle).

A schedule is a pure function of the iteration index `it`, DeepSpeed's `last_batch_iteration`:

    schedule = build("WarmupDecayLR", {"total_num_steps": 1000, "warmup_num_steps": 100},
                     base_lr=1e-3, base_betas=(0.9, 0.999))
    schedule.lr(it), schedule.betas(it)        # betas: None unless the schedule cycles them

Step semantics are DeepSpeed's engine's: the scheduler is built with it = -1 and steps once
after every optimizer step that is applied (a step skipped for an fp16 overflow does not
advance it). So the k-th applied step (k = 0, 1, ...) runs with `lr(k - 1)`: WarmupLR's first
two steps both run at warmup_min_lr, WarmupCosineLR's first at 0. `Engine` keeps the index in
`global_steps` (applied steps), so a checkpoint resumes the schedule exactly.

Where DeepSpeed only warns (an unknown warmup_type, total_num_steps < warmup_num_steps), a
config is an error here, except total < warmup, which DeepSpeed allows and so does zmpi.
"""
from __future__ import annotations

import math

LOG, LINEAR = "log", "linear"
REQUIRED = object()  # a parameter without a default
# what a numeric parameter may be (Schedule.LIMITS): (the least value, the greatest, the words)
RATE = (0.0, math.inf, "a finite number >= 0")
STEPS = (1, math.inf, "a number of steps >= 1")
COUNT = (0, math.inf, "a number >= 0")
FRACTION = (0.0, 1.0, "a number from 0 to 1")


def _warmup_gamma(it: int, warmup: int, kind: str) -> float:
    """Warm-up progress in [0, 1) during the first `warmup` iterations, else 1."""
    if it < warmup:
        return math.log(it + 1) / math.log(warmup) if kind == LOG else it / warmup
    return 1.0


class Schedule:
    """Base: `PARAMS` maps each parameter to its default (REQUIRED: none), `LIMITS` a
    numeric parameter to its range (RATE, STEPS, COUNT, FRACTION). Subclasses implement
    lr(it), and betas(it) if they cycle momentum."""

    PARAMS: dict = {}
    LIMITS: dict = {}

    def __init__(self, base_lr: float, base_betas: tuple[float, float], **params):
        self.base_lr, self.base_betas = base_lr, tuple(base_betas)
        self.params = params

    def lr(self, it: int) -> float:
        raise NotImplementedError

    def betas(self, it: int) -> tuple[float, float] | None:
        return None


def _warmup_steps(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"params.warmup_num_steps: must be a positive integer, got {value!r}")
    return max(2, value)  # as DeepSpeed: log(1) would divide by zero


def _warmup_type(value) -> str:
    if value not in (LOG, LINEAR):
        raise ValueError(f"params.warmup_type: must be 'log' or 'linear', got {value!r}")
    return value


class WarmupLR(Schedule):
    """From warmup_min_lr to warmup_max_lr (default: the optimizer's lr) over
    warmup_num_steps iterations (log or linear), then constant."""

    PARAMS = {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
              "warmup_type": LOG}
    LIMITS = {"warmup_min_lr": RATE, "warmup_max_lr": RATE}

    def __init__(self, base_lr, base_betas, **params):
        super().__init__(base_lr, base_betas, **params)
        self.min_lr = params["warmup_min_lr"]
        self.max_lr = base_lr if params["warmup_max_lr"] is None else params["warmup_max_lr"]
        self.warmup = _warmup_steps(params["warmup_num_steps"])
        self.kind = _warmup_type(params["warmup_type"])

    def _gamma(self, it):
        return _warmup_gamma(it, self.warmup, self.kind)

    def lr(self, it):
        if it < 0:
            return self.min_lr
        return self.min_lr + (self.max_lr - self.min_lr) * self._gamma(it)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps (and 0 beyond)."""

    PARAMS = {"total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
              "warmup_num_steps": 1000, "warmup_type": LOG}
    LIMITS = {**WarmupLR.LIMITS, "total_num_steps": STEPS}

    def _gamma(self, it):
        if it < self.warmup:
            return super()._gamma(it)
        total = self.params["total_num_steps"]
        return max(0.0, (total - it) / max(1.0, total - self.warmup))


class WarmupCosineLR(Schedule):
    """The optimizer's lr times a ratio: warmup_min_ratio -> 1 over warmup_num_steps, then a
    cosine to cos_min_ratio at total_num_steps (and cos_min_ratio beyond)."""

    PARAMS = {"total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
              "cos_min_ratio": 0.0001, "warmup_type": LOG}
    LIMITS = {"total_num_steps": STEPS, "warmup_min_ratio": FRACTION, "cos_min_ratio": FRACTION}

    def __init__(self, base_lr, base_betas, **params):
        super().__init__(base_lr, base_betas, **params)
        self.warmup = _warmup_steps(params["warmup_num_steps"])
        self.kind = _warmup_type(params["warmup_type"])

    def lr(self, it):
        p = self.params
        if it < 0:
            return 0.0
        if it < self.warmup:
            gamma = _warmup_gamma(it, self.warmup, self.kind)
            return self.base_lr * (p["warmup_min_ratio"] + gamma * (1 - p["warmup_min_ratio"]))
        progress = min(1.0, (it - self.warmup + 1) / max(1, p["total_num_steps"] - self.warmup))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return self.base_lr * max(0.0, p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * cosine)


class OneCycle(Schedule):
    """One cycle (Smith, 2018): lr rises cycle_min_lr -> cycle_max_lr over
    cycle_first_step_size iterations and falls back over cycle_second_step_size (optionally in
    stairs), then decays as cycle_min_lr / (1 + decay_lr_rate * i / decay_step_size). With
    cycle_momentum (the default) Adam's beta1 moves inversely between cycle_max_mom and
    cycle_min_mom and beta2 is 0.99, exactly as DeepSpeed sets them."""

    PARAMS = {"cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0,
              "cycle_first_step_size": 2000, "cycle_second_step_size": None,
              "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
              "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8,
              "cycle_max_mom": 0.9, "decay_mom_rate": 0.0}
    LIMITS = {"cycle_min_lr": RATE, "cycle_max_lr": RATE, "decay_lr_rate": RATE,
              "cycle_first_step_size": STEPS, "cycle_second_step_size": STEPS,
              "cycle_first_stair_count": COUNT, "cycle_second_stair_count": COUNT,
              "decay_step_size": COUNT, "cycle_min_mom": FRACTION, "cycle_max_mom": FRACTION,
              "decay_mom_rate": RATE}

    def __init__(self, base_lr, base_betas, **params):
        super().__init__(base_lr, base_betas, **params)
        p = params
        self.first = float(p["cycle_first_step_size"])
        self.second = float(self.first if p["cycle_second_step_size"] is None
                            else p["cycle_second_step_size"])
        self.total = self.first + self.second
        self.first_stairs = p["cycle_first_stair_count"]
        self.second_stairs = (self.first_stairs if p["cycle_second_stair_count"] is None
                              else p["cycle_second_stair_count"])
        no_decay = math.isclose(p["decay_step_size"], 0)
        self.skip_lr_decay = no_decay or math.isclose(p["decay_lr_rate"], 0)
        self.skip_mom_decay = no_decay or math.isclose(p["decay_mom_rate"], 0)

    def _scale(self, it):
        """Position in the cycle, 0 at cycle_min_lr and 1 at cycle_max_lr."""
        batch = it + 1
        x = 1.0 + batch / self.total - math.floor(1 + batch / self.total)
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:  # held flat over each stair, quantised from the integer offset
            i = batch % self.total
            position = (i * stairs / self.first if i <= self.first
                        else (self.total - i) * stairs / self.second)
            scale = math.floor(position) / stairs
        return scale

    def _decay(self, it):
        return (it - self.total + 1) / self.params["decay_step_size"]

    def lr(self, it):
        lo, hi = self.params["cycle_min_lr"], self.params["cycle_max_lr"]
        if it < 0:
            return lo
        if it < self.total:
            return lo + (hi - lo) * self._scale(it)
        if self.skip_lr_decay:
            return lo
        return lo / (1 + self.params["decay_lr_rate"] * self._decay(it))

    def betas(self, it):
        p = self.params
        if not p["cycle_momentum"]:
            return None
        lo, hi = p["cycle_min_mom"], p["cycle_max_mom"]
        if it < 0:
            beta1 = lo
        elif it < self.total:
            beta1 = hi - (hi - lo) * self._scale(it)
        elif self.skip_mom_decay:
            beta1 = hi
        else:
            beta1 = hi * (1 + p["decay_mom_rate"] * self._decay(it))
        return (beta1, 0.99)


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def check_params(kind: str, params: dict) -> dict:
    """`params` completed with the defaults of schedule `kind`; ValueError naming what is
    unknown, missing or invalid (the config turns it into a ConfigError with the key)."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown scheduler {kind!r}; allowed: {', '.join(SCHEDULES)}")
    allowed = SCHEDULES[kind].PARAMS
    for key in params:
        if key not in allowed:
            raise ValueError(f"params.{key}: unknown parameter of {kind}; allowed: "
                             f"{', '.join(allowed)}")
    full = {k: params.get(k, default) for k, default in allowed.items()}
    for key, value in full.items():
        default = allowed[key]
        if value is REQUIRED:
            raise ValueError(f"params.{key}: {kind} needs it")
        if isinstance(default, (bool, str)):
            ok, want = type(value) is type(default), type(default).__name__
        else:  # a number (or None where the default is None)
            ok, want = (value is None and default is None) or (
                isinstance(value, (int, float)) and not isinstance(value, bool)), "a number"
        if not ok:
            raise ValueError(f"params.{key}: expected {want}, got {value!r}")
        lo, hi, words = SCHEDULES[kind].LIMITS.get(key, (-math.inf, math.inf, "finite"))
        finite = not (isinstance(value, float) and not math.isfinite(value))  # ints: any size
        if value is not None and not isinstance(value, (bool, str)) and not (
                finite and lo <= value <= hi):
            raise ValueError(f"params.{key}: must be {words}, got {value!r}")
    SCHEDULES[kind](1.0, (0.9, 0.999), **full)  # the constructor's own checks
    return full


def build(kind: str, params: dict, base_lr: float, base_betas) -> Schedule:
    """The schedule `kind` with `params` (DeepSpeed's scheduler.params) for an optimizer whose
    configured lr and betas are base_lr and base_betas."""
    return SCHEDULES[kind](base_lr, base_betas, **check_params(kind, params))

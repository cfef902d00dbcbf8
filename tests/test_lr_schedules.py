"""Learning-rate schedules against DeepSpeed's formulas, written out again here step by step
(deepspeed/runtime/lr_schedules.py), over warm-up, decay and past the end; the engine's step
semantics (the k-th applied step runs at rate(k - 1)); and resume from a checkpoint."""
import math

import numpy as np
import pytest

from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.optim.lr_schedules import build

ITERS = range(-1, 40)


def warmup_gamma(it, warmup, kind):
    w = max(2, warmup)
    if it >= w:
        return 1.0
    return math.log(it + 1) / math.log(w) if kind == "log" else it / w


def deepspeed_warmup_lr(it, lo, hi, warmup, kind):
    return lo if it < 0 else lo + (hi - lo) * warmup_gamma(it, warmup, kind)


def deepspeed_warmup_decay_lr(it, total, lo, hi, warmup, kind):
    if it < 0:
        return lo
    w = max(2, warmup)
    gamma = warmup_gamma(it, warmup, kind) if it < w else max(0.0, (total - it) / max(1, total - w))
    return lo + (hi - lo) * gamma


def deepspeed_warmup_cosine_lr(it, base, total, min_ratio, warmup, cos_min, kind):
    if it < 0:
        return 0.0
    w = max(2, warmup)
    if it < w:
        return base * (min_ratio + warmup_gamma(it, warmup, kind) * (1 - min_ratio))
    progress = min(1.0, (it - w + 1) / max(1, total - w))
    return base * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    s = build("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                           "warmup_num_steps": 10, "warmup_type": kind}, 5e-3, (0.9, 0.999))
    for it in ITERS:
        assert s.lr(it) == pytest.approx(deepspeed_warmup_lr(it, 1e-4, 1e-2, 10, kind),
                                         rel=1e-12), it
    assert s.lr(10) == s.lr(39) == 1e-2 and s.betas(5) is None
    default_max = build("WarmupLR", {"warmup_num_steps": 4}, 5e-3, (0.9, 0.999))
    assert default_max.lr(100) == 5e-3  # warmup_max_lr defaults to the optimizer's lr
    assert build("WarmupLR", {"warmup_num_steps": 1}, 1.0, (0.9, 0.9)).lr(0) == 0.0  # W -> 2


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    params = {"total_num_steps": 30, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
              "warmup_num_steps": 8, "warmup_type": kind}
    s = build("WarmupDecayLR", params, 1.0, (0.9, 0.999))
    for it in ITERS:
        assert s.lr(it) == pytest.approx(deepspeed_warmup_decay_lr(it, 30, 0.0, 2e-3, 8, kind),
                                         rel=1e-12, abs=1e-18), it
    assert s.lr(30) == 0.0 and s.lr(39) == 0.0  # 0 at and past the end, never negative
    assert build("WarmupDecayLR", {"total_num_steps": 9}, 5.0, (0.9, 0.9)).lr(2000) == 0.0
    assert build("WarmupDecayLR", {"total_num_steps": 5000}, 5.0, (0.9, 0.9)).lr(999) == \
        pytest.approx(0.001 * math.log(1000) / math.log(1000))  # DeepSpeed's 0.001 default


def test_warmup_cosine_lr():
    params = {"total_num_steps": 25, "warmup_min_ratio": 0.1, "warmup_num_steps": 5,
              "cos_min_ratio": 0.01, "warmup_type": "linear"}
    s = build("WarmupCosineLR", params, 3e-3, (0.9, 0.999))
    for it in ITERS:
        assert s.lr(it) == pytest.approx(
            deepspeed_warmup_cosine_lr(it, 3e-3, 25, 0.1, 5, 0.01, "linear"), rel=1e-12), it
    assert s.lr(-1) == 0.0 and s.lr(39) == pytest.approx(3e-3 * 0.01)


def deepspeed_one_cycle(it, lo, hi, first, second, stairs1, stairs2, decay_rate, decay_step,
                        mom_lo, mom_hi, mom_decay):
    total = first + second
    if it < 0:
        return lo, mom_lo
    if it < total:
        b = it + 1
        x = 1 + b / total - math.floor(1 + b / total)
        r = first / total
        scale, stairs = (x / r, stairs1) if x <= r else ((x - 1) / (r - 1), stairs2)
        if stairs:
            i = b % total
            pos = i * stairs / first if i <= first else (total - i) * stairs / second
            scale = math.floor(pos) / stairs
        return lo + (hi - lo) * scale, mom_hi - (mom_hi - mom_lo) * scale
    d = (it - total + 1) / decay_step if decay_step else 0
    lr = lo if not decay_step or not decay_rate else lo / (1 + decay_rate * d)
    mom = mom_hi if not decay_step or not mom_decay else mom_hi * (1 + mom_decay * d)
    return lr, mom


@pytest.mark.parametrize("stairs,decay", [(0, 0.0), (0, 0.5), (3, 0.5)])
def test_one_cycle(stairs, decay):
    params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10,
              "cycle_second_step_size": 15, "cycle_first_stair_count": stairs,
              "decay_lr_rate": decay, "decay_step_size": 4, "decay_mom_rate": decay / 10,
              "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}
    s = build("OneCycle", params, 1.0, (0.9, 0.999))
    for it in ITERS:
        lr, mom = deepspeed_one_cycle(it, 1e-4, 1e-3, 10, 15, stairs, stairs, decay, 4, 0.85,
                                      0.95, decay / 10)
        assert s.lr(it) == pytest.approx(lr, rel=1e-12), it
        assert s.betas(it) == (pytest.approx(mom, rel=1e-12), 0.99), it  # beta2: DeepSpeed's
    assert build("OneCycle", {**params, "cycle_momentum": False}, 1.0, (0.9, 0.9)).betas(3) is None


CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8)
SCHEDULE = {"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_max_lr": 1e-2,
                                                "warmup_num_steps": 3, "warmup_type": "linear"}}


def _engine(**extra):
    return Engine(GPT(CFG, seed=0), {"train_micro_batch_size_per_gpu": 2, "scheduler": SCHEDULE,
                                     "zero_optimization": {"stage": 2}, **extra})


def _batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 16, (2, 8)), rng.integers(0, 16, (2, 8))


def test_engine_runs_step_k_at_rate_k_minus_1_and_resumes_the_schedule(tmp_path):
    schedule = build("WarmupDecayLR", SCHEDULE["params"], 1e-3, (0.9, 0.999))
    engine = _engine()
    lrs = []
    for step in range(10):
        engine.train_step(*_batch(step))
        lrs.append(engine.lr)
        if step == 4:
            engine.save_checkpoint(tmp_path)
    assert lrs == [schedule.lr(k - 1) for k in range(10)]
    assert lrs[:2] == [0.0, 0.0] and lrs[9] == 0.0  # DeepSpeed: two steps at warmup_min_lr
    whole = engine.gather_parameters()
    resumed = _engine()
    loaded = resumed.load_checkpoint(tmp_path)
    assert loaded.notes == [] and resumed.lr == lrs[4]
    tail = []
    for step in range(5, 10):
        resumed.train_step(*_batch(step))
        tail.append(resumed.lr)
    assert tail == lrs[5:]
    got = resumed.gather_parameters()
    assert all(np.array_equal(got[k], whole[k]) for k in whole)
    other = Engine(GPT(CFG, seed=0), {"train_micro_batch_size_per_gpu": 2,
                                      "zero_optimization": {"stage": 2}})
    notes = other.load_checkpoint(tmp_path).notes
    assert any("the scheduler is" in n for n in notes)


def schedule_lr(it):
    return build("WarmupDecayLR", SCHEDULE["params"], 1e-3, (0.9, 0.999)).lr(it)


def test_a_step_skipped_for_overflow_does_not_advance_the_schedule():
    engine = _engine(fp16={"enabled": True, "initial_scale_power": 8})
    engine.train_step(*_batch(0))
    engine.train_step(*_batch(1))
    before, steps = engine.lr, engine.global_steps
    reduce = engine.strategy.before_step
    engine.strategy.before_step = lambda: (reduce(), engine.strategy.optimizer_grads().fill(np.inf))
    engine.train_step(*_batch(2))
    assert engine.global_steps == steps and engine.lr == schedule_lr(steps - 1)
    engine.strategy.before_step = reduce
    engine.train_step(*_batch(3))
    # the third applied step runs at rate(1), as if the skipped step had not happened
    assert before == schedule_lr(steps - 2) and engine.lr == schedule_lr(steps - 1)

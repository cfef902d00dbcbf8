"""Adam/AdamW kernel against the textbook formula; the loss scaler's state machine."""
import numpy as np
import pytest

from zmpi.optim.adam import Adam
from zmpi.optim.loss_scaler import LossScaler


@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_matches_formula(decoupled):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(50)
    m, v = np.zeros(50), np.zeros(50)
    want, wm, wv = p.copy(), np.zeros(50), np.zeros(50)
    opt = Adam(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05, decoupled=decoupled)
    for t in range(1, 4):
        g = rng.standard_normal(50)
        opt.step_(p, g.copy(), m, v)
        gg = g + 0.05 * want if not decoupled else g
        wm = 0.8 * wm + 0.2 * gg
        wv = 0.9 * wv + 0.1 * gg * gg
        step = 0.1 * (wm / (1 - 0.8**t)) / (np.sqrt(wv / (1 - 0.9**t)) + 1e-6)
        want = want * (1 - 0.1 * 0.05 if decoupled else 1) - step
        np.testing.assert_allclose(p, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m, wm, rtol=1e-12)
    assert opt.step_count == 3


def test_dynamic_scaler_hysteresis_window_and_floor():
    s = LossScaler(scale=8.0, window=3, hysteresis=2, min_scale=2.0)
    trajectory = []
    for overflow in [False, False, False, True, True, True, True, False, False, False]:
        s.update(overflow)
        trajectory.append(s.scale)
    # grow after 3 clean; 1st overflow spends hysteresis; then halve; floor at 2; regrow.
    assert trajectory == [8, 8, 16, 16, 8, 4, 2, 2, 2, 4]
    assert s.skipped_steps == 4


def test_static_scaler_never_changes_but_counts_skips():
    s = LossScaler(scale=128.0, dynamic=False)
    for overflow in [True, False, True]:
        s.update(overflow)
    assert s.scale == 128.0 and s.skipped_steps == 2


def test_scaler_state_round_trip_and_validation():
    s = LossScaler(window=2)
    s.update(False)
    t = LossScaler(window=2)
    t.load_state_dict(s.state_dict())
    t.update(False)
    s.update(False)
    assert s.state_dict() == t.state_dict() and t.scale == 2.0**17
    with pytest.raises(ValueError):
        LossScaler(scale=0)

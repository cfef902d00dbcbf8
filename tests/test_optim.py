"""Adam/AdamW kernel against the textbook formula; the loss scaler's state machine."""
import numpy as np
import pytest

from zmpi.optim.adam import Adam, HostAdam
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


def _textbook(p, grads, lr, betas, eps, weight_decay, decoupled):
    """Adam(W) in float64, one formula per line, over a list of gradients."""
    p, m, v = p.astype(np.float64), np.zeros(p.size), np.zeros(p.size)
    for t, g in enumerate(grads, start=1):
        wd = weight_decay
        g = g.astype(np.float64) + (0 if decoupled else wd * p)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p * (1 - lr * wd if decoupled else 1)
        p = p - lr * (m / (1 - betas[0] ** t)) / (np.sqrt(v / (1 - betas[1] ** t)) + eps)
    return p, m, v


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("size, chunk, threads", [(1001, 7, 1), (1001, 64, 3), (5, 65536, 2)])
def test_host_adam_matches_textbook_over_many_steps(decoupled, size, chunk, threads):
    """fp32 state, fp16 gradients scaled back by grad_scale; chunk boundaries fall anywhere
    (a flat shard packs many parameters back to back, so also across them)."""
    rng = np.random.default_rng(1)
    p0 = rng.standard_normal(size).astype(np.float32)
    scale = 1024.0
    grads16 = [(rng.standard_normal(size) * scale).astype(np.float16) for _ in range(60)]
    hyper = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, decoupled=decoupled)
    opt = HostAdam(**hyper, chunk=chunk, threads=threads)
    p, m, v = p0.copy(), np.zeros(size, np.float32), np.zeros(size, np.float32)
    for g in grads16:
        opt.step_(p, g, m, v, grad_scale=1 / scale)
    want_p, want_m, want_v = _textbook(p0, [g.astype(np.float64) / scale for g in grads16],
                                       **hyper)
    assert np.abs(p - want_p).max() <= 1e-6 * np.abs(want_p).max()
    assert np.abs(m - want_m).max() <= 1e-6 * np.abs(want_m).max()
    assert np.abs(v - want_v).max() <= 1e-6 * np.abs(want_v).max()
    opt.close()


def test_chunks_threads_and_devices_give_identical_bits():
    """The rule is elementwise: any chunking and thread count, and the whole-array Adam the
    device uses, produce the same bits (what makes offload on == offload off)."""
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(777).astype(np.float32)
    grads = [rng.standard_normal(777).astype(np.float16) for _ in range(5)]
    results = []
    for opt in (Adam(weight_decay=0.1), HostAdam(weight_decay=0.1, chunk=10, threads=1),
                HostAdam(weight_decay=0.1, chunk=33, threads=4)):
        p, m, v = p0.copy(), np.zeros(777, np.float32), np.zeros(777, np.float32)
        for g in grads:
            opt.step_(p, g, m, v, grad_scale=0.5, clip_coef=0.25)
        results.append(np.concatenate([p, m, v]))
        opt.close()
    assert all(np.array_equal(results[0], r) for r in results[1:])
    g = grads[0]
    stats = [HostAdam(chunk=10, threads=t).grad_stats(g, 0.5) for t in (1, 3)]
    assert stats[0] == stats[1]
    assert stats[0][0] and stats[0][1] == pytest.approx(((g * 0.5).astype(np.float64) ** 2).sum())


def test_grad_stats_finds_inf_and_nan_and_never_writes_grads():
    opt = HostAdam(chunk=4, threads=2)
    for bad in (np.inf, -np.inf, np.nan):
        g = np.ones(11, np.float16)
        g[9] = bad
        finite, _ = opt.grad_stats(g)
        assert not finite and g[0] == 1 and (np.isnan(g[9]) or g[9] == bad)
    big = np.full(11, 60000, np.float16)  # finite, but the fp32 sum of squares is large
    assert opt.grad_stats(big)[0]
    with pytest.raises(ValueError, match="shapes differ"):
        opt.step_(np.zeros(3, np.float32), np.zeros(4, np.float32), np.zeros(3, np.float32),
                  np.zeros(3, np.float32))
    opt.close()


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


def test_grad_stats_and_step_never_share_scratch():
    """The delayed update runs step_ in a background thread while the next step's grad_stats
    runs in the training thread: no scratch array may be used by both (or by two threads)."""
    opt = HostAdam(chunk=8, threads=2)
    p, g = np.ones(40, np.float32), np.ones(40, np.float16)
    opt.step_(p, g, np.zeros(40, np.float32), np.zeros(40, np.float32))
    opt.grad_stats(g)
    arrays = [a for pair in opt._scratch.values() for a in pair]
    assert len(arrays) == 2 * 2 * 2  # (stats, step) x 2 threads x 2 arrays
    for i, a in enumerate(arrays):
        assert not any(np.shares_memory(a, b) for b in arrays[i + 1:])
    opt.close()


@pytest.mark.parametrize("chunk,threads", [(None, 1), (10, 1), (33, 3)])
def test_step_publishes_each_chunk_as_the_copy_after_it_would(chunk, threads):
    """step_(publish=[(start, dst), ...]) casts each updated chunk into the pieces it covers
    (pieces not aligned with the chunks, in the storage dtype): the bits of a copy after
    the step, and the update itself unchanged."""
    rng = np.random.default_rng(5)
    p0 = rng.standard_normal(200).astype(np.float32)
    g = rng.standard_normal(200).astype(np.float16)
    opt = Adam(weight_decay=0.1, chunk=chunk, threads=threads)
    ref = HostAdam(weight_decay=0.1, chunk=7, threads=1)
    p, m, v = p0.copy(), np.zeros(200, np.float32), np.zeros(200, np.float32)
    rp, rm, rv = p0.copy(), np.zeros(200, np.float32), np.zeros(200, np.float32)
    half, full = np.full(120, np.nan, np.float16), np.full(200, np.nan, np.float32)
    for _ in range(3):
        opt.step_(p, g, m, v, 0.5, 0.25,
                  publish=[(150, full[150:]), (5, half[:95]), (100, half[95:]), (0, full[:5])])
        ref.step_(rp, g, rm, rv, 0.5, 0.25)
        np.testing.assert_array_equal(np.concatenate([p, m, v]), np.concatenate([rp, rm, rv]))
        np.testing.assert_array_equal(half, p[5:125].astype(np.float16))
        np.testing.assert_array_equal(full[:5], p[:5])
        np.testing.assert_array_equal(full[150:], p[150:])
        assert np.isnan(full[5:150]).all()  # no piece there: untouched
    opt.close()
    ref.close()


@pytest.mark.parametrize("publish", [[(0, np.zeros(11, np.float32))],
                                     [(0, np.zeros(6, np.float32)), (5, np.zeros(3))],
                                     [(0, np.zeros((2, 2), np.float32))]])
def test_step_refuses_pieces_outside_or_overlapping(publish):
    p = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="disjoint pieces"):
        HostAdam().step_(p, p.copy(), p.copy(), p.copy(), publish=publish)

"""Pipeline parallelism's plain-data parts (zmpi.parallel.pipeline): stage partitioning against
brute force and on the GPT, and the GPipe and 1F1B schedules: every op once and in order, the
timeline's bubble equal to (p - 1) / (m + p - 1), activations in flight m (GPipe) and p - s
(1F1B)."""
import itertools

import numpy as np
import pytest

from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.pipeline.partition import partition, unit_weights
from zmpi.parallel.pipeline.schedule import SCHEDULES, bubble_formula, schedule, timeline


def brute_force(weights, stages):
    """The lightest heaviest stage over every split into `stages` non-empty runs."""
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = heaviest if best is None else min(best, heaviest)
    return best


def test_partition_is_the_lightest_split():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 9))
        weights = [int(w) for w in rng.integers(0, 20, n)]
        for stages in range(1, n + 1):
            bounds = partition(weights, stages)
            assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == stages + 1
            assert all(a < b for a, b in itertools.pairwise(bounds))  # no empty stage
            heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
            assert heaviest == brute_force(weights, stages), (weights, stages, bounds)


def test_partition_of_a_six_unit_gpt_at_four_stages():
    gpt = GPT(GPTConfig(vocab_size=65, seq_len=16, n_layer=4, n_head=2, d_model=16))
    weights = unit_weights(gpt.units, "parameters")
    assert weights[1:5] == [3280] * 4 and weights[0] == 65 * 16 + 16 * 16
    assert partition(weights, 4) == [0, 2, 3, 4, 6]  # uneven: the ends ride with a block
    assert partition(unit_weights(gpt.units, "uniform"), 4) == [0, 2, 4, 5, 6]
    assert unit_weights(gpt.units, "type:block") == [0, 1, 1, 1, 1, 0]
    assert partition(unit_weights(gpt.units, "type:Block"), 4) == [0, 2, 3, 4, 6]


def test_bad_partitions_are_refused():
    gpt = GPT(GPTConfig(vocab_size=8, seq_len=4, n_layer=1, n_head=1, d_model=4))
    with pytest.raises(ValueError, match="cannot split 3 units into 4 pipeline stages"):
        partition(unit_weights(gpt.units), 4)
    with pytest.raises(ValueError, match="matches none of the units"):
        unit_weights(gpt.units, "type:Conv")
    with pytest.raises(ValueError, match="unknown partition method 'size'"):
        unit_weights(gpt.units, "size")


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_op_once_and_each_backward_after_its_forward(name):
    for p, m in itertools.product((1, 2, 3, 4), (1, 2, 3, 8)):
        for s in range(p):
            ops = schedule(name, s, p, m)
            assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in
                                                                           range(m)])
            assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))


@pytest.mark.parametrize("name", SCHEDULES)
def test_bubble_and_activations_in_flight(name):
    for p, m in itertools.product((1, 2, 3, 4), (1, 4, 8, 16)):
        t = timeline(name, p, m, forward_s=1.0, backward_s=2.0)
        assert t.bubble == pytest.approx(bubble_formula(p, m), abs=1e-12), (p, m)
        assert t.makespan == pytest.approx((m + p - 1) * 3.0)
        want = [m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)]
        assert t.peak_in_flight == want, (p, m)


def test_the_timeline_respects_the_dependencies_with_uneven_stages():
    t = timeline("1f1b", 3, 4, forward_s=[1.0, 3.0, 1.0], backward_s=[2.0, 6.0, 2.0])
    end = {(op, s, i): e for s, ops in enumerate(t.spans) for op, i, _, e in ops}
    for s, ops in enumerate(t.spans):
        assert all(a[3] <= b[2] for a, b in itertools.pairwise(ops))  # one op at a time
        for op, i, start, _ in ops:
            need = ("F", s - 1, i) if op == "F" else ("B", s + 1, i) if s < 2 else ("F", s, i)
            assert need[1] < 0 or start >= end[need]
    assert t.bubble > bubble_formula(3, 4)  # the slow middle stage idles the others


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'interleaved'"):
        schedule("interleaved", 0, 2, 4)
    with pytest.raises(ValueError, match="stage 2 of 2"):
        schedule("gpipe", 2, 2, 4)

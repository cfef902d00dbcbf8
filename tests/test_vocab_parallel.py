"""Vocabulary parallelism (zmpi.parallel.tensor.vocab): the split embedding, the tied LM head
and the cross-entropy that never gathers the (B, T, V) logits, against the serial pipeline
(embedding lookup, logits = h @ wte.T, CrossEntropyLoss) built from the same seed.

One launch at 2 ranks and one at 4 (tests/ranks/vocab_checks.py), float64, V = 13 (padded to
14 and 16): loss, LM-head input gradient and this rank's rows of the tied table's gradient to
1e-12, padding rows zero with zero gradient, the allreduces of each piece (the cross-entropy:
three of B*T elements, never one of B*T*V), and at 2 ranks a collective finite-difference
check w.r.t. each rank's logits slice. At tp = 1 (a Comm in this process) the pipeline is the
serial one exactly and communicates nothing.
"""
import sys

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi

from zmpi.parallel.tensor.vocab import (
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_shard,
)

sys.path.insert(0, str(RANKS_DIR))
import vocab_checks  # noqa: E402  (the rank script: its pipelines and cases)

TOL = 1e-12
N, C = vocab_checks.B * vocab_checks.T, vocab_checks.C


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"tp{n}")
def reports(request):
    return request.param, run_mpi(RANKS_DIR / "vocab_checks.py", request.param, timeout=120)


def test_vocab_shard_pads_to_a_multiple_of_tp():
    assert vocab_shard(13, 1, 0) == (13, 0, 13)
    assert [vocab_shard(13, 2, r) for r in range(2)] == [(14, 0, 7), (14, 7, 7)]
    assert [vocab_shard(13, 4, r) for r in range(4)] == [(16, 4 * r, 4) for r in range(4)]
    assert vocab_shard(3, 4, 3) == (4, 3, 1)  # the last rank holds only padding


@pytest.mark.mpi
@pytest.mark.parametrize("case", vocab_checks.CASES)
def test_matches_the_serial_pipeline(reports, case):
    tp, reps = reports
    for rank, r in enumerate(reps):
        assert r["tp"] == [tp, rank]
        d = r["cases"][case]["diff"]
        assert d["loss_dtype"] == ["float64", "float64"]
        assert d["loss"] <= TOL and d["dh"] <= TOL and d["weight_grad"] <= TOL, d
        assert d["h"] <= TOL and d["logits"] <= TOL, d
        assert d["weight"] == 0.0, d  # the same draw, this rank's rows
        assert d["grad_scale"] > 1e-3  # the gradient compared is not trivially 0


@pytest.mark.mpi
def test_padding_rows_are_zero_and_get_no_gradient(reports):
    tp, reps = reports
    pads = [r["cases"]["plain"]["diff"]["pad_rows"] for r in reps]
    assert sum(pads) == -(-13 // tp) * tp - 13 and pads[-1] > 0
    for r in reps:
        for case in vocab_checks.CASES:
            d = r["cases"][case]["diff"]
            assert d["pad_weight"] == d["pad_grad"] == d["pad_dlogits"] == 0.0, d


@pytest.mark.mpi
@pytest.mark.parametrize("case", vocab_checks.CASES)
def test_traffic_of_each_piece(reports, case):
    """Embedding forward: one allreduce of N*C; LM-head backward: one of N*C (dh);
    cross-entropy forward: max, sum of exp, target logit, N each; nothing else, and no other
    op."""
    _, reps = reports
    want = {"embedding_forward": [["sum", N * C]], "head_forward": [],
            "ce_forward": [["max", N], ["sum", N], ["sum", N]], "ce_backward": [],
            "head_backward": [["sum", N * C]], "embedding_backward": []}
    for r in reps:
        phases = r["cases"][case]["phases"]
        assert {k: v["allreduces"] for k, v in phases.items()} == want
        for name, calls in want.items():
            counted = phases[name]["counters"]
            assert set(counted) <= {"allreduce"}, (name, counted)
            assert counted.get("allreduce", {}).get("bytes", 0) == 8 * sum(n for _, n in calls)
    assert 8 * 3 * N < 8 * N * 13  # (the cross-entropy's bytes are not the logits')


@pytest.mark.mpi
def test_finite_differences_of_the_loss_wrt_each_logits_slice(reports):
    tp, reps = reports
    rows = vocab_shard(13, tp, 0)[2]  # 7 at tp = 2, 4 at tp = 4
    for r in reps:
        g = r["gradcheck"]
        assert g["checked"] == list(range(tp)) and g["elements"] == N * rows
        assert g["pad_grad"] == 0.0


# ------------------------------------------------------------------------- tp = 1, in process


@pytest.fixture(scope="module")
def tp1():
    from zmpi.comm import Comm

    return Comm()


@pytest.mark.parametrize("case", vocab_checks.CASES)
def test_tp1_is_the_serial_pipeline_exactly(tp1, case):
    ignore_index, normalizer = vocab_checks.CASES[case]
    par = vocab_checks.parallel(tp1, ignore_index, normalizer)
    ser = vocab_checks.serial(ignore_index, normalizer)
    assert par["loss"] == ser["loss"] and par["loss"].dtype == ser["loss"].dtype
    for mine, theirs in (("h", "h"), ("logits", "logits"), ("dh", "dh"), ("weight", "wte"),
                         ("weight_grad", "wte_grad")):
        assert np.array_equal(par[mine], ser[theirs]), mine
    for name, phase in par["phases"].items():  # tp = 1 communicates nothing
        assert phase["allreduces"] == [] and phase["counters"] == {}, name


def test_tp1_float32_matches_the_serial_loss(tp1):
    par = vocab_checks.parallel(tp1, -100, None, np.float32)
    ser = vocab_checks.serial(-100, None, np.float32)
    assert par["loss"].dtype == ser["loss"].dtype == np.float32
    assert par["loss"] == ser["loss"] and np.array_equal(par["weight_grad"], ser["wte_grad"])


def test_contract_errors_and_count(tp1):
    emb = VocabParallelEmbedding(13, 4, tp1, 0, np.float64)
    with pytest.raises(IndexError, match="embedding indices"):
        emb.forward(np.array([[13]]))
    with pytest.raises(RuntimeError):
        emb.backward(np.zeros((1, 1, 4)))
    ce = VocabParallelCrossEntropy(tp1, 13, ignore_index=-100)
    with pytest.raises(ValueError, match="13 = 13 / 1 columns"):
        ce.forward(np.zeros((1, 2, 12)), np.zeros((1, 2), int))
    with pytest.raises(IndexError, match="cross-entropy targets"):
        ce.forward(np.zeros((1, 2, 13)), np.array([[0, 13]]))
    with pytest.raises(RuntimeError):
        ce.backward(1.0)
    assert ce.count(np.array([[0, -100, 3]])) == 2
    assert VocabParallelCrossEntropy(tp1, 13).count(np.array([0])) is None
    head = VocabParallelLMHead(emb)
    assert head.parameters() == [] and emb.parameters() == [emb.weight]

"""MoE blocks under tensor parallelism (zmpi.parallel.expert.tensor; docs/moe.md, "Tensor
parallelism"): every expert split over the tensor group as the dense MLP is, the router whole.

One `mpiexec` launch of 2 ranks and one of 4 of tests/ranks/moe_tensor_checks.py:
- the MoE layer alone at tp 2 (2 ranks), float64: output, input gradient, the auxiliary loss
  and every gradient (tensor slices gathered) equal the whole layer's on the same tokens,
  within 1e-12, the same tokens dropped, and the tensor group's allreduces are the formula's
  (one forward and one backward per split part, each of the part's rows x C);
- a GPT with MoE blocks (top-1 and top-2 with tokens dropped and the auxiliary loss on, one
  case with PR-MoE's residual MLP and a shared expert) trained by the engine at
  (dp, ep, tp) = (1, 1, 2), (2, 1, 2) and (2, 2, 2), ZeRO 0-3 (all four at (2, 2, 2), 0 and 3
  at each layout; top-2 with sequence parallelism too), against one process on the whole
  batch (this process): float64 losses within 1e-10, parameters within 1e-8, the same dropped
  assignments per step and layer; bf16 against a one-process bf16 run (BF16_LOSS_TOL,
  BF16_PARAM_TOL);
- a checkpoint saved at (ep 2, tp 2) resumed at (ep 1, tp 1) and (ep 2, tp 1), continuing
  the loss within 1e-10; consolidate writes its experts whole (what one process loads from
  it), verify reads every file, inspect names the split.
"""
import sys

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi

from zmpi.checkpoint import tools
from zmpi.comm import Comm

sys.path.insert(0, str(RANKS_DIR))
import moe_tensor_checks as checks  # noqa: E402

LOSS_TOL, PARAM_TOL = 1e-10, 1e-8  # float64, against one process
# bf16 parameters (float32 masters) on another layout: every sum in another order, each
# rounding of a parameter to bf16 (2^-8 relative) possibly the other way. Measured at (2, 2, 2)
# after 4 steps: losses 8.6e-5 apart, parameters 6.8e-4 (largest |parameter| 0.075, lr 1e-2)
BF16_LOSS_TOL, BF16_PARAM_TOL = 1e-3, 5e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for n in (2, 4):
        where = tmp_path_factory.mktemp(f"moe_tensor_n{n}")
        out[n] = (where, run_mpi(RANKS_DIR / "moe_tensor_checks.py", n, args=[where],
                                 timeout=300))
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Every case trained by one process on the whole batch: (report, gathered parameters)."""
    comm, out = Comm(), {}
    where = tmp_path_factory.mktemp("moe_tensor_reference")
    for case in checks.CASES:
        engine, got = checks.train(comm, where, case, (1, 1, 1))
        out[case] = got, engine.gather_parameters()
        engine.close()
    return out


def _case_layout(key: str) -> tuple[str, tuple[int, ...]]:
    """A train report's key, "<case> (dp, ep, tp)", as (case, layout)."""
    case, layout = key.split(" ", 1)
    return case, tuple(int(v) for v in layout.strip("()").split(","))


def trained(runs):
    """(case, layout, rank 0's report, its gathered parameters) of every layout run."""
    for where, reports in runs.values():
        for key, got in reports[0]["train"].items():
            case, layout = _case_layout(key)
            with np.load(where / f"{case}__{'_'.join(map(str, layout))}.npz") as f:
                yield case, layout, got, dict(f)


@pytest.mark.mpi
def test_each_tensor_rank_holds_the_counted_share(runs):
    """Every rank of every layout holds gpt_num_params(..., tp, moe) parameters (its tensor
    rank's share of the dense units and of every MoE block: what `zmpi estimate --moe --tp`
    counts as Psi) and, at ep 2, its expert strategy gpt_expert_numel(..., tp) (the
    estimate's expert_params)."""
    from zmpi.models.gpt_counts import gpt_expert_numel, gpt_num_params

    c = checks.GPT_CONFIG
    for _, reports in runs.values():
        for r in reports:
            for key, got in r["train"].items():
                case, (dp, ep, tp) = _case_layout(key)
                section = {**checks.CASES[case][-1], "ep_size": ep}
                want = [gpt_num_params(c.n_layer, c.d_model, c.vocab_size, c.seq_len, tp,
                                       moe=section),
                        gpt_expert_numel(c.n_layer, c.d_model, section, tp) if ep > 1 else 0]
                assert got["num_params"] == want, (r["rank"], key)


@pytest.mark.mpi
def test_the_split_layer_equals_the_whole_layer(runs):
    reports = runs[2][1]
    C, itemsize = 6, 8
    for r in reports:
        for name, got in r["layer"].items():
            for what, err in got["errors"].items():
                assert err <= 1e-12, (r["rank"], name, what, err)
            assert got["same_routing"] and got["dropped"] > 0, (name, got)
            # f and g of each split part (experts, residual MLP, shared experts): 2 allreduces
            assert got["allreduces"] == 2 * got["parts"], (name, got)
            assert got["bytes"] == 2 * got["rows"] * C * itemsize, (name, got)
    assert set(reports[0]["layer"]) == {"top1", "top2_residual_shared"}


@pytest.mark.mpi
def test_every_layout_trains_as_one_process(runs, references):
    seen = set()
    for case, layout, got, params in trained(runs):
        seen.add((case, layout))
        want, want_params = references[case]
        assert got["dropped"] == want["dropped"], (case, layout)
        assert any(d > 0 for step in got["dropped"] for d in step), (case, "drops nothing")
        assert set(params) == set(want_params)
        fp64 = checks.CASES[case][2] == "fp64"
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=0,
                                   atol=LOSS_TOL if fp64 else BF16_LOSS_TOL,
                                   err_msg=f"{case} {layout}")
        for name, value in params.items():
            err = float(np.abs(value - want_params[name]).max())
            assert err <= (PARAM_TOL if fp64 else BF16_PARAM_TOL), (case, layout, name, err)
        assert got["tp"]["allreduce"] > 0  # the MoE layers' too, in the "tp" dimension
    assert seen == {(case, layout) for case, (layouts, *_) in checks.CASES.items()
                    for layout in layouts}
    stages = {layout: {checks.CASES[case][1] for case, at in seen if at == layout}
              for _, layout in seen}
    assert stages[(2, 2, 2)] == {0, 1, 2, 3}
    assert all({0, 3} <= s for s in stages.values()), stages


@pytest.mark.mpi
def test_a_checkpoint_at_ep2_tp2_resumes_at_ep1_tp1_and_ep2_tp1(runs, references):
    where, reports = runs[4]
    case, layout = checks.SAVES
    uninterrupted = reports[0]["train"][f"{case} {layout}"]["losses"][checks.RESUME_AT:]
    for resumed in ("(1, 1, 1)", "(2, 2, 1)"):
        got = reports[0]["resumed"][resumed]
        np.testing.assert_allclose(got, uninterrupted, rtol=0, atol=LOSS_TOL, err_msg=resumed)
    assert tools.verify(where / case, "saved") == []  # every file, both sections
    text = tools.inspect(where / case, "saved")
    assert "experts over expert-parallel 2 x tensor-parallel 2" in text, text
    whole = tools.consolidate(where / case, where / "whole.npz", "saved", npz=True)
    with np.load(whole) as f, np.load(where / "loaded_1_1_1.npz") as loaded:
        assert f["units.1.mlp.experts.fc_weight"].shape == (4, 8, 32)  # (E, C, H) whole
        assert set(f) - {"__tied__"} == set(loaded)
        for name in loaded:  # what one process loaded from the checkpoint
            np.testing.assert_array_equal(f[name], loaded[name], err_msg=name)

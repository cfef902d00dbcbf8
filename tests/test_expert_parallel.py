"""Expert parallelism (zmpi.parallel.expert, docs/moe.md "Expert parallelism"): the MoE layer
with its experts split over ep ranks equals one process running the whole batch with the plain
layer, in float64, at ep 1 and 2 on 2 ranks and ep 1, 2 (dp 2 x ep 2) and 4 on 4 ranks (one
launch each of tests/ranks/expert_checks.py): output, input gradient, the router's, the dense
parts' and every expert's gradients, the auxiliary and z losses; top-1 and top-2, dropping and
dropless, random token selection and noise, PR-MoE's residual MLP and shared experts; the same
tokens chosen and dropped on every layout; the expert-parallel Comm's all-to-all bytes equal
the formula; every impossible layout one line, alike on every rank. In this process: ep 1
over MPI_COMM_SELF, and the errors raised before any collective."""

from types import SimpleNamespace

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi

from zmpi.nn.moe import MoE, expert_capacity
from zmpi.parallel.expert import (
    ExpertGroups,
    ExpertParallelDispatcher,
    check_expert_layout,
    expert_groups,
    expert_parallel,
)

# as tests/ranks/expert_checks.py
C, E, H, S, SEQ = 6, 8, 5, 8, 2
VARIANTS = {"top1": (1, 1.0, True), "top1_residual_jitter": (1, 1.5, True),
            "top2_rts_sampling_zloss": (2, 1.0, True), "top2_shared_rsample": (2, 1.25, True),
            "top1_dropless": (1, None, False), "top2_dropless_residual_shared": (2, None, False)}
OPS_EXCEPT = ("allreduce", "reduce_scatter", "allgather", "broadcast", "object", "send", "recv")


@pytest.fixture(scope="module")
def two():
    return run_mpi(RANKS_DIR / "expert_checks.py", 2, timeout=60)


@pytest.fixture(scope="module")
def four():
    return run_mpi(RANKS_DIR / "expert_checks.py", 4, timeout=90)


def runs(two, four):
    """(ranks, ep, variant, world rank, what that rank reported) of every layout."""
    for reports in (two, four):
        for r in reports:
            for ep, variants in r["results"].items():
                for name, got in variants.items():
                    yield len(reports), int(ep), name, r["rank"], got


@pytest.mark.mpi
def test_every_layout_equals_one_process_with_the_whole_batch(two, four):
    seen = set()
    for n, ep, name, _, got in runs(two, four):
        seen.add((n, ep, name))
        errors = got["errors"]
        assert {"y", "dx", "aux", "router.weight", "experts.fc_weight", "experts.fc_bias",
                "experts.proj_weight", "experts.proj_bias"} <= errors.keys()
        if "residual" in name:
            assert "residual_mlp.fc_weight" in errors and "coefficient.weight" in errors
        if "shared" in name:
            assert "shared_experts.proj_weight" in errors
        for what, err in errors.items():
            assert err <= 1e-12, (n, ep, name, what, err)
    assert {(n, ep) for n, ep, _ in seen} == {(2, 1), (2, 2), (4, 1), (4, 2), (4, 4)}
    assert len(seen) == 5 * len(VARIANTS)


@pytest.mark.mpi
def test_the_same_tokens_are_chosen_and_dropped_on_every_layout(two, four):
    for n, ep, name, _, got in runs(two, four):
        assert got["same_routing"], (n, ep, name)
        dropping = VARIANTS[name][2]
        assert (got["dropped"] > 0) == dropping, (n, ep, name, got["dropped"])


@pytest.mark.mpi
def test_each_rank_holds_its_share_of_the_experts_under_the_whole_layers_names(two, four):
    for n, ep, _, rank, got in runs(two, four):
        local = E // ep
        assert got["groups"] == {"ep": ep, "ep_rank": rank % ep, "edp": n // ep,
                                 "edp_rank": rank // ep}
        held = list(range((rank % ep) * local, (rank % ep + 1) * local))
        shapes = got["local_shapes"]
        assert shapes["experts.fc_weight"] == [local, C, H]
        assert shapes["experts.proj_bias"] == [local, C]
        assert shapes["router.weight"] == [C, E]  # dense: whole on every rank
        assert got["ep_index"] == {f"experts.{p}": held for p in
                                   ("fc_weight", "fc_bias", "proj_weight", "proj_bias")}


@pytest.mark.mpi
def test_the_all_to_all_bytes_equal_the_formula(two, four):
    """Per layer per rank: 2 all-to-alls forward and 2 backward, each of E x G x capacity x C
    elements (G = this rank's routing groups), of which (ep - 1) / ep leaves the rank; the
    capacity is the layer's, or dropless the busiest expert's over the expert-parallel group
    (one allreduce_scalar of it forward). Nothing else travels on the expert-parallel Comm."""
    for n, ep, name, rank, got in runs(two, four):
        k, factor, dropping = VARIANTS[name]
        if dropping:
            capacity = expert_capacity(S, E, k, factor, 0)
            assert got["capacities"] == [capacity] * n
        else:
            first = rank - rank % ep
            capacity = max(got["capacities"][first:first + ep])
        nbytes = E * SEQ * capacity * C * 8
        for direction in ("forward", "backward"):
            traffic = got[direction]
            assert traffic["alltoall"] == {"calls": 2, "bytes": 2 * nbytes,
                                           "sent": 2 * (nbytes * (ep - 1) // ep)}, \
                (n, ep, name, direction)
            scalar = 1 if direction == "forward" and not dropping and ep > 1 else 0
            assert traffic["allreduce_scalar"]["calls"] == scalar
            assert all(traffic[op]["calls"] == 0 for op in OPS_EXCEPT)


@pytest.mark.mpi
def test_impossible_layouts_are_one_line_alike_on_every_rank(two, four):
    for reports in (two, four):
        n = len(reports)
        said = reports[0]["bad_layouts"]
        assert all(r["bad_layouts"] == said for r in reports)  # and no rank hung
        assert said == {
            "ep_not_dividing_dp": f"ep=3 does not divide the data-parallel size ({n} ranks): "
                                  "expert parallelism splits the data-parallel ranks into "
                                  "groups of ep",
            "ep_above_dp": f"ep={2 * n} does not divide the data-parallel size ({n} ranks): "
                           "expert parallelism splits the data-parallel ranks into groups of "
                           "ep",
            "experts_not_divisible": f"num_experts={n + 1} is not divisible by ep={n}: "
                                     "every rank of an expert-parallel group holds an equal "
                                     "share of the experts",
            "ep_zero": "ep must be an integer >= 1, got 0",
            "ep_float": "ep must be an integer >= 1, got 2.0"}


# -- in this process ---------------------------------------------------------------------------

def build(**options):
    moe = MoE(C, E, hidden=H, rng=1, dtype=np.float64, std=0.5, seed=11, min_capacity=0,
              **options)
    rng = np.random.default_rng(3)
    for p in moe.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    return moe


@pytest.fixture(scope="module")
def alone():
    from zmpi.comm import MPI, Comm

    groups = expert_groups(Comm(MPI.COMM_SELF), 1, [E])
    yield groups
    groups.free()


@pytest.mark.parametrize("options", [{"k": 1}, {"k": 2, "drop_tokens": False},
                                     {"k": 2, "use_residual": True, "num_shared_experts": 1}])
def test_ep_1_equals_the_plain_layer_and_sends_nothing(alone, options):
    x, dy = np.random.default_rng(0).standard_normal((2, 3, S, C))
    ref, moe = build(**options), expert_parallel(build(**options), alone)
    assert [n for n, _ in moe.named_parameters()] == [n for n, _ in ref.named_parameters()]
    alone.ep_comm.reset_counters()
    for m in (ref, moe):
        m.set_routing((2,), 4)
    np.testing.assert_allclose(moe.forward(x), ref.forward(x), rtol=0, atol=1e-13)
    np.testing.assert_allclose(moe.backward(dy), ref.backward(dy), rtol=0, atol=1e-13)
    for (name, p), q in zip(moe.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.grad, q.grad, rtol=0, atol=1e-12, err_msg=name)
    counted = alone.ep_comm.counters["alltoall"]
    assert counted.calls == 4 and counted.sent == 0  # on one rank: local copies


def test_the_experts_outputs_must_compute_in_the_activations_dtype(alone):
    moe = expert_parallel(build(k=1), alone)  # float64 experts
    with pytest.raises(ValueError, match="^the experts' outputs are float64 but the "
                                         "activations compute in float32: expert parallelism "
                                         "needs them alike$"):
        moe.forward(np.ones((1, S, C), np.float32))


def test_a_dispatcher_for_another_expert_count_is_refused(alone):
    moe = build(k=1)
    moe.dispatcher = ExpertParallelDispatcher(alone.ep_comm, 4)
    with pytest.raises(ValueError, match="^routing over 8 experts, but this dispatcher spreads "
                                         "4 over ep=1$"):
        moe.forward(np.ones((1, S, C)))


class NoCollective:
    """A data-parallel Comm stand-in that fails any collective: errors come before them."""

    def __init__(self, size):
        self.size, self.rank = size, 0

    def split(self, color):
        raise AssertionError("a collective ran before the layout was checked")


@pytest.mark.parametrize("dp, ep, experts, message", [
    (4, 3, [], r"^ep=3 does not divide the data-parallel size \(4 ranks\): expert "
               r"parallelism splits the data-parallel ranks into groups of ep$"),
    (1, 2, [], r"^ep=2 does not divide the data-parallel size \(1 rank\)"),
    (4, 2, [8, 3], r"^num_experts=3 is not divisible by ep=2: every rank of an "
                   r"expert-parallel group holds an equal share of the experts$"),
    (4, True, [], r"^ep must be an integer >= 1, got True$"),
    (4, -2, [], r"^ep must be an integer >= 1, got -2$"),
    (4, 2, [0], r"^num_experts must be an integer >= 1, got 0$"),
])
def test_bad_layouts_are_one_line_before_any_collective(dp, ep, experts, message):
    with pytest.raises(ValueError, match=message):
        check_expert_layout(dp, ep, experts)
    with pytest.raises(ValueError, match=message):
        expert_groups(NoCollective(dp), ep, experts)


def test_a_layer_whose_experts_ep_does_not_divide_is_refused():
    groups = ExpertGroups(SimpleNamespace(size=3, rank=0), SimpleNamespace(size=1, rank=0))
    with pytest.raises(ValueError, match="^num_experts=8 is not divisible by ep=3"):
        expert_parallel(build(k=1), groups)
    with pytest.raises(ValueError, match="^num_experts=8 is not divisible by ep=3"):
        ExpertParallelDispatcher(groups.ep_comm, E)

"""The process mesh (zmpi.parallel.mesh): data x pipeline x tensor in DeepSpeed's
PipeModelDataParallelTopology order (tensor fastest, then data, then pipeline), checked
against tables written out by hand; each group's collectives count in its own dimension;
the engine's mesh at tp = pp = 1 is the world (pipelines: tests/test_pipeline.py)."""
import pytest
from mpi_util import RANKS_DIR, run_mpi

from zmpi.config import ConfigError
from zmpi.parallel.mesh import Coordinates, NodeOrder, mesh_sizes

# 4 ranks: (tp, pp) -> per world rank (dp_rank, pp_rank, tp_rank), groups as world ranks
# (dp, pp, tp) and pipeline neighbours (prev, next); by hand from rank = pp*(dp*tp) + dp*tp + tp
FOUR = {
    (1, 1): {"coords": [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0)],
             "dp": [[0, 1, 2, 3]] * 4, "pp": [[0], [1], [2], [3]], "tp": [[0], [1], [2], [3]],
             "neighbours": [(None, None)] * 4},
    (1, 2): {"coords": [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)],
             "dp": [[0, 1], [0, 1], [2, 3], [2, 3]], "pp": [[0, 2], [1, 3], [0, 2], [1, 3]],
             "tp": [[0], [1], [2], [3]], "neighbours": [(None, 2), (None, 3), (0, None),
                                                        (1, None)]},
    (1, 4): {"coords": [(0, 0, 0), (0, 1, 0), (0, 2, 0), (0, 3, 0)],
             "dp": [[0], [1], [2], [3]], "pp": [[0, 1, 2, 3]] * 4, "tp": [[0], [1], [2], [3]],
             "neighbours": [(None, 1), (0, 2), (1, 3), (2, None)]},
    (2, 1): {"coords": [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)],
             "dp": [[0, 2], [1, 3], [0, 2], [1, 3]], "pp": [[0], [1], [2], [3]],
             "tp": [[0, 1], [0, 1], [2, 3], [2, 3]], "neighbours": [(None, None)] * 4},
    (2, 2): {"coords": [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)],
             "dp": [[0], [1], [2], [3]], "pp": [[0, 2], [1, 3], [0, 2], [1, 3]],
             "tp": [[0, 1], [0, 1], [2, 3], [2, 3]], "neighbours": [(None, 2), (None, 3),
                                                                    (0, None), (1, None)]},
    (4, 1): {"coords": [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)],
             "dp": [[0], [1], [2], [3]], "pp": [[0], [1], [2], [3]], "tp": [[0, 1, 2, 3]] * 4,
             "neighbours": [(None, None)] * 4},
}


@pytest.fixture(scope="module")
def reports():
    return run_mpi(RANKS_DIR / "mesh_checks.py", 4, timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("tp,pp", FOUR)
def test_every_factorisation_of_four_ranks_matches_deepspeeds_order(reports, tp, pp):
    want = FOUR[(tp, pp)]
    for rank, r in enumerate(reports):
        got = r["meshes"][f"tp{tp}_pp{pp}"]
        assert got["sizes"] == [4 // (tp * pp), pp, tp]
        assert tuple(got["coords"]) == want["coords"][rank]
        for dim in ("dp", "pp", "tp"):
            assert got["groups"][dim] == want[dim][rank], (dim, rank)
            assert got["sums"][dim] == len(want[dim][rank])  # an allreduce of ones
            assert got["counted"][dim] == [dim]  # only that dimension's counters moved
        assert (got["prev"], got["next"]) == want["neighbours"][rank]


@pytest.mark.mpi
def test_the_engine_mesh_is_the_world_at_tp_pp_1(reports):
    for r in reports:
        e = r["engine"]
        assert e["dp_is_world"] and e["mesh"] == {"dp": 4, "pp": 1, "tp": 1}
        assert e["dp_sent"] == e["world_sent"] > 0 and e["tp_pp_calls"] == 0


@pytest.mark.mpi
def test_close_frees_the_strategys_groups(reports):
    for r in reports:
        assert r["hybrid_groups"] == [2, 2] and r["hybrid_freed"] == [True, True]


def test_eight_ranks_by_hand():
    """pp = dp = tp = 2 (DeepSpeed's docstring example is this layout)."""
    want = {0: (0, 0, 0), 1: (0, 0, 1), 2: (1, 0, 0), 3: (1, 0, 1),
            4: (0, 1, 0), 5: (0, 1, 1), 6: (1, 1, 0), 7: (1, 1, 1)}  # (dp, pp, tp)
    groups = {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
              "pp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    for rank, coords in want.items():
        c = Coordinates.of(rank, dp=2, pp=2, tp=2)
        assert (c.dp_rank, c.pp_rank, c.tp_rank) == coords
    for dim, members in groups.items():
        for group in members:
            colors = {Coordinates.of(r, 2, 2, 2).group(dim, 2, 2, 2) for r in group}
            assert len(colors) == 1, (dim, group)
        assert len({Coordinates.of(g[0], 2, 2, 2).group(dim, 2, 2, 2) for g in members}) == 4


@pytest.mark.parametrize("size,tp,pp,words", [
    (4, 3, 1, "tp x pp = 3 x 1 = 3 does not divide the 4 ranks"),
    (8, 2, 3, "does not divide the 8 ranks"), (4, 0, 1, "tp must be an integer >= 1"),
    (4, 1, 2.0, "pp must be an integer >= 1")])
def test_a_mesh_that_does_not_divide_is_a_clear_error(size, tp, pp, words):
    with pytest.raises(ValueError, match=words):
        mesh_sizes(size, tp, pp)


# ---- groups inside a node, whatever the placement (issue 56; across hosts:
# tests/test_twohost.py) ------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, group", [((2, 2), 2), ((2, 2), 1), ((2, 2), 4), ((4, 4), 2),
                                          ((2, 2, 2, 2), 4), ((3, 1), 1), ((3, 1), 4)])
def test_groups_inside_a_node_or_of_whole_nodes_are_accepted(sizes, group):
    NodeOrder(0, tuple(range(sum(sizes))), sizes).check_groups(group, "key")


@pytest.mark.parametrize("sizes, group", [((3, 1), 2), ((2, 2, 2), 3), ((4, 2), 3)])
def test_a_group_that_would_split_a_node_across_nodes_is_refused(sizes, group):
    """Nodes of 3 and 1 ranks in groups of 2: the second group would hold one rank of each
    node; refused naming the key, the ranks per node and the placement flag."""
    order = NodeOrder(0, tuple(range(sum(sizes))), sizes)
    with pytest.raises(ConfigError, match=rf"^key: groups of {group} ranks would span nodes "
                       rf"without holding them whole: the nodes hold {', '.join(map(str, sizes))}"
                       r" ranks; .*\(mpiexec -ppn, srun --ntasks-per-node\)$"):
        order.check_groups(group, "key")

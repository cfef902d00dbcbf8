"""Tensor parallelism's layers (zmpi.parallel.tensor: regions.py, linear.py): at tp = 2 and 4
(one 2-rank and one 4-rank launch of tests/ranks/tensor_checks.py) Megatron's MLP block
Column -> GELU -> Row equals the serial Linear -> GELU -> Linear from the same seeds, passes a
collective float64 finite-difference check, and sends exactly one allreduce forward (g) and one
backward (f). At tp.size == 1 (in this process) the layers are Linear exactly and send nothing.
docs/tensor-parallel.md's example runs as written."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
from gradcheck import check_module
from mpi_util import RANKS_DIR, REPO_ROOT, run_mpi

from zmpi.nn import GELU, Linear
from zmpi.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear
from zmpi.parallel.tensor.regions import CopyToTensorRegion, ReduceFromTensorRegion

B, T, C_IN, HIDDEN, C_OUT = 2, 3, 6, 16, 5  # as tests/ranks/tensor_checks.py


@pytest.fixture(scope="module")
def two():
    return run_mpi(RANKS_DIR / "tensor_checks.py", 2, timeout=60)


@pytest.fixture(scope="module")
def four():
    return run_mpi(RANKS_DIR / "tensor_checks.py", 4, timeout=60)


def runs(two, four):
    """(launch size, tp, report of one rank) for tp = 2 on 2 ranks, and tp = 4 and tp = 2
    (two tp groups) on 4 ranks."""
    for reports in (two, four):
        for r in reports:
            for t, got in r["tp"].items():
                yield len(reports), int(t), got


@pytest.mark.mpi
def test_the_parallel_mlp_block_equals_the_serial_one(two, four):
    seen = set()
    for size, t, got in runs(two, four):
        seen.add((size, t))
        assert got["tp_size"] == t and got["is_world"] == (t == size)
        s = got["serial"]
        for name in ("y", "dx", "fc.weight", "fc.weight.grad", "fc.bias.grad", "proj.weight",
                     "proj.weight.grad", "proj.bias.grad"):
            assert s[name] <= 1e-12, (size, t, name, s[name])
        assert s["shapes"] == {"fc.weight": [C_IN, HIDDEN // t], "fc.bias": [HIDDEN // t],
                               "proj.weight": [HIDDEN // t, C_OUT], "proj.bias": [C_OUT]}
        assert s["tp_split"] == [1, 0, 0, None]
    assert seen == {(2, 2), (4, 2), (4, 4)}


@pytest.mark.mpi
def test_collective_finite_difference_check(two, four):
    for _, t, got in runs(two, four):
        if t == 2:  # x, the replicated bias, and each rank's slices; L the same on all ranks
            g = got["gradcheck"]
            assert g["checked"] == ["x", "proj.bias", "fc.weight", "fc.bias", "proj.weight"]
            assert g["L_same"] and g["forwards"] == 5 * 3 * 2 + 1


@pytest.mark.mpi
def test_one_allreduce_forward_and_one_backward(two, four):
    for _, t, got in runs(two, four):
        for key, itemsize in (("traffic", 8), ("traffic_fp16", 4)):  # fp16: sums in float32
            tr = got[key]
            assert tr["itemsize"] == itemsize
            fwd, bwd = tr["forward"], tr["backward"]
            assert fwd["allreduce"]["calls"] == 1  # g: the row layer's output
            assert fwd["allreduce"]["bytes"] == B * T * C_OUT * itemsize
            assert bwd["allreduce"]["calls"] == 2  # + f: the column layer's input gradient
            assert bwd["allreduce"]["bytes"] == B * T * (C_OUT + C_IN) * itemsize
            assert bwd["allreduce"]["sent"] == 2 * (t - 1) * B * T * (C_OUT + C_IN) \
                * itemsize // t
            others = [op for op, c in bwd.items() if op != "allreduce" and c["calls"]]
            assert not others, (key, others)


@pytest.mark.mpi
def test_half_precision_storage_and_refusals(two, four):
    for _, t, got in runs(two, four):
        h = got["half"]
        assert h["dtype"] == "float32" and h["grad_dtype"] == "float16"
        assert h["y"] < 1e-5 and h["dx"] < 1e-5
        for which, feature in (("column", "out_features"), ("row", "in_features")):
            assert got["refusals"][which] == (
                f"{feature}={4 * t + 1} is not divisible by the tensor-parallel size {t}: "
                "every rank must hold an equal slice")


# ---- tp.size == 1, in this process


@pytest.fixture(scope="module")
def solo():
    from zmpi.comm import MPI, Comm

    return Comm(MPI.COMM_SELF)


def blocks(tp, dtype=np.float64, seed=3):
    rng = np.random.default_rng(seed)
    par = [ColumnParallelLinear(C_IN, HIDDEN, tp, rng=rng, dtype=dtype), GELU(),
           RowParallelLinear(HIDDEN, C_OUT, tp, rng=rng, dtype=dtype, std=0.3)]
    rng = np.random.default_rng(seed)
    ser = [Linear(C_IN, HIDDEN, rng=rng, dtype=dtype), GELU(),
           Linear(HIDDEN, C_OUT, rng=rng, dtype=dtype, std=0.3)]
    return par, ser


def run(layers, x, dy):
    for layer in layers:
        x = layer.forward(x)
    y = x
    for layer in reversed(layers):
        dy = layer.backward(dy)
    return y, dy


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_at_tp_1_the_layers_are_linear_exactly(solo, dtype):
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((B, T, C_IN)), rng.standard_normal((B, T, C_OUT))
    par, ser = blocks(solo, dtype)
    solo.reset_counters()
    y, dx = run(par, x.astype(dtype), dy.astype(dtype))
    y1, dx1 = run(ser, x.astype(dtype), dy.astype(dtype))
    assert y.dtype == y1.dtype and np.array_equal(y, y1) and np.array_equal(dx, dx1)
    for p, q in ((par[0], ser[0]), (par[2], ser[2])):
        for a, b in ((p.weight, q.weight), (p.bias, q.bias)):
            assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
            assert np.array_equal(a.grad, b.grad)
    assert all(c["calls"] == 0 for c in solo.counters_snapshot().values())


def test_gradients_at_tp_1(solo):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, T, C_IN))
    col = ColumnParallelLinear(C_IN, 4, solo, rng=2, dtype=np.float64)
    col.bias.data[...] = rng.standard_normal(4)
    assert check_module(col, x, rng) == ["input", "weight", "bias"]
    row = RowParallelLinear(C_IN, 3, solo, rng=3, dtype=np.float64)
    row.bias.data[...] = rng.standard_normal(3)
    assert check_module(row, x, rng) == ["input", "weight", "bias"]


def test_regions_and_cache_discipline(solo):
    x = np.arange(6.0).reshape(2, 3)
    for region in (CopyToTensorRegion(solo), ReduceFromTensorRegion(solo)):
        assert region.forward(x) is x and region.backward(x) is x  # identities, no copy
        with pytest.raises(RuntimeError, match="without a preceding forward"):
            region.backward(x)
    h = np.ones(3, np.float16)
    assert ReduceFromTensorRegion(solo).forward(h).dtype == np.float32  # the compute dtype
    for layer in (ColumnParallelLinear(4, 4, solo), RowParallelLinear(4, 4, solo)):
        with pytest.raises(RuntimeError, match="without a preceding forward"):
            layer.backward(np.zeros((1, 4), np.float32))
    col = ColumnParallelLinear(4, 4, solo, bias=False, copy_input=False)
    assert col.bias is None and col.f is None and [n for n, _ in col.named_parameters()] == [
        "weight"]


def test_parameters_name_and_mark_their_split(solo):
    col, row = ColumnParallelLinear(4, 8, solo), RowParallelLinear(8, 4, solo)
    assert [n for n, _ in col.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in row.named_parameters()] == ["weight", "bias"]
    assert (col.weight.tp_split, col.bias.tp_split) == (1, 0)
    assert (row.weight.tp_split, row.bias.tp_split) == (0, None)


def test_slices_of_a_wider_group_and_clear_errors():
    """The layers read only tp.size and tp.rank when built: a stand-in group of 4 shows each
    rank's slice of the serial weight, and the refusals."""
    full = Linear(6, 8, rng=5, dtype=np.float64).weight.data
    for r in range(4):
        tp = SimpleNamespace(size=4, rank=r)
        col = ColumnParallelLinear(6, 8, tp, rng=5, dtype=np.float64)
        assert np.array_equal(col.weight.data, full[:, 2 * r:2 * r + 2])
        assert col.weight.data.flags.c_contiguous and col.bias.shape == (2,)
        row = RowParallelLinear(8, 6, tp, rng=5, dtype=np.float64)
        assert np.array_equal(row.weight.data,
                              Linear(8, 6, rng=5, dtype=np.float64).weight.data[2 * r:2 * r + 2])
        assert row.bias.shape == (6,)
    tp = SimpleNamespace(size=4, rank=0)
    with pytest.raises(ValueError, match="out_features=6 is not divisible by the "
                                         "tensor-parallel size 4"):
        ColumnParallelLinear(8, 6, tp)
    with pytest.raises(ValueError, match="in_features=6 is not divisible"):
        RowParallelLinear(6, 8, tp)
    row = RowParallelLinear(8, 6, tp)
    with pytest.raises(ValueError, match=r"this rank's slice of the input: last axis 2"):
        row.forward(np.zeros((1, 8), np.float32))  # the full input by mistake


def test_docs_example_runs():
    """docs/tensor-parallel.md's examples, as written, at one rank."""
    text = (REPO_ROOT / "docs" / "tensor-parallel.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 3  # the layers, the GPT under the engine, sequence parallelism
    for code in blocks[:2]:
        exec(compile(code, "docs/tensor-parallel.md", "exec"), {})
    # at one rank there is no tensor group to split the sequence over: the config says so
    with pytest.warns(UserWarning, match="sequence_parallel: no effect at autotp_size 1"):
        exec(compile(blocks[2], "docs/tensor-parallel.md", "exec"), {})

"""ZeRO++ (zmpi/zero/zeropp.py, docs/zeropp.md): the block-wise quantizer, Comm's all-to-all,
and qwZ, qgZ and hpZ against stage 3.

Single-process: the quantizer's round-trip bounds and wire format (and the same bytes on the
CuPy stand-in), the config's rules. One `mpiexec -n N` launch per world size (2, 4) runs
tests/ranks/zeropp_checks.py: all-to-all values, counters and debug check; the traffic each
mode sends per communicator, equal to what it declares, and the reductions it is for; the
memory it holds; training on Tiny Shakespeare close to stage 3 (hpZ: equal to the bit); an
fp16 overflow through the quantized reduction; the config errors. One more launch runs the
quantized modes on the CuPy stand-in (device buffers, staged through the host), equal to
NumPy. The shared strategy suite (tests/test_zero.py) runs `zeropp`'s suite configs too.
"""
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import RANKS_DIR, REPO_ROOT, STANDIN, run_mpi

from zmpi import backend
from zmpi.config import Config, ConfigError
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.zero import zeropp
from zmpi.zero.quantize import QMAX, dequantize, n_blocks, quantize, row_nbytes

# Training on Tiny Shakespeare, 40 steps at lr 3e-3 (loss 4.19 -> 3.14: the early, noisy
# stretch of a small model); the worst relative difference from stage 3's loss measured over
# 2 and 4 ranks, fp16 and fp32 (the 300-step figures are experiments/bench_zeropp.py's):
#                      qwZ      qgZ      all three
#   at any step        1.4 %    3.0 %    2.9 %
#   last 10 steps      0.9 %    2.2 %    2.0 %
STEP_LOSS_RTOL = 0.05
LAST_LOSS_RTOL = 0.03


# ---- the quantizer ------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,block", [(1, 2), (7, 4), (255, 256), (1000, 256), (513, 256),
                                         (4096, 2048), (4097, 2048)])
def test_round_trip_is_within_half_a_step_of_each_block(bits, numel, block):
    """|x - x'| <= max|x| / (2 qmax) in every block (float32 rounding aside); an all-zero
    block comes back zero; each block's largest |x| comes back to within a float32 ulp; the
    wire takes exactly row_nbytes."""
    rng = np.random.default_rng(numel + bits)
    x = (rng.standard_normal((3, numel)) * np.exp(2 * rng.standard_normal((3, 1)))).astype(
        np.float32)
    x[1, :block] = 0
    wire = quantize(x, bits, block)
    assert wire.dtype == np.uint8 and wire.shape == (3, row_nbytes(numel, bits, block))
    assert row_nbytes(numel, bits, block) == 4 * n_blocks(numel, block) + -(-numel * bits // 8)
    back = dequantize(wire, numel, bits, block)
    assert back.dtype == np.float32 and back.shape == x.shape
    for b in range(n_blocks(numel, block)):
        part = slice(b * block, (b + 1) * block)
        amax = np.abs(x[:, part]).max(axis=1, keepdims=True)
        err = np.abs(x[:, part] - back[:, part])
        assert np.all(err <= amax / (2 * QMAX[bits]) * (1 + 1e-5)), (b, err.max())
        top = np.abs(x[:, part]).argmax(axis=1)
        rows = np.arange(3)
        np.testing.assert_allclose(back[:, part][rows, top], x[:, part][rows, top], rtol=2e-7)
    assert np.all(back[1, :block] == 0)


def test_wire_format_is_scales_then_packed_values():
    """int8: two's complement bytes; int4: q + 8, two per byte, low nibble first, an odd tail
    padded with a zero nibble; the scale is max|x| / qmax as float32."""
    x = np.array([[1.0, -1.0, 0.3]], np.float32)
    wire = quantize(x, 4, 4)
    assert wire.shape == (1, 4 + 2)
    assert wire[0, :4].view(np.float32)[0] == np.float32(1.0) / np.float32(7)
    assert wire[0, 4:].tolist() == [(7 + 8) | (-7 + 8) << 4, 2 + 8]  # 0.3 * 7 = 2.1 -> 2
    wire = quantize(x, 8, 2)
    assert wire.shape == (1, 8 + 3)
    assert wire[0, 8:].view(np.int8).tolist() == [127, -127, 127]  # second block: 0.3 alone


@pytest.mark.parametrize("dtype", [np.float16, np.float64, backend.BFLOAT16])
def test_other_float_dtypes_quantize_as_float32(dtype):
    x = np.linspace(-3, 5, 37).astype(dtype).reshape(1, -1)
    for bits in (8, 4):
        back = dequantize(quantize(x, bits, 16), 37, bits, 16)
        assert np.all(np.abs(back - x.astype(np.float32)) <= 5 / (2 * QMAX[bits]) * 1.001)


def test_non_finite_blocks_stay_non_finite():
    """An inf or NaN makes its block's scale non-finite, so the whole block dequantizes
    non-finite (the loss scaler's overflow signal survives); other blocks are untouched."""
    x = np.array([[1.0, np.inf, 2.0, 3.0], [np.nan, 1.0, -2.0, 0.0]], np.float32)
    for bits in (8, 4):
        back = dequantize(quantize(x, bits, 2), 4, bits, 2)
        assert not np.isfinite(back[:, :2]).any()
        assert np.isfinite(back[:, 2:]).all()


def test_bad_widths_and_sizes_are_errors():
    with pytest.raises(ValueError, match="only 8 and 4"):
        quantize(np.zeros((1, 4), np.float32), 2, 4)
    with pytest.raises(ValueError, match="even"):
        quantize(np.zeros((1, 4), np.float32), 8, 3)
    with pytest.raises(ValueError, match="rows of 5 bytes"):
        dequantize(np.zeros((1, 5), np.uint8), 4, 8, 4)


def test_the_cupy_standin_quantizes_to_the_same_bytes():
    """The quantizer is array-module code: on device arrays (the strict stand-in refuses any
    NumPy operand) it writes the bytes NumPy writes, and dequantizes to the same values."""
    code = """
import numpy as np
from zmpi import backend
from zmpi.zero.quantize import dequantize, quantize
x = np.random.default_rng(0).standard_normal((4, 1001)).astype(np.float16)
for bits in (8, 4):
    host = quantize(x, bits, 256)
    device = quantize(backend.xp.asarray(x), bits, 256)
    assert type(device).__module__ == "cupy"
    assert (backend.to_host(device) == host).all(), bits
    back = backend.to_host(backend.xp.ascontiguousarray(dequantize(device, 1001, bits, 256)))
    assert (back == dequantize(host, 1001, bits, 256)).all(), bits
print("same")
"""
    done = subprocess.run([sys.executable, "-c", code], env=STANDIN, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "same", done.stderr


# ---- the config ---------------------------------------------------------------------------
def test_keys_act_with_stage_3_and_are_rejected_below():
    for key, value in (("zero_quantized_weights", True), ("zero_quantized_gradients", True),
                       ("zero_hpz_partition_size", 2)):
        zero = Config.from_dict({"zero_optimization": {"stage": 3, key: value}}).zero_optimization
        assert zero.strategy_name == "zeropp" and zero.zeropp_keys == [key]
        for stage in (0, 1, 2):
            with pytest.raises(ConfigError, match=rf'^zero_optimization.{key}: ZeRO\+\+ .* needs '
                                                  rf'"stage": 3, got {stage}$'):
                Config.from_dict({"zero_optimization": {"stage": stage, key: value}})
    defaults = Config.from_dict({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1,
                                                       "zero_quantized_weights": False}})
    assert defaults.zero_optimization.strategy_name == "stage3"
    with pytest.raises(ConfigError, match="zero_hpz_partition_size: must be >= 1, got 0"):
        Config.from_dict({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}})
    with pytest.raises(ConfigError, match="zero_quantized_nontrainable_weights: zmpi always"):
        Config.from_dict({"zero_optimization": {"zero_quantized_nontrainable_weights": True}})


@pytest.mark.parametrize("given, sizes, in_blocks, offload, expected", [
    (None, (2, 2), True, False, 2),  # across nodes in blocks: a node's ranks
    (None, (4, 4, 4), True, False, 4),
    (None, (4,), True, False, 1),  # one node: the group would be the world
    (None, (3, 1), True, False, 1),  # nodes of different sizes
    (None, (2, 2), False, False, 1),  # round-robin: asked for by name only
    (None, (2, 2), True, True, 1),  # offload_param keeps the device free of the copy
    (1, (2, 2), True, False, 1),  # given: as given
    (4, (2, 2), True, False, 4)])
def test_hpz_partition_defaults_to_the_node_size(given, sizes, in_blocks, offload, expected):
    """Issue 56: hpZ's group is a node's ranks unless `zero_hpz_partition_size` says
    otherwise, where the data-parallel ranks span nodes (zeropp.ZeroPP.hpz_size)."""
    from zmpi.parallel.mesh import NodeOrder

    zero = {"stage": 3, "zero_quantized_weights": True}
    if given is not None:
        zero["zero_hpz_partition_size"] = given
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    config = Config.from_dict({"zero_optimization": zero}).zero_optimization
    n = sum(sizes)
    ranks = tuple(range(n)) if in_blocks else tuple(range(0, n, 2)) + tuple(range(1, n, 2))
    assert zeropp.ZeroPP.hpz_size(config, NodeOrder(0, ranks, sizes)) == expected
    assert zeropp.ZeroPP.hpz_size(config, None) == (given or 1)  # one rank


def test_one_rank_engine_runs_zeropp_and_other_strategies_refuse_its_keys():
    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=16)
    engine = Engine(GPT(cfg, seed=0), {"train_micro_batch_size_per_gpu": 2, "zero_optimization":
                                       {"stage": 3, "zero_quantized_weights": True,
                                        "zero_quantized_gradients": True}})
    assert isinstance(engine.strategy, zeropp.ZeroPP)
    x = np.zeros((2, 8), np.int64)
    assert np.isfinite(engine.train_step(x, x))
    assert set(engine.strategy.comms()) == {"world"}  # no hpZ group
    with pytest.raises(ConfigError, match="strategy 'hybrid' does not act on ZeRO"):
        Engine(GPT(cfg), {"zero_optimization": {"strategy": "hybrid",
                                                "zero_hpz_partition_size": 1,
                                                "zero_quantized_gradients": True}})


# ---- under MPI ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"n{n}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"zeropp_n{request.param}")
    return request.param, run_mpi(RANKS_DIR / "zeropp_checks.py", request.param, args=[out],
                                  timeout=400)


@pytest.mark.mpi
def test_alltoall_values_counters_and_checks(run):
    n, reports = run
    k = 3
    for r, rep in enumerate(reports):
        got = rep["alltoall"]
        want = np.repeat(10 * np.arange(n) + r, k).tolist()
        for name in ("uint8", "float32", "float16", "bfloat16", "int64"):
            assert got[name] == [want, want], name
        nbytes = n * k * (1 + 4 + 2 + 2 + 8)  # one of each dtype
        assert got["counters"] == {"calls": 10, "bytes": 2 * nbytes,
                                   "sent": 2 * nbytes * (n - 1) // n}
        assert got["size_error"].startswith("alltoall: send.size (") and "multiple" in \
            got["size_error"]
        assert got["mismatch"].startswith("the ranks called different collectives")


def _wire(unit, n, what, ranks=None):
    """Bytes a rank sends of `unit`'s "weights" (int8) or "gradients" (int4) over `ranks`
    (default n) ranks of a world of n: a row of the shard's elements per other rank, cut
    where each tensor (or the padding) starts in any rank's shard."""
    bits, block = {"weights": (8, zeropp.WEIGHT_BLOCK), "gradients": (4, zeropp.GRAD_BLOCK)}[what]
    shard = unit["padded"] // n
    starts = {*unit["offsets"], unit["numel"]}
    cuts = sorted({0} | {b % shard for b in starts if b < unit["padded"]})
    return ((ranks or n) - 1) * row_nbytes(shard, bits, block, cuts)


@pytest.mark.mpi
def test_quantized_collectives_equal_a_numpy_reference_of_the_algorithm(run):
    """One unit's qwZ gather and qgZ reduction (one hop over the world; two hops over pairs
    at 4 ranks) equal, bit for bit, a reference written rank by rank in the rank script; the
    int4 reduction of heavy-tailed gradients stays within 25 % of the exact sum (measured
    0.09-0.16: int4 keeps a block's large values and rounds its small ones away)."""
    n, reports = run
    for rep in reports:
        c = rep["collectives"]
        assert c["qwZ_gather"] and c["all_gather"] and c["qgZ_reduce"] and c["all_reduce"], c
        assert c["qgZ_reduce_error"] < 0.25 and c["all_reduce_error"] < 0.25, c


@pytest.mark.mpi
def test_traffic_equals_declared_and_the_papers_reductions(run):
    """Bytes each rank sends in one fp16 step, per communicator and op: exactly what the mode
    declares, and against stage 3: qwZ's allgathers (int8 + a float32 scale per block of at
    most 2048 elements of one tensor) and qgZ's all-to-all (int4 + a scale per 64) are the
    quantized volume of the fp16 collectives they replace: the int8 values half the fp16
    bytes, the scales on top (this toy GPT's 14 tensors of 16 to 768 elements take a scale
    each: 1.88x and 3.3x here, 1.995x and 3.55x on the benchmark's GPT); hpZ's world
    allgathers are forward's alone (none while backward runs), backward's run in the group."""
    n, reports = run
    for rep in reports:
        t = rep["traffic"]
        for name, case in t.items():
            measured = {kind: sum(ops.values()) for kind, ops in case["sent"].items()}
            assert measured == case["declared"], (n, name, measured)
            assert case["held"] == case["declared_memory"], (n, name)
        base = t["stage3"]["sent"]["world"]
        units, reads = t["stage3"]["units"], t["stage3"]["reads"]
        qw = sum(2 * r * _wire(u, n, "weights") for u, r in zip(units, reads, strict=True))
        assert t["qwZ"]["sent"]["world"] == {"allgather": qw,
                                             "reduce_scatter": base["reduce_scatter"]}
        shards = [u["padded"] // n for u in units]
        assert base["allgather"] == 2 * sum(2 * r * (n - 1) * m for m, r in
                                            zip(shards, reads, strict=True))  # int8 values
        assert 1.85 < base["allgather"] / qw < 2
        qg = sum(_wire(u, n, "gradients") for u in units)
        assert t["qgZ"]["sent"]["world"] == {"allgather": base["allgather"], "alltoall": qg}
        assert 3.0 < base["reduce_scatter"] / qg < 4
        hpz = t["hpZ"]["sent"]
        assert hpz["world"] == {"allgather": base["allgather"] // 2,
                                "reduce_scatter": base["reduce_scatter"]}
        # G = 2: a group allgather sends half of the unit's P fp16 elements, P bytes
        assert hpz["intra"] == {"allgather": sum(r * u["padded"] for u, r in
                                                 zip(units, reads, strict=True))}
        assert t["stage3"]["world_allgathers_in_backward"] == sum(reads)
        assert t["hpZ"]["world_allgathers_in_backward"] == 0
        assert t["all"]["world_allgathers_in_backward"] == 0
        every = t["all"]["sent"]
        if n == 4:  # qgZ's two hops: int4 chunks inside the pair, then across the pairs
            assert set(every) == {"world", "intra", "inter"}
            # hop 1: to the pair's other rank, the 2 shards it sums; hop 2: 1 shard across
            assert every["intra"]["alltoall"] == sum(2 * _wire(u, n, "gradients", 2) for u in units)
            assert every["inter"]["alltoall"] == sum(_wire(u, n, "gradients", 2) for u in units)
        else:  # one group of all: one hop over the world
            assert every["world"]["alltoall"] == qg
        assert t["all_overlap"]["sent"] == every
        secondary = sum(u["padded"] // 2 for u in units) * 2  # Psi / G fp16 elements
        for name in ("hpZ", "all"):
            extra = {d: {c: t[name]["held"][d][c] - t["stage3"]["held"][d][c]
                         for c in t[name]["held"][d]} for d in ("device", "host")}
            assert extra["device"]["param"] == secondary
            assert sum(extra["device"].values()) + sum(extra["host"].values()) == secondary


@pytest.mark.mpi
def test_training_stays_close_to_stage_3_and_hpz_is_exact(run):
    n, reports = run
    for rep in reports:
        tr = rep["training"]
        for dtype in ("fp16", "fp32"):
            base = np.array(tr[f"stage3_{dtype}"]["losses"])
            assert base[-1] < 0.75 * base[0]  # it learns
            assert tr[f"hpZ_{dtype}"] == tr[f"stage3_{dtype}"]  # the same bits
            for mode in ("qwZ", "qgZ", "all"):
                losses = np.array(tr[f"{mode}_{dtype}"]["losses"])
                step = np.abs(losses / base - 1).max()
                last = abs(losses[-10:].mean() / base[-10:].mean() - 1)
                where = (n, mode, dtype, step, last)
                assert step <= STEP_LOSS_RTOL and last <= LAST_LOSS_RTOL, where
                assert tr[f"{mode}_{dtype}"]["digest"] != tr[f"stage3_{dtype}"]["digest"]
        for a, b in (("hpZ_recompute", "stage3_recompute"), ("all_overlap", "all"),
                     ("all_accumulate_overlap", "all_accumulate"),
                     ("qwZ_offload_param", "qwZ"), ("qgZ_offload_optimizer", "qgZ")):
            assert tr[f"{a}_short"] == tr[f"{b}_short"], (n, a, b)
        assert np.isfinite(tr["all_accumulate_short"]["losses"]).all()
    assert len({str(r["training"]) for r in reports}) == 1  # every rank agrees


@pytest.mark.mpi
def test_an_fp16_overflow_crosses_the_quantized_reduction(run):
    """An inf in one rank's gradient (step 2) skips the step on every rank: the scale halves
    (2^8 -> 2^7) and no parameter moves."""
    _, reports = run
    for rep in reports:
        o = rep["overflow"]
        assert o["scales"] == [256, 256, 128, 128] and o["skipped"] == 1, o
        assert o["changed"] == 0.0


@pytest.mark.mpi
def test_bad_combinations_are_config_errors_on_every_rank(run):
    n, reports = run
    for rep in reports:
        e = rep["config_errors"]
        g = 3 if n % 3 else 5
        assert e["hpz_not_dividing"] == (f"zero_optimization.zero_hpz_partition_size: {g} does "
                                         f"not divide the {n} data-parallel ranks into equal "
                                         "groups")
        assert e["hpz_offload_param"].startswith("zero_optimization.zero_hpz_partition_size: "
                                                 "hpZ keeps a secondary shard on the device")
        assert e["hybrid_with_qwz"] == ("zero_optimization.zero_quantized_weights: strategy "
                                        "'hybrid' does not act on ZeRO++'s keys; they act with "
                                        '"stage": 3 and no "strategy" (or "zeropp")')
        assert e["stage3_named_with_qgz"].startswith(
            "zero_optimization.zero_quantized_gradients: strategy 'stage3' does not act")


@pytest.mark.mpi
def test_quantized_modes_on_the_cupy_standin_equal_numpy(run, tmp_path):
    """qwZ, qgZ and all three (qgZ's two hops at 4 ranks) on device buffers, staged through
    pinned host memory: 3 fp32 steps, the same parameters as the NumPy backend, bit for bit
    (the stand-in computes in NumPy; what it checks is that every array stays on its side)."""
    n, _ = run
    if n != 4:
        pytest.skip("one world size is enough")
    for backend_name, env in (("numpy", {"ZMPI_BACKEND": "numpy"}), ("standin", STANDIN)):
        out = tmp_path / backend_name
        out.mkdir()
        rep = run_mpi(RANKS_DIR / "zeropp_checks.py", n, args=[out, "standin"], timeout=300,
                      env=env)[0]
        assert rep["backend"] == ("cupy" if backend_name == "standin" else "numpy")
        assert (rep["staged"]["to_host"] > 0) == (backend_name == "standin")
    for mode in ("qwZ", "qgZ", "all"):
        with np.load(tmp_path / "numpy" / f"{mode}.npz") as a, \
                np.load(tmp_path / "standin" / f"{mode}.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for k in a.files:
                np.testing.assert_array_equal(a[k], b[k], err_msg=(mode, k))


@pytest.mark.mpi
def test_the_benchmark_runs_and_checks_its_bytes(tmp_path):
    """experiments/bench_zeropp.py at a tiny size (it raises if a mode sends other bytes than
    it declares): every mode's row, the reduction factors, the loss curves."""
    from mpi_util import launch_mpi

    out = tmp_path / "zeropp"
    result = launch_mpi(REPO_ROOT / "experiments" / "bench_zeropp.py", 4, timeout=240,
                        env={"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'experiments'}",
                             "MPLBACKEND": "Agg"},
                        args=["--steps", "3", "--n-layer", "1", "--d-model", "32",
                              "--seq-len", "16", "--batch", "8", "--out", out])
    assert result.returncode == 0, result.describe()
    table = (out / "table.md").read_text()
    modes = ("stage 3", "qwZ", "qgZ", "hpZ", "qwZ+qgZ+hpZ", "stage 0 (control)")
    assert all(f"| {mode} |" in table for mode in modes)
    assert "| hpZ world allgather | 2.000x |" in table
    assert (out / "losses.csv").read_text().splitlines()[0] == "step," + ",".join(modes)
    assert (out / "loss.png").stat().st_size > 1000

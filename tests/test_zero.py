"""The shared suite of every partition strategy: parity with a single-process reference, and
measured memory and traffic against what the strategy declares and the ZeRO paper's formulas.

One `mpiexec -n N` launch per world size (1, 2, 3, 4; 3 gives uneven shards and padding) runs
tests/ranks/zero_checks.py over every registered strategy (stage0-3, hybrid and hybrid_zero2
at every group size that divides N, zeropp's hpZ alone and with quantization) and the
tutorial strategy of docs/strategies.md, loaded
by module path. Every strategy the registry knows is checked here: the built-in ones, installed
entry points, and strategy files named with `--strategy-module FILE.py`; `--strategy NAME`
runs the suite on that strategy alone (tests/conftest.py; `make test-strategy`). The assertions
compare what the ranks report with the reference (tests/reference.py), with the strategy's
`expected_model_state` / `expected_traffic`, and, for stages 0-3, with the ZeRO paper's
formulas (zmpi.memory).
"""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi_util import RANKS_DIR, REPO_ROOT, run_mpi
from reference import reference_train

from zmpi.data import SyntheticSource
from zmpi.memory import ARRAY_OPS, model_state_bytes
from zmpi.models.gpt import GPT
from zmpi.zero import available_strategies
from zmpi.zero.flat import ModelLayout, UnitLayout
from zmpi.zero.strategy import Strategy

sys.path.insert(0, str(RANKS_DIR))
import zero_checks  # noqa: E402  (the rank script: its cases and constants)
from test_strategies_doc import example_code  # noqa: E402

TUTORIAL = "zero1_allreduce:Zero1Allreduce"  # docs/strategies.md, written to a temp dir

WORLD_SIZES = (1, 2, 3, 4)
# Measured with 5 AdamW steps (lr 1e-2) of a 2-layer GPT; worst case over stages and sizes:
#   fp64       per tensor max|p - ref| / max|ref|                 2.8e-13   (bound 1e-6)
#   fp32       per tensor max|p - ref| / max|ref - init|          1.6e-4    (bound 1e-3)
#              whole model ||p - ref|| / ||ref - init||          8.5e-6    (bound 1e-4)
#   fp16/bf16  whole model ||p - ref|| / ||ref - init||          8.7e-3 / 5.5e-2 (2e-2 / 0.1)
# The engine is exact (fp64). fp32 cannot be held to 1e-6: where a gradient is exactly zero or
# nearly cancels (GPT's key bias), Adam's g / sqrt(v) turns float32 rounding noise into
# whole-lr moves, so any change of summation order (a different batch split) shows; the same
# noise makes per-tensor bounds meaningless for fp16/bf16, which are bounded model-wide.
FP64_RTOL = 1e-6
FP32_TENSOR_MOVE_RTOL = 1e-3
MODEL_MOVE_RTOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 0.1}
LOSS_RTOL = {"fp64": 1e-12, "fp32": 1e-5, "fp16": 1e-2, "bf16": 5e-2}
# ZeRO++'s quantized configs ("zero_quantized_*": int8 weights, int4 gradients) are held, in
# every variant, to the loss and a model-wide bound. The same Adam noise at int4's rounding
# (up to 1/14 of a block's largest gradient) moves the weights far from the reference: worst
# ||p - ref|| / ||ref - init|| 0.53 (int8 weights alone: 0.12), losses within 3.2e-3. How
# close quantized training stays over 300 steps: tests/test_zeropp.py, bench_zeropp.py.
QUANTIZED_MODEL_MOVE_RTOL, QUANTIZED_LOSS_RTOL = 0.8, 1e-2


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def run(request, tmp_path_factory, strategy_selection):
    only, files = strategy_selection
    out = tmp_path_factory.mktemp(f"zero_n{request.param}")
    (out / "zero1_allreduce.py").write_text(example_code())
    # the tutorial, unless the suite runs on other strategies or a file of that name replaces it
    tutorial = not (only and "zero1_allreduce" not in only) and not any(
        Path(f).stem == "zero1_allreduce" for f in files)
    args = [out, *[TUTORIAL] * tutorial, *files, *(f"--only={name}" for name in only)]
    reports = run_mpi(RANKS_DIR / "zero_checks.py", request.param, args=args,
                      timeout=300, env={"PYTHONPATH": f"{REPO_ROOT}:{out}"})
    return request.param, out, reports


@pytest.fixture
def whole_suite(strategy_selection):
    """Skips a check of the built-in strategies (or of none) when the suite runs on chosen
    strategies only (--strategy)."""
    if strategy_selection[0]:
        pytest.skip(f"the suite runs on --strategy {', '.join(strategy_selection[0])} only")


def test_every_registered_strategy_is_in_the_suite():
    labels = {label.split(",")[0] for label, _ in zero_checks.strategies(4)}
    assert set(available_strategies()) <= labels
    assert {"stage0", "stage3", "hybrid", "hybrid_zero2"} <= labels


def _file_strategy(path, name, broken=False):
    """The tutorial strategy of docs/strategies.md saved at `path`, registered as `name`; with
    `broken`, its gradient allreduce is left out (each rank updates with its own gradients)."""
    code = example_code().replace('"zero1_allreduce"', f'"{name}"')
    if broken:
        code = code.replace("self.comm.allreduce(self.grads_full)", "pass")
    path.write_text(code)
    return path


def test_a_strategy_file_joins_the_suite_and_can_run_alone(tmp_path, isolated_registry):
    """--strategy-module FILE.py: the file's @register strategies are in the suite without a
    package; --strategy NAME: they alone; a name not available is one clear error."""
    path = _file_strategy(tmp_path / "mine_zero1.py", "zero1_mine")
    assert "zero1_mine" in {label for label, _ in zero_checks.strategies(2, [str(path)])}
    chosen = zero_checks.strategies(2, [str(path)], ["zero1_mine"])
    assert [label for label, _ in chosen] == ["zero1_mine"]
    assert [label for label, _ in zero_checks.strategies(4, (), ["hybrid"])] == [
        "hybrid,shard_group_size=1", "hybrid,shard_group_size=2", "hybrid,shard_group_size=4"]
    with pytest.raises(ValueError, match="no partition strategy 'nope'; available: "):
        list(zero_checks.strategies(2, (), ["nope"]))


@pytest.mark.mpi
@pytest.mark.parametrize("broken", [False, True], ids=["sound", "broken"])
def test_make_test_strategy_runs_the_suite_on_a_strategy_file(tmp_path, broken, whole_suite):
    """What `make test-strategy STRATEGY=zero1_mine STRATEGY_MODULE=FILE.py` runs: the shared
    suite on that file's strategy alone (here at 2 ranks). It passes for the tutorial's
    strategy and fails on parity for the same strategy without its gradient allreduce."""
    path = _file_strategy(tmp_path / "mine_zero1.py", "zero1_mine", broken)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", "n2 and (parity or declared)", "--strategy", "zero1_mine", "--strategy-module",
         str(path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    if broken:
        assert done.returncode == 1, done.stdout[-3000:]
        assert "zero1_mine fp64 n=2: relative error" in done.stdout, done.stdout[-3000:]
    else:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert "3 passed" in done.stdout, done.stdout[-3000:]


def test_buckets_group_small_units_and_send_large_ones_alone():
    """Consecutive units share a bucket up to the limit; a unit over the limit, or of
    `solo_numel` elements or more, is a bucket of its own (sent in place, never packed)."""
    sizes = [10, 20, 30, 1000, 5, 5, 40, 40, 2000, 7]
    strategy = Strategy.__new__(Strategy)
    strategy.layout = ModelLayout([UnitLayout.build({"w": (n,)}, 1) for n in sizes])
    strategy.solo_numel = 1000
    assert strategy.buckets(50) == [range(0, 2), range(2, 3), range(3, 4), range(4, 7),
                                    range(7, 8), range(8, 9), range(9, 10)]
    assert strategy.buckets(10**9) == [range(0, 3), range(3, 4), range(4, 8), range(8, 9),
                                       range(9, 10)]
    assert strategy.buckets(1) == [range(u, u + 1) for u in range(len(sizes))]
    strategy._reduce_buckets, strategy.config = None, SimpleNamespace(reduce_bucket_size=50)
    assert [strategy.reduce_bucket_from(u) for u in (0, 1, 4, 9)] == [
        range(0, 2), None, range(4, 7), range(9, 10)]


@pytest.fixture(scope="module")
def references():
    """(initial params, trained params, losses) of the reference for each variant."""
    out = {}
    for variant, (_, accumulation, clip, _) in zero_checks.VARIANTS.items():
        source = SyntheticSource(zero_checks.GPT_CONFIG.vocab_size, zero_checks.GPT_CONFIG.seq_len,
                                 zero_checks.GLOBAL_BATCH * accumulation, seed=1)
        batches = [source.global_sample(step) for step in range(zero_checks.STEPS)]
        dtype = np.float64 if variant.startswith("fp64") else np.float32
        model = GPT(zero_checks.GPT_CONFIG, seed=0, dtype=dtype)
        init = {n: p.data.copy() for n, p in model.named_parameters()}
        params, losses = reference_train(model, batches, lr=1e-2, weight_decay=0.1, clip=clip)
        out[variant] = (init, params, losses)
    return out


def _parity_errors(params, init, ref):
    """Per tensor: max|p - ref| / max|ref| and max|p - ref| / max|ref - init| (worst tensor);
    whole model: ||p - ref|| / ||ref - init||."""
    rel = tensor_move = 0.0
    err2 = move2 = 0.0
    for name, want in ref.items():
        diff = (params[name] - want).astype(np.float64)
        move = (want - init[name]).astype(np.float64)
        rel = max(rel, np.abs(diff).max() / np.abs(want).max())
        tensor_move = max(tensor_move, np.abs(diff).max() / np.abs(move).max())
        err2, move2 = err2 + (diff * diff).sum(), move2 + (move * move).sum()
    return rel, tensor_move, float(np.sqrt(err2 / move2))


@pytest.mark.mpi
def test_parity_with_single_process_reference(run, references, strategy_selection):
    n, out, reports = run
    assert {c["strategy"].split(",")[0] for c in reports[0]["parity"]} >= (
        set(strategy_selection[0]) or {"zero1_allreduce"})
    for i, case in enumerate(reports[0]["parity"]):
        variant = case["variant"]
        dtype = zero_checks.VARIANTS[variant][0]
        init, ref, ref_losses = references[variant]
        with np.load(out / f"{case['strategy']}__{variant}.npz") as f:
            params = dict(f)
        assert sorted(params) == sorted(ref)
        rel, tensor_move, model_move = _parity_errors(params, init, ref)
        where = f"{case['strategy']} {variant} n={n}"
        quantized = "zero_quantized" in case["strategy"]
        if quantized:
            assert model_move <= QUANTIZED_MODEL_MOVE_RTOL, f"{where}: {model_move:.2e}"
        elif dtype == "fp64":
            assert rel <= FP64_RTOL, f"{where}: relative error {rel:.2e}"
        else:
            assert model_move <= MODEL_MOVE_RTOL[dtype], f"{where}: {model_move:.2e} of the move"
        if dtype == "fp32" and not quantized:
            assert tensor_move <= FP32_TENSOR_MOVE_RTOL, f"{where}: {tensor_move:.2e} of a move"
        np.testing.assert_allclose(case["losses"], ref_losses, err_msg=where,
                                   rtol=QUANTIZED_LOSS_RTOL if quantized else LOSS_RTOL[dtype])
        # Collectives in flight while a rank computes move between units: without a progress
        # thread (here: 2 cores, >= 2 ranks) the engine probes MPI there.
        for r in reports:
            pokes, thread = r["parity"][i]["pokes"], r["parity"][i]["progress_thread"]
            if thread:
                assert pokes == 0, where
            elif variant == "fp64_overlap" and n > 1 and case["strategy"].startswith("stage"):
                assert pokes > 0, where
        # Every rank agrees: on the gathered model, and on the resident copy (stages 0-2).
        for key in ("gathered", "resident", "losses"):
            values = {str(r["parity"][i][key]) for r in reports}
            assert len(values) == 1, f"{where}: ranks differ in {key}"


def _sent(counters) -> int:
    return sum(counters[op]["sent"] for op in ARRAY_OPS)


def _paper_formula(label, n):
    """(ZeRO stage, ranks it shards over) whose SC'20 memory formula a case must meet, or None:
    stage s over N ranks; hybrid sharding is ZeRO-3 (hybrid_zero2: ZeRO-2) over its G ranks."""
    name, *options = label.split(",")
    if name.startswith("stage"):
        return None if options else (int(name[-1]), n)  # e.g. persistent units hold more
    if name not in ("hybrid", "hybrid_zero2"):
        return None  # e.g. zeropp: stage 3's, and hpZ's secondary shard
    group = int(options[0].split("=")[1]) if options else 0
    return {"hybrid": (3, group), "hybrid_zero2": (2, group)}[name]


@pytest.mark.mpi
def test_model_state_memory_matches_declared_and_paper_formula(run):
    """fp16 params and grads (2 + 2 bytes), fp32 master + Adam m, v (K = 12): the ledger's
    bytes per category and device after a step equal what the strategy declares, and for the
    ZeRO stages and hybrid sharding the SC'20 Fig. 1 formula (Psi = padded size)."""
    n, _, reports = run
    for r in reports:
        for case in r["memory_traffic"]:
            where = (case["model"], case["strategy"], n)
            assert case["held"] == case["declared_memory"], where
            psi, formula = case["full_numel"], _paper_formula(case["strategy"], n)
            if formula is not None:
                stage, ranks = formula
                want = model_state_bytes(psi, ranks, stage, 2, 2, 12)
                assert case["model_state_bytes"] == want, where
            assert psi - case["num_params"] < n * len(case["unit_padded"])  # padding bound


@pytest.mark.mpi
def test_traffic_matches_declared_and_paper_formula(run):
    """Bytes each rank sends in one step (ring model, counted by Comm per communicator) equal
    what the strategy declares. For the stages: 2 Psi (N-1)/N for stages 0-2, 3 Psi (N-1)/N
    for stage 3, in fp16 elements (2 bytes); tied weights (GPT's LM head reads the embedding)
    are gathered twice more in stage 3, once per pass. Hybrid sharding's replica groups carry
    one allreduce of the shard, 2 (Psi/G)(R-1)/R."""
    n, _, reports = run
    for r in reports:
        for case in r["memory_traffic"]:
            c, psi, label = case["counters"], case["full_numel"], case["strategy"]
            where = (case["model"], label, n)
            sent = {kind: _sent(counters) for kind, counters in c.items()}
            assert sent == case["declared_traffic"], (where, sent)
            if label.startswith("stage") and "," not in label:
                stage = int(label[-1])
                passes = 3 if stage == 3 else 2
                tied = sum(case["unit_padded"][w] for shared in case["shared"] for w in shared)
                want = (passes * psi + (2 * tied if stage == 3 else 0)) * 2 * (n - 1) // n
                assert sent["world"] == want, (where, sent, want)
                if case["model"] == "mlp":  # no tied weights: exactly the paper's figure
                    assert sent["world"] == passes * psi * 2 * (n - 1) // n
                if stage in (1, 2) and n > 1:  # allgather_bucket_size 5e8: one bucket
                    assert c["world"]["allgather"]["calls"] == 1, where
                kinds = {k for k in ("allreduce", "reduce_scatter", "allgather")
                         if c["world"][k]["calls"]}
                assert kinds == ({"allreduce"} if stage == 0 else
                                 {"reduce_scatter", "allgather"}) or n == 1
            if label.startswith("stage1,") and n > 1 and case["model"] == "gpt":  # 5000-buckets
                calls = c["world"]["allgather"]["calls"]
                assert 1 < calls < len(case["unit_padded"]), (where, calls)
            if label.startswith("hybrid"):
                g = int(label.rsplit("=", 1)[1])
                want = 2 * (psi // g) * 2 * (n // g - 1) // (n // g)
                assert sent["replica"] == want, (where, sent)
                assert {k for k in c["replica"] if c["replica"][k]["calls"]} <= {"allreduce"}


@pytest.mark.mpi
def test_persistence_threshold_trades_memory_for_traffic(run, whole_suite):
    """Stage 3 with stage3_param_persistence_threshold=500: the units of at most 500 elements
    (GPT's embedding unit and final LayerNorm/head unit) stay gathered. Each costs its full
    fp16 parameters in memory and saves all but one of its allgathers per step."""
    n, _, reports = run
    for r in reports:
        cases = {(c["model"], c["strategy"].split(",")[0], "," in c["strategy"]): c
                 for c in r["memory_traffic"]}
        for model in ("gpt", "mlp"):
            plain, persistent = cases[(model, "stage3", False)], cases[(model, "stage3", True)]
            units = [u for u, numel in enumerate(plain["unit_numel"]) if numel <= 500]
            assert units or model == "mlp"
            reads = [1 + sum(w == u for shared in plain["shared"] for w in shared)
                     for u in range(len(plain["unit_padded"]))]
            padded = plain["unit_padded"]
            extra = sum(padded[u] for u in units) * 2
            assert persistent["model_state_bytes"] - plain["model_state_bytes"] == extra, model
            saved = sum((2 * reads[u] - 1) * padded[u] for u in units) * 2 * (n - 1) // n
            assert (_sent(plain["counters"]["world"]) - _sent(persistent["counters"]["world"])
                    == saved), model


@pytest.mark.mpi
def test_pluggable_losses_equal_the_single_process_reference(run, whole_suite):
    """An MLP regressor with MSE at stage 3, and GPT with cross-entropy ignoring -100 targets
    at stage 2 with accumulation (a different number of counted tokens on every rank and
    micro-batch): the loss is the mean over all ranks' counted targets, as one process on the
    whole batch computes it, not a mean of per-rank means."""
    from zmpi.models.mlp import MLPModel
    from zmpi.nn import CrossEntropyLoss, MSELoss

    n, out, reports = run
    for name, (_, accumulation) in zero_checks.LOSS_CASES.items():
        if name.startswith("mse"):
            model = MLPModel((16, 32, 2), dtype=np.float64, loss=MSELoss())
            batches = [zero_checks.regression_batch(s) for s in range(zero_checks.STEPS)]
        else:
            model = GPT(zero_checks.GPT_CONFIG, seed=0, dtype=np.float64)
            model.loss_fn = CrossEntropyLoss(ignore_index=-100)
            source = SyntheticSource(zero_checks.GPT_CONFIG.vocab_size,
                                     zero_checks.GPT_CONFIG.seq_len,
                                     zero_checks.GLOBAL_BATCH * accumulation, seed=1)
            batches = []
            for step in range(zero_checks.STEPS):
                x, y = source.global_sample(step)
                batches.append((x, zero_checks.ignore_targets(y, 0)))
        init = {k: p.data.copy() for k, p in model.named_parameters()}
        ref, ref_losses = reference_train(model, batches, lr=1e-2, weight_decay=0.1)
        with np.load(out / f"loss_{name}.npz") as f:
            rel, _, _ = _parity_errors(dict(f), init, ref)
        assert rel <= FP64_RTOL, f"{name} n={n}: relative error {rel:.2e}"
        for r in reports:
            np.testing.assert_allclose(r["losses"][name], ref_losses, rtol=1e-10, err_msg=name)


@pytest.mark.mpi
def test_loss_scaler_trajectory(run, whole_suite):
    """scale 2^8, window 2, hysteresis 1: grow after 2 clean steps, halve on the planted
    overflow (step 2, one rank only), which every rank skips without touching parameters."""
    _, _, reports = run
    for r in reports:
        for case in r["loss_scaler"]:
            assert case["scales"] == [256, 512, 256, 256, 512, 512], case
            assert case["skipped"] == 1 and case["global_steps"] == 5
            assert case["skipped_change"] == 0.0


def moe_reference(section, accumulation, clip, n_steps=zero_checks.STEPS,
                  delay_after=None):
    """One process's (parameters, losses, routing) for a MoE case of zero_checks: the whole
    global batch of each of `n_steps` steps in one forward, each MoE layer keyed by the step
    and its groups from 0, the auxiliary and z losses added to the loss as the engine reports
    it; delay_after: reference_train's (the delayed update, DPU). Also
    tests/test_moe_engine_rest.py's reference."""
    config = zero_checks.GPT_CONFIG
    source = SyntheticSource(config.vocab_size, config.seq_len,
                             zero_checks.GLOBAL_BATCH * accumulation, seed=1)
    model = GPT(config, seed=0, dtype=np.float64, moe=section)
    layers, loss, routing, steps = model.moe_layers(), model.loss, {}, iter(range(10**9))

    def moe_loss(x, y):
        step = next(steps)
        for layer in layers:
            layer.set_routing((step,), 0)
        value = loss(x, y)
        for i, layer in enumerate(layers):
            routing[f"route{step}_{i}_experts"] = layer.routing.experts.copy()
            routing[f"route{step}_{i}_kept"] = layer.routing.kept.copy()
        return value + sum(float(layer.aux_loss + layer.z_loss) for layer in layers)

    model.loss = moe_loss
    batches = [source.global_sample(step) for step in range(n_steps)]
    params, losses = reference_train(model, batches, lr=1e-2, weight_decay=0.1, clip=clip,
                                     delay_after=delay_after)
    return params, losses, routing


@pytest.fixture(scope="module")
def moe_references():
    """{case: (parameters, losses, routing)} of one process for each of zero_checks.MOE_CASES."""
    return {name: moe_reference(section, accumulation, clip)
            for name, (_, accumulation, clip, _, section) in zero_checks.MOE_CASES.items()}


@pytest.mark.mpi
def test_moe_gpt_trains_as_one_process(run, moe_references, whole_suite):
    """A GPT with MoE blocks (zero_checks.MOE_CASES: top-1 and top-2, a pyramid of 4 and 2
    experts, every other block, PR-MoE with a shared expert, Jitter and RSample, random token
    selection, drops, accumulation, clipping, full recompute) under ZeRO 0-3 at every world
    size (3: uneven shards) in fp64, expert parallel at the largest ep the experts allow
    ((dp, ep) = (2, 2), (3, 1), (3, 3), (4, 2), (4, 4)): the parameters and losses of one
    process, and every step's choices and dropped tokens exactly one process's. At ep > 1
    the ledger holds what the engine's and the experts' strategies declare, stage 3 holds
    (2 + 2 + K) Psi_experts / ep / (dp / ep) of expert states (fp64: 8 + 8 + 3 x 8 bytes an
    element), and the all-to-alls count in the "ep" dimension. A checkpoint saved at ep > 1
    after step 2 resumes at every other ep the experts allow (and from there back at the
    saving ep: (2 -> 1 -> 2), (4 -> 1 -> 4), (4 -> 2 -> 4), (3 -> 1 -> 3)) and on half the ranks
    (dp 1 or 2, ep 1 or 2), and each continues the loss as the uninterrupted run did; in fp32
    at the saving ep (the parameters, the experts' too, the master weights cast) its next loss
    is the fp64 run's within 1e-6 (one fp32 step: ~3e-8; stale expert parameters: 7e-6 and
    more)."""
    n, out, reports = run
    eps = {name: reports[0]["moe"][name]["ep"] for name in moe_references}
    assert eps == {name: zero_checks.moe_ep(section, n) for name, (*_, section)
                   in zero_checks.MOE_CASES.items()}
    for name, (ref, ref_losses, ref_routing) in moe_references.items():
        with np.load(out / f"moe_{name}.npz") as f:
            got = dict(f)
        where = f"MoE {name} n={n}"
        routing = {k: got.pop(k) for k in list(got) if k.startswith("route")}
        assert sorted(routing) == sorted(ref_routing), where
        assert any(not kept.all() for k, kept in ref_routing.items() if k.endswith("kept"))
        for key, want in ref_routing.items():
            np.testing.assert_array_equal(routing[key], want, err_msg=f"{where}: {key}")
        assert sorted(got) == sorted(ref), where
        rel = max(np.abs(got[k] - ref[k]).max() / np.abs(ref[k]).max() for k in ref)
        assert rel <= FP64_RTOL, f"{where}: relative error {rel:.2e}"
        for r in reports:
            got = r["moe"][name]
            np.testing.assert_allclose(got["losses"], ref_losses, rtol=LOSS_RTOL["fp64"],
                                       err_msg=where)
            if got["ep"] == 1:
                continue
            declared = sum(b for strategy in got["declared"] for held in strategy.values()
                           for b in held.values())
            assert got["held"] == declared, f"{where} ep={got['ep']}"
            experts, stage = got["experts"], zero_checks.MOE_CASES[name][0]
            assert experts["edp"] == n // got["ep"], where
            if stage == 3:  # Psi_experts / ep, padded to edp shards, / edp per rank
                assert sum(got["declared"][1]["device"].values()) == \
                    (8 + 8 + 3 * 8) * experts["full_numel"] // experts["edp"], where
                assert experts["full_numel"] - experts["num_params"] < experts["edp"] * 2
            assert "alltoall" in got["dims"]["ep"] and "alltoall" not in got["dims"]["dp"]
            assert "the first in backward order is in the expert parameters" in got["nan"]
            assert [m.split(":")[0] for m in got["refused"]] == [
                "the model's MoE layers are expert parallel already"], where
            resumed = _moe_resumes_expected(name, n, got["ep"])
            assert sorted(got["resumed"]) == resumed, where
            for layout, losses in got["resumed"].items():  # None: a rank outside the half
                if losses is not None:
                    at = zero_checks.RESUME_AT
                    np.testing.assert_allclose(
                        losses, ref_losses[at : at + len(losses)],
                        rtol=1e-6 if layout.startswith("fp32") else LOSS_RTOL["fp64"],
                        err_msg=f"{where} resumed at {layout}")


@pytest.mark.mpi
def test_moe_estimate_is_the_ledger_at_ep(run, whole_suite):
    """`zmpi estimate --moe` at the layouts the MoE cases ran at ep > 1 ((dp, ep) = (2, 2),
    (3, 3), (4, 2), (4, 4); fp64: --param-bytes 8 --optimizer-bytes 24) against each rank's
    ledger after training: the expert states are the formula of Psi_experts / ep over the
    dp / ep ranks holding the same experts exactly, at the padded count the expert strategy
    holds (zmpi.memory.expert_groups), and the whole estimate is what the ledger holds up to
    the flat buffers' padding (40 bytes an element: under dp elements per unit)."""
    from zmpi.config import MoEConfig
    from zmpi.memory import expert_groups

    n, _, reports = run
    config = zero_checks.GPT_CONFIG
    for name, (stage, *_, section) in zero_checks.MOE_CASES.items():
        ep = reports[0]["moe"][name]["ep"]
        if ep == 1:
            continue
        out = subprocess.run(
            [sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", str(config.n_layer),
             "--d-model", str(config.d_model), "--vocab-size", str(config.vocab_size),
             "--seq-len", str(config.seq_len), "--world-size", str(n), "--stage", str(stage),
             "--param-bytes", "8", "--optimizer-bytes", "24", "--json",
             "--moe", json.dumps({**section, "ep_size": ep})],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        estimate = json.loads(out.stdout)
        estimated = estimate["stages"][0]["device_gb"] * 1e9
        units = config.n_layer + 2 + len(MoEConfig.from_dict(section).layer_experts(
            config.n_layer))  # the dense units and the expert strategy's
        for r in reports:
            got, where = r["moe"][name], f"MoE {name} n={n} ep={ep}"
            experts = got["experts"]
            [(per_rank, edp)] = expert_groups(experts["full_numel"] * ep, n, ep)
            assert sum(got["declared"][1]["device"].values()) == \
                model_state_bytes(per_rank, edp, stage, 8, 8, 24), where
            assert estimate["expert_params"] == experts["num_params"] * ep, where
            assert 0 <= got["held"] - estimated < 40 * n * units, (where, got["held"], estimated)


def _moe_resumes_expected(name, n, ep):
    """The layouts zero_checks.moe_resumes resumes a MoE case's checkpoint saved at ep on n
    ranks at: every other ep that divides n and the experts (there and back), and half the
    ranks at n even."""
    section = zero_checks.MOE_CASES[name][-1]
    others = [f"ep {e}>{ep}" for e in range(1, n + 1)
              if zero_checks.moe_ep(section, e) == e != ep and n % e == 0]
    half = [f"dp {n // 2} ep {zero_checks.moe_ep(section, n // 2)}"] if n % 2 == 0 else []
    return sorted(others + half + [f"fp32 ep {ep}"])


@pytest.fixture(scope="module")
def llama_references():
    """{case: (parameters, losses)} of one process for each of zero_checks.LLAMA_CASES (the
    whole global batch of each micro-step in one forward)."""
    from zmpi.comm import MPI, Comm
    from zmpi.engine import Engine
    from zmpi.models.llama import Llama

    refs = {}
    for name, (stage, accumulation, clip, offload) in zero_checks.LLAMA_CASES.items():
        cfg = zero_checks.config(stage, "fp64", accumulation, clip, n=1)
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine = Engine(Llama(zero_checks.LLAMA_CONFIG, seed=0, dtype=np.float64), cfg,
                        Comm(MPI.COMM_SELF))
        data = zero_checks.gpt_data(Comm(MPI.COMM_SELF), accumulation)
        losses = [engine.train_step(*data.sample(step)) for step in range(zero_checks.STEPS)]
        refs[name] = engine.gather_parameters(), losses
        engine.close()
    return refs


@pytest.mark.mpi
def test_llama_trains_as_one_process(run, llama_references, whole_suite):
    """A Llama (grouped-query attention, SwiGLU, untied head: zero_checks.LLAMA_CONFIG) under
    ZeRO 0-3 and stage 2 with optimizer offload, with accumulation and clipping, at every
    world size (3: uneven shards) in fp64: the parameters and losses of one process."""
    n, out, reports = run
    for name, (ref, ref_losses) in llama_references.items():
        with np.load(out / f"llama_{name}.npz") as f:
            got = dict(f)
        where = f"Llama {name} n={n}"
        assert sorted(got) == sorted(ref), where
        rel = max(np.abs(got[k] - ref[k]).max() / np.abs(ref[k]).max() for k in ref)
        assert rel <= FP64_RTOL, f"{where}: relative error {rel:.2e}"
        for r in reports:
            np.testing.assert_allclose(r["llama"][name], ref_losses, rtol=LOSS_RTOL["fp64"],
                                       err_msg=where)

"""ZeRO-Offload: offload changes where model states live, never what training computes.

One `mpiexec -n N` launch per world size (1-4) runs tests/ranks/offload_checks.py. Checked:
- the ranks run the compiled host loops (Numba's Adam and casts) where numba is installed;
- optimizer offload (stages 1-3) and parameter offload (stage 3), fp32 and fp16 (with an
  overflow step), gradient accumulation and clipping: parameters, master weights, Adam moments
  and losses equal the run without offload bit for bit (NumPy backend);
- the ledger's bytes per category on the device and on the host equal
  `zmpi.memory.model_state_placement` exactly;
- the delayed parameter update (DPU) equals a single-process reference that applies each
  update one step late after the warm-up (fp64: to rounding), and its update lands on
  `gather_parameters`.
Single-process checks of the DPU thread (errors, joins) are at the end.
"""
import sys

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi
from reference import reference_train

from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import model_state_placement
from zmpi.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(RANKS_DIR))
import offload_checks  # noqa: E402
import zero_checks  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"offload_n{request.param}")
    # the compiled host loops (Adam, float16 casts), as in a real run (tests/conftest.py)
    reports = run_mpi(RANKS_DIR / "offload_checks.py", request.param, args=[out], timeout=300,
                      env={"ZMPI_NUMBA": "1"})
    return request.param, out, reports


@pytest.mark.mpi
def test_the_ranks_ran_the_compiled_host_loops(run):
    pytest.importorskip("numba")
    assert all(r["compiled_loops"] for r in run[2])


def test_offload_is_bit_identical_to_no_offload(run):
    n, _, reports = run
    for r in reports:
        base = {(e["stage"], e["dtype"]): e for e in r["equality"] if e["variant"] == "none"}
        checked = 0
        for e in r["equality"]:
            want = base[(e["stage"], e["dtype"])]
            where = f"n={n} rank {r['rank']} stage {e['stage']} {e['dtype']} {e['variant']}"
            for key in ("params", "optimizer_state", "losses", "skipped"):
                assert e[key] == want[key], f"{where}: {key} differs from no offload"
            assert e["skipped"] == (1 if e["dtype"] == "fp16" else 0), where
            checked += e["variant"] != "none"
        assert checked == 2 * (3 + 2)  # fp32, fp16 x (optimizer: 3 stages; stage 3: 2 more)


def _placement(e, n, itemsize, master_itemsize, delay_update=False):
    variant = e.get("variant", "optimizer+param" if e["stage"] == 3 else "optimizer")
    return model_state_placement(
        e["full_numel"], n, e["stage"], itemsize, itemsize, master_itemsize, master_itemsize,
        offload_optimizer="optimizer" in variant, offload_param="param" in variant,
        delay_update=delay_update)


@pytest.mark.mpi
def test_ledger_equals_placement_formula(run):
    n, _, reports = run
    for r in reports:
        for e in r["equality"]:
            itemsize = 4 if e["dtype"] == "fp32" else 2
            assert e["memory"] == _placement(e, n, itemsize, 4), (n, e["variant"], e["stage"])
        for e in r["dpu"]:  # fp64, and a second host gradient shard
            assert e["memory"] == _placement(e, n, 8, 8, delay_update=True), (n, e["stage"])


@pytest.mark.mpi
def test_delayed_update_matches_one_step_late_reference(run):
    n, out, reports = run
    cfg = zero_checks.GPT_CONFIG
    source = SyntheticSource(cfg.vocab_size, cfg.seq_len, zero_checks.GLOBAL_BATCH * 2, seed=1)
    batches = [source.global_sample(step) for step in range(offload_checks.DPU_STEPS)]
    ref, ref_losses = reference_train(GPT(cfg, seed=0, dtype=np.float64), batches, lr=1e-2,
                                      weight_decay=0.1, clip=0.05,
                                      delay_after=offload_checks.DPU_WARMUP)
    plain, _ = reference_train(GPT(cfg, seed=0, dtype=np.float64), batches, lr=1e-2,
                               weight_decay=0.1, clip=0.05)
    for e in reports[0]["dpu"]:
        where = f"n={n} stage {e['stage']}"
        with np.load(out / f"dpu_stage{e['stage']}.npz") as f:
            params = dict(f)
        for name, want in ref.items():
            np.testing.assert_allclose(params[name], want, rtol=1e-9, atol=1e-12,
                                       err_msg=f"{where}: {name}")
        assert max(np.abs(ref[k] - plain[k]).max() for k in ref) > 1e-4  # the delay matters
        np.testing.assert_allclose(e["losses"], ref_losses, rtol=1e-12, err_msg=where)
        assert e["in_flight"] and e["landed"], where
        assert e["delayed_steps"] == offload_checks.DPU_STEPS - offload_checks.DPU_WARMUP


# ---- the DPU thread, in one process -------------------------------------------------------

SMALL = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8)


def _dpu_engine(stage=2, warmup=0):
    return Engine(GPT(SMALL, seed=0), {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": stage, "offload_optimizer": {
            "device": "cpu", "delay_update": True, "delay_update_warmup": warmup}}})


def _batch(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, 16, (4, 8)), rng.integers(0, 16, (4, 8))


def test_error_in_background_update_reaches_the_next_step():
    engine = _dpu_engine()
    engine.train_step(*_batch(0))

    def broken(*args, **kwargs):
        raise MemoryError("host ran out of memory")

    engine.optimizer.step_ = broken
    engine.train_step(*_batch(1))  # the update fails in the background: not lost...
    with pytest.raises(RuntimeError, match="delayed optimizer step 1 failed") as info:
        engine.train_step(*_batch(2))  # ...it is raised here
    assert isinstance(info.value.__cause__, MemoryError)
    assert engine.delayed.thread is None  # nothing left running: no hang at shutdown


def test_flush_points_land_the_update():
    engine = _dpu_engine(stage=1, warmup=1)
    engine.train_step(*_batch(0))
    assert engine.delayed.thread is None  # warm-up step: synchronous
    engine.train_step(*_batch(1))
    thread = engine.delayed.thread
    engine.eval_loss(*_batch(9))  # evaluation sees the latest parameters
    assert engine.delayed.thread is None and not thread.is_alive()
    before = engine.gather_parameters()
    engine.train_step(*_batch(2))
    engine.close()
    after = engine.gather_parameters()
    assert engine.delayed.thread is None
    assert any(np.abs(after[k] - before[k]).max() > 0 for k in before)
    assert engine.update_timing["delayed_steps"] == 2

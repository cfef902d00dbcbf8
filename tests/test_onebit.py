"""1-bit Adam (docs/onebit.md): the compressed allreduce and the optimizer against a NumPy
reference of the algorithm (tests/ranks/onebit_reference.py: one process simulating N ranks),
the engine's wiring, traffic and memory, fp16 overflow, checkpoints, and the config.

One `mpiexec -n N` launch per world size (2, 3 and 4; at 3 ranks the chunks split unevenly
and the padding differs) runs tests/ranks/onebit_checks.py; one more at 2 ranks on the CuPy
stand-in. Checked there:
- the compressed allreduce equals the reference bit for bit (result, worker and server
  errors), call after call; each call sends (N - 1)(c / 4 + 2 s) bytes, c = n / N, n the
  length padded to a multiple of 8 N, s the scales' itemsize; the errors are in the ledger;
- OneBitAdam equals the reference bit for bit across freeze_step (float32, chunked, with
  elements that never get a gradient and elements whose gradient stays below eps);
- the engine (fp64 GPT, gradient accumulation, clipping) equals the reference fed with every
  rank's own gradient from a single-process model, to 1e-9 of the parameters' movement; the
  warm-up sends one allreduce of the gradients, every later step the compressed allreduce
  alone (no allreduce), and 1/16 of an fp16 allreduce plus the scales;
- an fp16 overflow after the warm-up skips the step on every rank before the momentum moves;
- a checkpoint load resets the errors and nothing else.
"""
import sys
import warnings

import numpy as np
import pytest
from mpi_util import RANKS_DIR, REPO_ROOT, STANDIN, run_mpi

from zmpi import backend
from zmpi.config import Config, ConfigError

sys.path.insert(0, str(RANKS_DIR))
import onebit_reference  # noqa: E402


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"n{n}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"onebit_n{request.param}")
    return request.param, run_mpi(RANKS_DIR / "onebit_checks.py", request.param, args=[out],
                                  timeout=300)


def compressed_bytes(numel, n, itemsize):
    """What one compressed allreduce sends from a rank, from the formula of docs/onebit.md."""
    padded = -(-numel // (8 * n)) * 8 * n
    return 2 * (n - 1) * padded // (8 * n) + 2 * (n - 1) * itemsize, padded


def check_allreduce(n, reports):
    for r in reports:
        assert r["allreduce"], r
        for e in r["allreduce"]:
            where = (n, r["rank"], e["numel"], e["call"])
            assert e["result_equal"] and e["worker_error_equal"] and e["server_error_equal"], \
                (where, e["max_diff"])
            want, padded = compressed_bytes(e["numel"], n, 4)
            assert e["padded"] == padded, where
            assert e["sent"] == e["declared"] == want, where
            assert e["calls"] == {"alltoall": 1, "allgather": 3}, where
            assert e["comm_buffer"] == 4 * (padded + padded // n), where  # the two errors
            assert e.get("comm_buffer_after_reset", 0) == 0, where


def check_optimizer(n, reports):
    for r in reports:
        steps = r["optimizer"]
        assert [e["warm"] for e in steps] == [True] * 3 + [False] * 4
        for e in steps:
            assert e["param_equal"] and e["m_equal"] and e["v_equal"], (n, r["rank"], e)
            assert e["published_equal"] in (True, None), (n, r["rank"], e)


@pytest.mark.mpi
def test_compressed_allreduce_equals_the_reference(run):
    check_allreduce(*run)


@pytest.mark.mpi
def test_optimizer_equals_the_reference_across_freeze_step(run):
    check_optimizer(*run)


@pytest.mark.mpi
def test_engine_equals_the_reference(run):
    n, reports = run
    for r in reports:
        for e in r["engine"]["steps"]:
            assert e["rel_err"] <= 1e-9, (n, r["rank"], e)


@pytest.mark.mpi
def test_traffic_before_and_after_the_warm_up(run):
    n, reports = run
    for r in reports:
        full = r["engine"]["full_numel"]
        for e in r["engine"]["steps"]:  # fp64: 8-byte gradients, 8-byte scales
            warm = e["step"] <= 3
            want = 2 * (n - 1) * full * 8 // n if warm else compressed_bytes(full, n, 8)[0]
            assert e["sent"] == e["declared"] == want, (n, r["rank"], e)
            if warm:
                assert e["calls"].get("allreduce", 0) >= 1 and "alltoall" not in e["calls"]
            else:
                assert "allreduce" not in e["calls"], e  # no gradient allreduce any more
                assert e["calls"]["alltoall"] == 1 and e["calls"]["allgather"] == 3, e
            assert e["comm_buffer"] == (0 if warm else 8 * (r["engine"]["padded"] // n
                                                            + r["engine"]["padded"])), e
        # fp16: the warm-up sends the storage dtype's allreduce (strategy's declaration), the
        # compressed steps 1/16 of an fp16 allreduce of the padded length, plus the scales
        ov = r["overflow"]
        full, fp16 = ov["full_numel"], 2 * (n - 1) * ov["full_numel"] * 2 // n
        want, padded = compressed_bytes(full, n, 4)
        for e in ov["steps"]:
            if e["step"] < 2:
                assert e["sent"] == e["declared"] == ov["declared_warm"], e
            elif e["step"] != 3:  # step 3 is skipped (below)
                assert e["sent"] == e["declared"] == want, e
                bits = want - 2 * (n - 1) * 4
                assert bits * 16 * full == fp16 * padded, (bits, fp16)  # exactly 1/16


@pytest.mark.mpi
def test_fp16_overflow_after_the_warm_up_skips_on_every_rank(run):
    n, reports = run
    for r in reports:
        s = r["overflow"]["steps"]
        assert [e["step_count"] for e in s] == [1, 2, 3, 3, 4, 5], (n, r["rank"])
        assert [e["skipped"] for e in s] == [0, 0, 0, 1, 1, 1], (n, r["rank"])
        assert s[3]["state"] == s[2]["state"] and s[3]["errors"] == s[2]["errors"], \
            (n, r["rank"], "the skipped step moved the optimizer")
        assert s[3]["sent"] == 0, "a skipped step sends nothing"
        assert s[4]["state"] != s[3]["state"] and s[4]["errors"] != s[3]["errors"]
        assert [e["state"] for e in s] == [e["state"] for e in reports[0]["overflow"]["steps"]]


@pytest.mark.mpi
def test_checkpoint_load_resets_the_errors(run):
    n, reports = run
    for r in reports:
        c = r["checkpoint"]
        assert c["errors_after_load"] is None and c["step_count_loaded"] == 6, c
        assert c["loaded_equals_reset"], (n, r["rank"])
        assert not c["loaded_equals_uninterrupted"], "the errors should have mattered"


@pytest.mark.mpi
def test_on_the_cupy_standin(tmp_path):
    """The compressed allreduce and the optimizer on device arrays (staged through the host),
    bit for bit the NumPy reference."""
    reports = run_mpi(RANKS_DIR / "onebit_checks.py", 2, args=[tmp_path], timeout=300,
                      env=STANDIN)
    assert reports[0]["backend"] == "cupy" and "engine" not in reports[0]
    check_allreduce(2, reports)
    check_optimizer(2, reports)


# ---- one process


def test_reference_error_feedback_keeps_the_running_sum():
    """What error feedback guarantees (and the reference must keep): over T calls the outputs
    sum to the true means' sum less what the errors hold at the end, sum out_t = sum mean_t -
    mean_i worker_error_i - server_error (float64, exact up to rounding)."""
    n_ranks, numel, rng = 3, 50, np.random.default_rng(0)
    avg = onebit_reference.CompressedAverage(n_ranks, numel, np.float64)
    got, want = np.zeros(numel), np.zeros(numel)
    for _ in range(20):
        buffers = [rng.standard_normal(numel) for _ in range(n_ranks)]
        got += avg(buffers)
        want += sum(buffers) / n_ranks
    held = sum(avg.worker_error) / n_ranks + np.concatenate(avg.server_error)
    np.testing.assert_allclose(got, want - held[:numel], rtol=0, atol=1e-12)
    assert np.abs(got - want).max() > 1e-3  # the compression is lossy step by step


def test_one_rank_is_adam_with_a_frozen_second_moment():
    """At one rank nothing is sent (DeepSpeed skips the compression too): the engine equals
    the reference with N = 1, every step."""
    import onebit_checks

    from zmpi.comm import Comm

    result = onebit_checks.engine(Comm())
    for e in result["steps"]:
        assert e["rel_err"] <= 1e-9 and e["sent"] == 0, e


def test_deepspeed_onebit_config_loads():
    """DeepSpeed's 1-bit Adam tutorial config for BERT-large, comm_backend_name "mpi" (and its
    cuda_aware from the tutorial's first example)."""
    c = Config.from_dict({
        "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 100,
        "prescale_gradients": False,
        "optimizer": {"type": "OneBitAdam", "params": {
            "lr": 4e-4, "weight_decay": 0.01, "bias_correction": False, "freeze_step": 23000,
            "cuda_aware": False, "comm_backend_name": "mpi"}},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}})
    opt = c.optimizer
    assert (opt.type, opt.freeze_step, opt.cuda_aware, opt.comm_backend_name) == \
        ("OneBitAdam", 23000, False, "mpi")
    assert Config.from_dict(c.to_dict()) == c
    for t in ("onebitadam", "OneBitAdam", "ONEBITADAM"):
        assert Config.from_dict({"optimizer": {"type": t}}).optimizer.freeze_step == 100000
    assert "freeze_step" not in Config().to_dict()["optimizer"]["params"]


def _params(**kw):
    return {"optimizer": {"type": "OneBitAdam", "params": kw}}


@pytest.mark.parametrize("d, key, match", [
    (_params(comm_backend_name="nccl"), "optimizer.params.comm_backend_name", "only 'mpi'"),
    (_params(bias_correction=True), "optimizer.params.bias_correction", "no bias correction"),
    (_params(amsgrad=True), "optimizer.params.amsgrad", "AMSGrad"),
    (_params(eps_inside_sqrt=True), "optimizer.params.eps_inside_sqrt", "outside"),
    (_params(max_grad_norm=1.0), "optimizer.params.max_grad_norm", "gradient_clipping"),
    (_params(freeze_step=0), "optimizer.params.freeze_step", ">= 1"),
    (_params(freeze_step=10.0), "optimizer.params.freeze_step", "expected int"),
    (_params(adam_w_mode=False), "optimizer.params.adam_w_mode", "decoupled"),
    (_params(cuda_aware="yes"), "optimizer.params.cuda_aware", "expected bool"),
    ({"optimizer": {"type": "AdamW", "params": {"freeze_step": 5}}},
     "optimizer.params.freeze_step", "key of OneBitAdam"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
     "optimizer.params.bias_correction", "key of OneBitAdam"),
    ({**_params(), "zero_optimization": {"stage": 1}}, "zero_optimization.stage", "stage 0"),
    ({**_params(), "zero_optimization": {"stage": 3}}, "zero_optimization.stage", "stage 0"),
    ({**_params(), "zero_optimization": {"strategy": "hybrid"}}, "zero_optimization.strategy",
     "stage 0"),
    ({**_params(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.stage", "stage 0"),
    ({**_params(), "zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer.device", "no offload"),
    ({**_params(), "tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size",
     "data parallelism"),
    ({**_params(), "pipeline": {"stages": 2}}, "pipeline.stages", "data parallelism"),
])
def test_config_errors_name_the_key(d, key, match):
    with pytest.raises(ConfigError, match=match) as e:
        Config.from_dict(d)
    assert e.value.key == key


class _Comm:
    rank, cuda_aware_source = 0, "ZMPI_CUDA_AWARE"

    def __init__(self, aware):
        self.is_cuda_aware = aware


def test_cuda_aware_must_agree_with_what_comm_found(monkeypatch):
    from zmpi.engine.optimizer import check_cuda_aware

    monkeypatch.setattr(backend, "is_gpu", True)
    check_cuda_aware(True, _Comm(True))
    check_cuda_aware(False, _Comm(False))
    check_cuda_aware(None, _Comm(False))
    with pytest.raises(ConfigError, match="is not CUDA-aware") as e:
        check_cuda_aware(True, _Comm(False))
    assert e.value.key == "optimizer.params.cuda_aware"
    with pytest.raises(ConfigError, match="is CUDA-aware"):
        check_cuda_aware(False, _Comm(True))
    monkeypatch.setattr(backend, "is_gpu", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_cuda_aware(True, _Comm(False))
    assert any("without effect" in str(w.message) for w in caught)


def test_optimizer_refuses_what_1bit_adam_is_not():
    from zmpi.optim.onebit import OneBitAdam

    for bad in (dict(freeze_step=0), dict(bias_correction=True), dict(decoupled=False)):
        with pytest.raises(ValueError):
            OneBitAdam(**bad)
    assert OneBitAdam(freeze_step=2).reduces_gradients


@pytest.mark.mpi
def test_docs_example_runs_as_written(tmp_path):
    """docs/onebit.md's example under mpiexec -n 2 prints what the page shows: the phases and
    the bytes exactly, the losses to 0.01, 0.03 after the first compressed update (steps 4
    and 5: the signs of near-zero entries follow the BLAS kernels' rounding, which differs
    between CPUs, and each flip moves a weight by the whole scale: 4.172 for the page's 4.191
    on an AVX2-only CPU)."""
    import re

    from mpi_util import launch_mpi

    page = (REPO_ROOT / "docs" / "onebit.md").read_text()
    code, shown = re.findall(r"```python\n(.*?)```\n\n```\n(.*?)```", page, re.S)[0]
    (tmp_path / "onebit.py").write_text(code)
    result = launch_mpi(tmp_path / "onebit.py", 2, timeout=120)
    assert result.returncode == 0, result.describe()
    line = re.compile(r"step (\d): (\S+) +loss ([\d.]+), ([\d,]+) bytes")
    got, want = line.findall(result.stdout), line.findall(shown)
    assert len(got) == len(want) == 6, result.stdout
    for g, w in zip(got, want, strict=True):
        assert (g[0], g[1], g[3]) == (w[0], w[1], w[3]), (g, w)
        assert abs(float(g[2]) - float(w[2])) <= (0.03 if int(g[0]) > 3 else 0.01), (g, w)


@pytest.mark.mpi
def test_bench_at_a_tiny_size_and_its_report_section(tmp_path):
    """experiments/bench_onebit.py end to end (12 steps, freeze_step 4, 2 ranks): every run
    writes its row, the compressed steps send exactly the formula's bytes; report.py's
    section 10 shows the table."""
    import csv
    import subprocess

    from mpi_util import launch_mpi

    experiments = REPO_ROOT / "experiments"
    env = {"PYTHONPATH": f"{REPO_ROOT}:{experiments}", "MPLBACKEND": "Agg"}
    out = tmp_path / "results" / "onebit"
    result = launch_mpi(experiments / "bench_onebit.py", 2, timeout=180, env=env, args=[
        "--steps", "12", "--freeze-step", "4", "--lr-warmup", "2", "--val-batches", "1",
        "--n-layer", "1", "--d-model", "32", "--seq-len", "16", "--batch", "8", "--out", out])
    assert result.returncode == 0, result.describe()
    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [r["run"] for r in rows] == ["Adam", "OneBitAdam (warm-up rule only)",
                                        "OneBitAdam (freeze_step 4)"]
    onebit = rows[-1]
    want, _ = compressed_bytes(int(onebit["full_numel"]), 2, 4)
    assert onebit["sent_equals_declared"] == "True" and onebit["warm_steps"] == "4"
    assert float(onebit["bytes_after"]) == want
    assert float(onebit["bytes_warm"]) == float(rows[0]["bytes_warm"])  # stage 0's allreduce
    assert (out / "loss.png").stat().st_size > 1000
    report = tmp_path / "RESULTS.md"
    subprocess.run([sys.executable, experiments / "report.py", "--results", tmp_path /
                    "results", "--out", report], env={**env}, check=True, cwd=REPO_ROOT)
    section = report.read_text().split("## 10.")[1]
    assert "| OneBitAdam (freeze_step 4) |" in section and "loss.png" in section


def test_resume_across_optimizer_types_says_what_is_dropped(tmp_path):
    """Issue 49: a OneBitAdam checkpoint loaded as AdamW (or the other way round) gave no
    note (the notes compared lr, betas, eps and weight decay only). The master weights, m, v
    and the step count carry over; the note says so, and what does not: 1-bit Adam's error
    feedback (never saved) and the v it froze; into OneBitAdam, when it compresses."""
    from zmpi.data import SyntheticSource
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig

    def engine(kind):
        params = {"lr": 1e-2, **({"freeze_step": 2} if kind == "OneBitAdam" else {})}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return Engine(GPT(GPTConfig(16, 8, 1, 2, 16), seed=0), {
                "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": kind,
                                                                    "params": params}})

    data = SyntheticSource(16, 8, 4, seed=1)
    for saved, loaded, compresses in (("OneBitAdam", "AdamW", None),
                                      ("AdamW", "OneBitAdam", "from the first step")):
        first = engine(saved)
        for step in range(3):
            first.train_step(*data.sample(step))
        first.save_checkpoint(tmp_path / saved)
        second = engine(loaded)
        notes = second.load_checkpoint(tmp_path / saved).notes
        said = [n for n in notes if n.startswith("the optimizer is")]
        assert len(said) == 1 and said[0].startswith(
            f"the optimizer is {loaded} (the checkpoint had {saved}): the master weights, m, v "
            "and the step count (3) carry over"), notes
        assert ("error feedback (never saved) is dropped" in said[0]) == (saved == "OneBitAdam")
        assert compresses is None or f"compresses {compresses}" in said[0]
        for state in ("master", "adam_m", "adam_v"):
            assert np.array_equal(getattr(first.strategy, state),
                                  getattr(second.strategy, state)), state
    same = engine("OneBitAdam")
    assert not any("optimizer is" in n for n in
                   same.load_checkpoint(tmp_path / "OneBitAdam").notes)

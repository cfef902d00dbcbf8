"""The device check's parts that run without a GPU or network: experiments/gpu_check.sh refuses
in one line without its wheels (and installs nothing), its dry run (the exact device command,
every step as on a GPU with its command logged instead of run) leaves what the device tool
brings back within the budget, and experiments/gpu_trace.py's table counts GPU operations
and casts per step and per layer. (Its install part was run in a fresh venv with cp311
wheels: docs/gpu.md, "Running the device check".)"""
import re
import subprocess
import sys
import tarfile

from mpi_util import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "experiments"))
import gpu_trace  # noqa: E402

SCRIPT = REPO_ROOT / "experiments" / "gpu_check.sh"
DEVICE_TIMEOUT_S = 600  # the device tool's most for one command: the check's timeout_s
STEPS = ["env", "tests", "bench", "flash", "trace", "trace-small", "compile", "count"]


def _check(tmp_path, **env):
    """The device command, `bash experiments/gpu_check.sh`, with $OUT as the tool sets it."""
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                               "GPU_DEPS": str(tmp_path / "deps"), "TMPDIR": str(tmp_path),
                               "PYTHON": sys.executable, **env})


def _what_comes_back(out):
    """The files under out as the device tool brings them back: each a plain file at most 2
    folders down, named in letters, digits, '.', '_' and '-', at most 16 MiB; at most 8."""
    files = [p for p in out.rglob("*") if not p.is_dir()]
    for p in files:
        parts = p.relative_to(out).parts
        assert p.is_file() and not p.is_symlink() and len(parts) <= 3, p
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in parts), p
        assert p.stat().st_size <= 16 << 20, p
    assert len(files) <= 8 and sum(p.stat().st_size for p in files) <= 64 << 20
    return sorted(str(p.relative_to(out)) for p in files)


def test_without_the_wheels_the_check_says_what_to_run(tmp_path):
    out = _check(tmp_path, GPU_WHEELS=str(tmp_path / "none"))
    assert out.returncode == 1
    assert "no mpi4py and mpich wheels in" in out.stdout and "make gpu-wheels" in out.stdout
    assert _what_comes_back(tmp_path / "out") == ["results.tar.gz", "summary.txt"]
    assert not (tmp_path / "deps").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # its scratch folder removed


def test_the_dry_run_brings_back_three_files_within_the_budget(tmp_path):
    """The device command's dry run: summary.txt, targets.md and results.tar.gz (a log per
    step), every step's limit with its kill grace and the install's reserve inside the
    default budget, and the budget inside the device tool's 600 s."""
    out = _check(tmp_path, GPU_CHECK_DRY_RUN="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _what_comes_back(tmp_path / "out") == ["results.tar.gz", "summary.txt", "targets.md"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    limits = dict(re.findall(r"^(\S+) +dry run +(\d+) s limit", summary, re.M))
    assert sorted(limits) == sorted(STEPS)
    budget, steps, n, grace, reserve, planned = map(int, re.search(
        r"^budget +(\d+) s: steps (\d+) s \+ (\d+) x (\d+) s kill grace \+ (\d+) s install "
        r"and packing = (\d+) s$", summary, re.M).groups())
    assert steps == sum(int(v) for k, v in limits.items() if k != "count") and n == 7
    assert planned == steps + n * grace + reserve <= budget
    assert int(limits["count"]) <= budget - reserve  # beside the others, on the CPU
    assert budget + 30 <= DEVICE_TIMEOUT_S  # 30 s for the tool's own start of the command
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        logs = {m.name.removeprefix("./"): tar.extractfile(m).read().decode()
                for m in tar.getmembers() if m.isfile()}
    assert {f"{s.replace('-', '_')}.txt" for s in STEPS} <= set(logs)
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1" in logs["tests.txt"]
    assert "-p pytest_timeout" in logs["tests.txt"] and " -m gpu " in logs["tests.txt"]
    assert logs["targets.md"] == (tmp_path / "out" / "targets.md").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_budget_or_dry_run_setting_it_cannot_read_is_refused(tmp_path):
    for env in ({"GPU_CHECK_SECONDS": "9m"}, {"GPU_CHECK_DRY_RUN": "yes"}):
        out = _check(tmp_path, **env)
        assert out.returncode == 2 and len(out.stdout.splitlines()) == 1
        assert "want whole seconds, and 0 or 1" in out.stdout
        assert not (tmp_path / "out").exists()


def test_a_step_the_budget_leaves_out_is_skipped_not_failed(tmp_path):
    out = _check(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_SECONDS="30")
    assert out.returncode == 0, out.stdout + out.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "over the budget: the last steps may be skipped" in summary
    for name in STEPS:
        assert re.search(rf"^{name} +skipped: the 30 s budget is spent$", summary, re.M)
    assert "FAILED" not in summary
    assert _what_comes_back(tmp_path / "out") == ["results.tar.gz", "summary.txt", "targets.md"]


def test_casts_are_cupys_conversions_between_two_dtypes():
    assert gpu_trace.is_cast("cupy_copy__float16_float32")
    assert not gpu_trace.is_cast("cupy_copy__float32_float32")  # a plain copy
    assert not gpu_trace.is_cast("cupy_sum") and not gpu_trace.is_cast("sm90_xmma_gemm_f16")


def test_the_summary_per_step_and_per_layer():
    events = [("gemm", 30.0)] * 24 + [("cupy_copy__float16_float32", 5.0)] * 6 \
        + [("cupy_copy__float32_float32", 1.0)] * 2
    s = gpu_trace.summarize(events, steps=2, n_layer=3, wall_s=0.5)
    assert (s["ops_per_step"], s["casts_per_step"], s["casts_per_layer"]) == (16, 3, 1)
    assert s["busy_ms"] == (24 * 30 + 6 * 5 + 2) / 2 / 1e3 and s["wall_ms"] == 500
    assert [r["kernel"] for r in s["kernels"]] == ["gemm", "cupy_copy__float16_float32",
                                                   "cupy_copy__float32_float32"]
    assert s["kernels"][1] == {"kernel": "cupy_copy__float16_float32", "launches_per_step": 3,
                               "ms_per_step": 0.015, "cast": True}
    text = gpu_trace.table(s, limit=2)
    assert "16 GPU operations/step (5.3 a layer), 3 casts (1.0 a layer)" in text
    assert text.count("\n| ") == 3  # the header and two kernels
    assert s["idle_ms"] is None and "idle" not in text
    timed = gpu_trace.summarize(events, steps=2, n_layer=3, wall_s=0.5, unprofiled_s=0.0004)
    assert timed["idle_ms"] == 0.4 - timed["busy_ms"]  # 0.4 ms wall, 0.376 ms busy
    assert "unprofiled wall 0.4 ms/step, GPU idle 0.0 ms/step (6%" in gpu_trace.table(timed, 2)


def test_the_targets_table_reads_the_device_checks_results(tmp_path):
    """experiments/gpu_targets.py: each of issue 48's targets from the check's files, met or
    not, and "-" for what did not run (here torch.compile)."""
    import json

    import gpu_targets

    def zmpi(precision, stage, batch, tokens, **extra):
        return {"peer": "zmpi", "precision": precision, "stage": stage, "batch": batch,
                "step_s": batch * 1024 / tokens, "tokens_per_s": tokens,
                "mfu": tokens / 1e6, **extra}

    bench = [zmpi("fp16", 0, 8, 200e3, plan_step_s=0.0451, plan_hardware="h200"),
             zmpi("fp16", 3, 8, 190e3), zmpi("bf16", 0, 8, 210e3), zmpi("fp16", 0, 16, 250e3),
             {"peer": "PyTorch eager", "precision": "fp16 (autocast)", "stage": "-",
              "batch": 8, "step_s": 0.0437, "tokens_per_s": 187.5e3, "mfu": 0.16},
             {"peer": "PyTorch eager", "precision": "fp16 (autocast)", "stage": "-",
              "batch": 16, "step_s": 0.06, "tokens_per_s": 273e3, "mfu": 0.2},
             {"kernels": "fused", "stage": 0, "precision": "fp16", "batch": 8,  # a count's
              "launches_per_layer": 62.0, "launches_outside": 39.0}]
    for name, data in (("bench/run.json", {"rows": bench}),
                       ("trace/trace.json", {"args": {"n_layer": None}, "ops_per_step": 540,
                                             "casts_per_layer": 0.75}),
                       ("flash/results.json", {"flash_kernels": {"block 64": "tensor cores"},
                                               "rows": [{"case": "GPT step", "path": "blocked",
                                                         "seconds": 0.04},
                                                        {"case": "GPT step", "path": "flash",
                                                         "seconds": 0.05}]}),
                       ("count/run.json", {"rows": [
                           {"kernels": "fused", "stage": 0, "precision": "fp16",
                            "launches_per_layer": 40.0, "launches_outside": 39.0}]})):
        (tmp_path / name).parent.mkdir()
        (tmp_path / name).write_text(json.dumps(data))
    rows = {t.split(",")[0].split(" (")[0]: (m, ok) for t, _, m, ok in
            gpu_targets.targets(tmp_path)}
    assert rows["zmpi fp16 tokens/s over PyTorch eager's"] == ("0.92x", False)  # micro-batch 16
    assert rows["stretch: over torch.compile bf16's"] == ("-", None)
    assert rows["zmpi MFU"] == ("25.0% (micro-batch 16, stage 0)", False)
    assert rows["bf16 trains and its tokens/s is reported beside fp16's"] == \
        ("210,000 tokens/s (1.05x fp16)", True)
    assert rows["GPU operations a layer"] == ("45.0", False)  # 540 / GPT-2 small's 12
    assert rows["cast kernels a layer"] == ("0.8", True)
    assert rows["the stand-in's operations a step against the trace's"] == \
        ("519 against 540 (-4%)", True)
    assert rows["flash attention's GPT step over the blocked path's"] == \
        ("1.25x (block 64: tensor cores)", False)
    assert rows["zmpi plan's step against the measured one"] == \
        ("0.045 s (h200) against 0.041 s (+10%)", True)
    assert rows["CUDA graphs"] == ("-", None)  # trace_small did not run
    (tmp_path / "trace_small").mkdir()
    for idle, decided in ((3.0, True), (1.0, False)):  # of a 10 ms step
        (tmp_path / "trace_small/trace.json").write_text(json.dumps(
            {"args": {"n_layer": 4}, "ops_per_step": 200, "casts_per_layer": 0,
             "unprofiled_wall_ms": 10.0, "idle_ms": idle}))
        rows = {t.split(",")[0].split(" (")[0]: (m, ok) for t, _, m, ok in
                gpu_targets.targets(tmp_path)}
        assert rows["CUDA graphs"] == (f"{idle:.1f} of 10.0 ms a step ({idle / 10:.0%})", decided)
    table = gpu_targets.markdown(gpu_targets.targets(tmp_path))
    assert table[2] == "| zmpi fp16 tokens/s over PyTorch eager's, micro-batch 8 | >= 1.0x " \
                       "| 1.07x | yes |"
    # a trace without GPU operations (no CUPTI) measured nothing
    (tmp_path / "trace/trace.json").write_text(json.dumps(
        {"args": {"n_layer": None}, "ops_per_step": 0, "casts_per_layer": 0}))
    rows = {t.split(",")[0].split(" (")[0]: (m, ok) for t, _, m, ok in
            gpu_targets.targets(tmp_path)}
    assert rows["GPU operations a layer"] == rows["cast kernels a layer"] == ("-", None)
    assert rows["the stand-in's operations a step against the trace's"] == ("-", None)


def test_make_test_gpu_installs_nothing_and_refuses_without_cupy():
    """`make test-gpu` runs on the Python's own CuPy (no pip, which would put cupy-cuda12x over
    a GPU image's cupy-cuda13x, and fails offline), without the Python's own pytest plugins;
    where that Python has no CuPy it says so in one line."""
    plan = subprocess.run(["make", "-n", "test-gpu"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)
    assert plan.returncode == 0 and "-m pip" not in plan.stdout
    pytest_lines = [line for line in plan.stdout.splitlines() if " -m pytest " in line]
    assert len(pytest_lines) == 2 and all("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1" in line and
                                          "-p pytest_timeout" in line for line in pytest_lines)
    done = subprocess.run(["make", "-s", "test-gpu", f"GPU_PYTHON={sys.executable}"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 2
    assert done.stdout.strip().splitlines() == [
        f"make test-gpu: no CuPy in {sys.executable}: give GPU_PYTHON=, or pip install -e "
        "'.[gpu,dev]' where there is network"]

"""The device check's parts that run without a GPU or network: experiments/gpu_check.sh refuses
in one line without its wheels (and writes nothing else), and experiments/gpu_trace.py's table
counts GPU operations and casts per step and per layer. (Its install part was dry-run in a
fresh venv with cp311 wheels: docs/gpu.md, "Running the device check".)"""
import subprocess
import sys

from mpi_util import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "experiments"))
import gpu_trace  # noqa: E402

SCRIPT = REPO_ROOT / "experiments" / "gpu_check.sh"


def test_without_the_wheels_the_check_says_what_to_run(tmp_path):
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "GPU_WHEELS": str(tmp_path / "none"),
                              "OUT": str(tmp_path / "out"), "GPU_DEPS": str(tmp_path / "deps")})
    assert out.returncode == 1
    assert "no mpi4py and mpich wheels in" in out.stdout and "make gpu-wheels" in out.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.txt"]
    assert not (tmp_path / "deps").exists()


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

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

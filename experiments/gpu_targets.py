"""Issue 48's targets against what the device check measured: one table, each target with what
it wants, what was measured and whether it is met ("-" where its step did not run or finish).

    python experiments/gpu_targets.py results/gpu_check    # experiments/gpu_check.sh runs it last

Reads the device check's folder: bench/run.json (bench_gpu.py: zmpi fp16 and bf16 beside
PyTorch eager, with zmpi plan's prediction), compile/run.json (PyTorch under torch.compile,
bf16), trace/trace.json (gpu_trace.py: GPT-2 small's kernels, fp16, stage 0, micro-batch 8)
and count/run.json (the stand-in's count at T 1024); writes targets.md beside them and prints
it. The targets (issue 48): zmpi fp16 >= 1.0x PyTorch eager's tokens/s at micro-batches 8 and
16 (stretch: >= 0.8x torch.compile bf16), MFU >= 30 %, bf16 reported beside fp16, <= 40 GPU
operations and <= 2 casts a layer, the stand-in's count within 10 % of the trace's, zmpi plan
within 20 % of the step; and flash/results.json (bench_flash_attention.py): whether the flash
kernels make the step faster than the blocked path (25 fewer operations a layer on the
stand-in), and whether they ran on tensor cores. A trace that saw no GPU operation (a profiler
without CUPTI) counts as not measured. Last, issue 55's decision on CUDA graphs, from
trace_small/trace.json (gpu_trace.py on a small model): a graph of the step is worth writing
when the GPU idles for GRAPH_IDLE of the step or more (the most a graph could save), and the
plan is dropped otherwise (docs/gpu.md, "CUDA graphs").
"""
import json
import sys
from pathlib import Path

from bench_gpu import TORCH_PEERS, plan_error

EAGER, COMPILED = TORCH_PEERS["eager"][0], TORCH_PEERS["compile"][0]  # the peers' row names
GRAPH_IDLE = 0.20  # the GPU's idle share of a small model's step that makes a graph worth it


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rows(folder: Path) -> list[dict]:
    run = _load(folder / "run.json")
    return run["rows"] if run else []


def _zmpi(rows, precision: str, batch: int) -> dict | None:
    """The fastest zmpi row of `precision` at micro-batch `batch` (any stage)."""
    found = [r for r in rows if r.get("peer") == "zmpi" and r["precision"] == precision
             and r["batch"] == batch]
    return max(found, key=lambda r: r["tokens_per_s"]) if found else None


def _peer(rows, peer: str, batch: int) -> dict | None:
    return next((r for r in rows if r.get("peer") == peer and r["batch"] == batch), None)


def _ratio(a, b) -> float | None:
    return None if a is None or b is None else a["tokens_per_s"] / b["tokens_per_s"]


def targets(out: Path) -> list[tuple[str, str, str, bool | None]]:
    """(target, wanted, measured, met: None where unmeasured) for the device check in `out`."""
    bench, compiled, count = (_rows(out / name) for name in ("bench", "compile", "count"))
    trace = _load(out / "trace" / "trace.json")
    result = []

    def add(target, wanted, value, met, says):
        """A target measured as `value` (None: not measured): met(value), says(value)."""
        result.append((target, wanted, "-", None) if value is None else
                      (target, wanted, says(value), met(value)))

    for batch in (8, 16):
        add(f"zmpi fp16 tokens/s over PyTorch eager's, micro-batch {batch}", ">= 1.0x",
            _ratio(_zmpi(bench, "fp16", batch), _peer(bench, EAGER, batch)),
            lambda r: r >= 1.0, lambda r: f"{r:.2f}x")
    add("stretch: over torch.compile bf16's, micro-batch 8", ">= 0.8x",
        _ratio(_zmpi(bench, "fp16", 8), _peer(compiled, COMPILED, 8)),
        lambda r: r >= 0.8, lambda r: f"{r:.2f}x")
    add("zmpi MFU (its best fp16 row)", ">= 30 %",
        max((r for r in bench if r.get("peer") == "zmpi" and r["precision"] == "fp16"),
            key=lambda r: r["mfu"], default=None),
        lambda r: r["mfu"] >= 0.30,
        lambda r: f"{r['mfu']:.1%} (micro-batch {r['batch']}, stage {r['stage']})")
    fp16 = _zmpi(bench, "fp16", 8)
    add("bf16 trains and its tokens/s is reported beside fp16's", "reported",
        _zmpi(bench, "bf16", 8), lambda _: True,
        lambda r: f"{r['tokens_per_s']:,.0f} tokens/s"
                  + (f" ({_ratio(r, fp16):.2f}x fp16)" if fp16 else ""))
    # a trace that saw no GPU operation measured nothing (a profiler without CUPTI)
    trace = trace if trace and trace["ops_per_step"] > 0 else None
    n_layer = (trace["args"].get("n_layer") if trace else None) or 12
    ops = trace["ops_per_step"] if trace else None
    add("GPU operations a layer (the trace's a step over its layers, those outside the layers "
        "included: issue 48's measure)", "<= 40", None if ops is None else ops / n_layer,
        lambda v: v <= 40, lambda v: f"{v:.1f}")
    add("cast kernels a layer (the trace)", "<= 2", trace["casts_per_layer"] if trace else None,
        lambda v: v <= 2, lambda v: f"{v:.1f}")
    counted = next((r for r in count if (r.get("kernels"), r.get("stage"), r.get("precision"))
                    == ("fused", 0, "fp16")), None)
    total = None if counted is None else (counted["launches_per_layer"] * n_layer
                                          + counted["launches_outside"])
    add("the stand-in's operations a step against the trace's (fused fp16, stage 0)",
        "within 10 %", None if total is None or ops is None else total / ops - 1,
        lambda e: abs(e) <= 0.10, lambda e: f"{total:.0f} against {ops:.0f} ({e:+.0%})")
    flash = _load(out / "flash" / "results.json") or {"rows": [], "flash_kernels": {}}
    steps = {r["path"]: r["seconds"] for r in flash["rows"] if r["case"] == "GPT step"}
    kinds = ", ".join(f"{k}: {v}" for k, v in flash["flash_kernels"].items())  # tensor cores?
    add("flash attention's GPT step over the blocked path's (fp16, micro-batch 8; on the "
        "stand-in flash takes 25 fewer operations a layer)", "< 1.0x, to make it the GPU's "
        "default", steps["flash"] / steps["blocked"] if {"flash", "blocked"} <= steps.keys()
        else None, lambda r: r < 1.0, lambda r: f"{r:.2f}x ({kinds})")
    row = next((r for r in bench if r.get("peer") == "zmpi" and "plan_step_s" in r
                and (r["precision"], r["stage"], r["batch"]) == ("fp16", 0, 8)), None)
    add("zmpi plan's step against the measured one (fp16, stage 0, micro-batch 8)",
        "within 20 %", row, lambda r: abs(plan_error(r)) <= 0.20,
        lambda r: f"{r['plan_step_s']:.3f} s ({r['plan_hardware']}) against "
                  f"{r['step_s']:.3f} s ({plan_error(r):+.0%})")
    small = _load(out / "trace_small" / "trace.json")
    small = small if small and small["ops_per_step"] > 0 and small.get("idle_ms") is not None \
        else None
    add("CUDA graphs (issue 55): the GPU's idle time in a small model's step (d_model 256, 4 "
        "layers, T 128, micro-batch 4), the most a graph of the step saves",
        f">= {GRAPH_IDLE:.0%} of the step: write the graph path; less: drop it", small,
        lambda t: t["idle_ms"] >= GRAPH_IDLE * t["unprofiled_wall_ms"],
        lambda t: f"{t['idle_ms']:.1f} of {t['unprofiled_wall_ms']:.1f} ms a step "
                  f"({t['idle_ms'] / t['unprofiled_wall_ms']:.0%})")
    return result


def markdown(rows) -> list[str]:
    met = {True: "yes", False: "no", None: "-"}
    return (["| target (issue 48; CUDA graphs: 55) | wanted | measured | met |",
             "|---|---|---|---|"]
            + [f"| {t} | {w} | {m} | {met[ok]} |" for t, w, m, ok in rows])


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: python experiments/gpu_targets.py DEVICE_CHECK_FOLDER")
    out = Path(sys.argv[1])
    if not out.is_dir():
        sys.exit(f"gpu_targets: {out} is not a folder")
    text = "\n".join(markdown(targets(out))) + "\n"
    (out / "targets.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()

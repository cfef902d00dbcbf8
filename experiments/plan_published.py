"""zmpi plan's model against published results: the runs of Megatron-LM 2021 (Table 1), the ZeRO
paper's 100B model and ZeRO-Offload on one V100, each predicted on the hardware of the paper
(zmpi.plan.hardware presets a100, v100) with one efficiency constant per platform fixed before
comparing (gemm_efficiency: the a100 preset's 0.75; on the V100s, the fraction of the tensor-core
peak at which the model reproduces Megatron-LM 2019's single-V100 baseline, the software the
V100 papers ran; the v100 preset's 0.75 is shown beside it), and the model-state memory
against DeepSpeed's estimators. A benchmark of the planner's formulas, not a test.

    python experiments/plan_published.py --out results/plan_published

For each published run: the layout the paper states (its tensor and pipeline degrees, the
rest data parallel; ZeRO stage, offload and recompute as the paper ran them; micro-batch 1
where a paper does not state it), the memory the planner predicts for one rank against the
device's memory, and its predicted TFLOP/s per GPU, counted with the paper's own FLOP formula
(Megatron-LM's eq. 3, recompute included), against the published figure. Then the largest
ZeRO-Offload model one V100 fits by the planner's memory model (the paper: 13B). Then
DeepSpeed's estimate_zero2/3_model_states_mem_needs beside zmpi's formulas, term by term.
"""
import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from deepspeed_estimates import (  # noqa: E402
    estimate_zero2_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs,
)
from published import (  # noqa: E402
    MEGATRON_2019_BASELINE,
    MEGATRON_2021_TABLE1,
    ZERO_100B,
    ZERO_OFFLOAD,
)

from results import write_results  # noqa: E402
from zmpi.comm import Comm  # noqa: E402
from zmpi.memory import held_model_state  # noqa: E402
from zmpi.models.gpt_counts import gpt_num_params  # noqa: E402
from zmpi.plan.hardware import PRESETS  # noqa: E402
from zmpi.plan.layout import Job, Layout  # noqa: E402
from zmpi.plan.memory import layout_memory  # noqa: E402
from zmpi.plan.search import RESERVE, evaluate, model_flops_per_step  # noqa: E402

ASSUMED_SEQ_LEN = 1024  # the ZeRO papers do not state theirs; GPT-2's
ASSUMED_VOCAB = 50257  # nor their vocabulary; GPT-2's


def paper_tflops(job, step_seconds: float) -> float:
    """TFLOP/s per GPU of `job` at `step_seconds` a step, counted as the papers count
    (Megatron-LM's eq. 3, recompute included)."""
    return model_flops_per_step(job, recompute=True) / step_seconds / job.world_size / 1e12


def predicted_tflops(job, layout, hw) -> float:
    """paper_tflops at the step time the planner predicts for `job` as `layout` on `hw`."""
    return paper_tflops(job, evaluate(job, layout, hw).time.total)


def predict(name, job, layout, hw, published, preset=None):
    """One row: the planner's memory and time for a published run of `job` as `layout` on
    `hw`; with `preset` (the hardware `hw` was calibrated from) its ratio there too."""
    candidate = evaluate(job, layout, hw)
    memory, t = candidate.memory, candidate.time
    tflops = paper_tflops(job, t.total)
    at_preset = predicted_tflops(job, layout, preset) if preset else tflops
    return {"run": name, "layout": layout.describe(), "gpus": job.world_size,
            "device_GB": round(memory.device / 1e9, 1),
            "fits": memory.device <= hw.device_memory,
            "gemm_efficiency": round(hw.gemm_efficiency, 3),
            "predicted_tflops": round(tflops, 1), "published_tflops": published,
            "ratio": round(tflops / published, 3),
            "preset_ratio": round(at_preset / published, 3),
            "bubble_share": round(t.bubble / t.total, 3),
            "tensor_share": round(t.tensor / t.total, 3),
            "data_share": round(t.data / t.total, 3)}


def v100_of_2019(v100):
    """`v100` with the gemm_efficiency of the software the V100 papers ran (PyTorch 1.2-1.5,
    apex, Megatron-LM of Sept 2019), fixed from a run outside the rows compared: the fraction
    of the tensor-core peak at which the model predicts Megatron-LM 2019's single-V100
    baseline (1.2B GPT, batch 8, activation checkpointing; 39 TFLOP/s, "30% of the
    theoretical peak" of a DGX-2H's V100, so that peak is 130 TFLOP/s), counted with eq. 3 as
    the compared rows are. Returns (hardware, the baseline's job, layout and DGX-2H)."""
    b = MEGATRON_2019_BASELINE
    job = Job(b["layers"], b["hidden"], b["heads"], b["vocab"], b["seq_len"], b["batch"], 1, 1,
              "fp16")
    layout = Layout(1, 1, 1, 0, "none", "full", False, b["batch"], 1, "1f1b")
    dgx2h = replace(v100, name="v100 (DGX-2H)", peak_flops={
        **v100.peak_flops, "fp16": b["tflops_per_gpu"] * 1e12 / (b["peak_percent"] / 100)})
    low, high = 1e-3, 1.0  # the predicted rate grows with the efficiency: bisect
    for _ in range(60):
        middle = (low + high) / 2
        fast = predicted_tflops(job, layout, replace(dgx2h, gemm_efficiency=middle)) \
            > b["tflops_per_gpu"]
        low, high = (low, middle) if fast else (middle, high)
    efficiency = (low + high) / 2
    return (replace(v100, gemm_efficiency=efficiency),
            (job, layout, replace(dgx2h, gemm_efficiency=efficiency)))


def megatron_rows(hw):
    rows = []
    for r in MEGATRON_2021_TABLE1["rows"]:
        t, p, gpus = r["t"], r["p"], r["gpus"]
        dp = gpus // (t * p)
        job = Job(r["layers"], r["hidden"], r["heads"], MEGATRON_2021_TABLE1["vocab"],
                  MEGATRON_2021_TABLE1["seq_len"], r["batch"], gpus // 8, 8, "fp16")
        m = r["batch"] // dp  # micro-batch 1: not stated for Table 1
        layout = Layout(dp, p, t, 0, "none", "full", False, 1, m, "1f1b")
        rows.append(predict(f"Megatron-LM {r['params_billion']}B", job, layout, hw,
                            r["tflops_per_gpu"]))
    return rows


def zero_100b_row(hw, preset=None):
    z = ZERO_100B
    dp, tp = z["data_parallel"], z["model_parallel"]
    job = Job(z["layers"], z["hidden"], z["heads"], ASSUMED_VOCAB, ASSUMED_SEQ_LEN,
              z["batch_total"], z["nodes"], z["gpus"] // z["nodes"], "fp16")
    # ZeRO-R checkpoints activations (recompute full) and partitions them over the model-
    # parallel ranks (P_a): zmpi's sequence parallelism keeps the same 1/tp share of each;
    # a batch of 32 per data-parallel rank
    layout = Layout(dp, 1, tp, 2, "none", "full", True, z["batch_per_dp_rank"], 1, "1f1b")
    return predict("ZeRO 100B (stage 2)", job, layout, hw, z["tflops_per_gpu"], preset)


def zero_offload_rows(hw, preset=None):
    rows = []
    z = ZERO_OFFLOAD
    for params, micro, mp, layers, hidden in z["table3"]:
        if mp != 1 or params not in z["single_gpu_tflops"]:
            continue
        m = z["single_gpu_global_batch"] // micro  # 512 / micro, rounded down
        job = Job(layers, hidden, hidden // 128, ASSUMED_VOCAB, ASSUMED_SEQ_LEN, micro * m,
                  1, 1, "fp16")
        layout = Layout(1, 1, 1, 2, "optimizer", "full", False, micro, m, "1f1b")
        rows.append(predict(f"ZeRO-Offload {params}B, one V100", job, layout, hw,
                            z["single_gpu_tflops"][params], preset))
    return rows


def largest_offload_model(hw):
    """The largest model of ZeRO-Offload's 10B-13B shape (width 4096, 32 heads) that one V100
    trains as the paper does (ZeRO-2, optimizer offload, recompute, micro-batch 4) by the
    planner's memory model (RESERVE of the device): its parameters. (The planner's own choice
    for one GPU, stage 3 with parameter offload, is bounded by host memory instead.)"""
    best = None
    for layers in range(20, 200):
        job = Job(layers, 4096, 32, ASSUMED_VOCAB, ASSUMED_SEQ_LEN, 512, 1, 1, "fp16")
        layout = Layout(1, 1, 1, 2, "optimizer", "full", False, 4, 128, "1f1b")
        if layout_memory(job, layout, on_gpu=True)[0].device > RESERVE * hw.device_memory:
            break
        best = gpt_num_params(layers, 4096, ASSUMED_VOCAB, ASSUMED_SEQ_LEN)
    return best


def deepspeed_rows():
    """zmpi's model states beside DeepSpeed's estimators (bytes per GPU), Psi = 7.5e9 on 64
    GPUs (8 nodes x 8), with the terms that differ named: DeepSpeed keeps an fp32 copy of the
    gradient partition (4 Psi / N) where zmpi adds the fp16 shard into the master update, its
    ZeRO-3 estimate counts no fp16 gradient shard (2 Psi / N) and adds the largest layer's
    gathered parameters and gradients (4 L; zmpi plans those as ZeRO buffers). zmpi's
    figure with those terms is DeepSpeed's exactly."""
    psi, n, largest = 7_500_000_000, 64, 51200 * 4096
    out = []
    for stage, offload in ((2, False), (2, True), (3, False), (3, True)):
        held = held_model_state(psi, psi // n, 2, 4, True, True, stage == 3, offload)
        zmpi_device = sum(held["device"].values())
        if stage == 2:
            _, ds = estimate_zero2_model_states_mem_needs(psi, 8, 8, cpu_offload=offload)
        else:
            _, ds = estimate_zero3_model_states_mem_needs(psi, largest, 8, 8, cpu_offload=offload,
                                                          cpu_offload_params=False)
        terms = {"fp32 gradient shard": 0 if offload else 4 * psi // n,
                 "no fp16 gradient shard": -2 * psi // n if stage == 3 and not offload else 0,
                 "largest layer 4 L": 4 * largest if stage == 3 else 0}
        out.append({"stage": stage, "offload_optimizer": offload,
                    "zmpi_GB": zmpi_device / 1e9, "deepspeed_GB": ds / 1e9,
                    "terms": {k: v for k, v in terms.items() if v},
                    "zmpi_with_terms_GB": (zmpi_device + sum(terms.values())) / 1e9,
                    "equal": zmpi_device + sum(terms.values()) == ds})
    return out


def markdown(rows, largest, ds, a100, v100, v100_2019, baseline) -> list[str]:
    job, _, dgx2h = baseline
    measured, peak = MEGATRON_2019_BASELINE["tflops_per_gpu"], dgx2h.peak_flops["fp16"] / 1e12
    md = [f"Efficiency constants, fixed before comparing: gemm_efficiency {a100.gemm_efficiency} "
          f"on the A100s (the a100 preset); {v100_2019.gemm_efficiency:.3f} on the V100s, the "
          "fraction of the tensor-core peak at which the model predicts Megatron-LM 2019's "
          f"single-V100 baseline ({job.n_layer} layers, d {job.d_model}, batch "
          f"{job.global_batch}, activation checkpointing: {measured} TFLOP/s on a DGX-2H V100 "
          f"of {peak:.0f} TFLOP/s peak), "
          "the software the V100 papers ran; the last column is the ratio at the v100 preset's "
          f"{v100.gemm_efficiency}. TFLOP/s per GPU by Megatron-LM's eq. 3 (recompute counted).",
          "",
          "| run | layout | GPUs | device GB | gemm eff. | predicted TFLOP/s | published | ratio "
          "| bubble | tensor comm | data comm | ratio at preset |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['run']} | {r['layout']} | {r['gpus']} | {r['device_GB']}"
                  f"{'' if r['fits'] else ' (does not fit)'} | {r['gemm_efficiency']} | "
                  f"{r['predicted_tflops']} | {r['published_tflops']} | {r['ratio']:.2f} | "
                  f"{r['bubble_share']:.1%} | {r['tensor_share']:.1%} | {r['data_share']:.1%} | "
                  f"{r['preset_ratio']:.2f} |")
    md += ["", f"Largest ZeRO-Offload-shaped model one V100 fits (ZeRO-2, optimizer offload, "
           f"recompute, micro-batch 4): {largest / 1e9:.1f} B parameters (the paper: "
           f"{ZERO_OFFLOAD['largest_single_gpu_params_billion']} B).", "",
           "| stage | optimizer offload | zmpi GB | DeepSpeed GB | terms that differ | zmpi with "
           "them | equal |", "|---|---|---|---|---|---|---|"]
    for r in ds:
        terms = ", ".join(f"{k} {v / 1e9:+.3f}" for k, v in r["terms"].items()) or "none"
        md.append(f"| {r['stage']} | {r['offload_optimizer']} | {r['zmpi_GB']:.4f} | "
                  f"{r['deepspeed_GB']:.4f} | {terms} | {r['zmpi_with_terms_GB']:.4f} | "
                  f"{r['equal']} |")
    return md


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/plan_published")
    args = ap.parse_args()
    a100, v100 = PRESETS["a100"], PRESETS["v100"]
    v100_2019, baseline = v100_of_2019(v100)
    rows = megatron_rows(a100) + [zero_100b_row(v100_2019, v100)] \
        + zero_offload_rows(v100_2019, v100)
    largest = largest_offload_model(v100)
    ds = deepspeed_rows()
    md = markdown(rows, largest, ds, a100, v100, v100_2019, baseline)
    print("\n".join(md))
    write_results(args.out, rows, md, Comm(), argv=sys.argv,
                  hardware={"a100": a100.to_dict(), "v100": v100.to_dict(),
                            "v100_2019": v100_2019.to_dict()},
                  calibration={"run": MEGATRON_2019_BASELINE, "hardware": baseline[2].to_dict(),
                               "predicted_tflops": predicted_tflops(*baseline)},
                  largest_offload_params=largest, deepspeed=ds,
                  assumed_seq_len=ASSUMED_SEQ_LEN, assumed_vocab=ASSUMED_VOCAB)


if __name__ == "__main__":
    main()

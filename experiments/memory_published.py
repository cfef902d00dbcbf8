"""Model-state memory per rank of published models by ZeRO stage, from `zmpi estimate`, against
the ZeRO formula (SC'20 Fig. 1 with K = 12: stage 0 (2+2+K) Psi, 1 (2+2) Psi + K Psi/N,
2 2 Psi + (2+K) Psi/N, 3 (2+2+K) Psi/N; fp16 parameters and gradients). Arithmetic only: no
training run.

    python experiments/memory_published.py --out results/memory_published

DeepSpeed-MoE (Rajbhandari et al., ICML 2022): the 1.3B dense base with MoE-128 and with
PR-MoE-64/128, their shapes from DeepSpeed's example scripts (Megatron-DeepSpeed
examples/MoE/ds_pretrain_gpt_1.3B_MoE128.sh and ds_pretrain_gpt_1.3B_PR-MoE64or128.sh: 24
layers, hidden 2048, 16 heads, sequence 2048, the GPT-2 vocabulary padded to a multiple of
128 as Megatron does; experts every other layer (12 MoE layers), 128 experts each, or 64 in
the first ten and 128 in the last two with a residual MLP), at the PR-MoE script's layout
(64 GPUs, expert-parallel degree 64): total parameters, the expert share, and the bytes per
rank with expert parallelism (dense states over dp = 64, each rank's Psi_experts / ep over the
dp / ep ranks holding the same experts; docs/moe.md) against every rank holding every expert
(ep 1). Llama-2 7B and Llama-3 8B (Touvron et al. 2023; Meta's Llama 3 release) at 64 ranks:
`zmpi estimate --model llama` against the formula at the published parameter counts.
"""
import argparse
import json
import os
import subprocess
import sys

from results import write_results
from zmpi.comm import Comm
from zmpi.memory import model_state_bytes

REPO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RANKS = 64
STAGES = (0, 1, 2, 3)

DS_MOE_SHAPE = ["--n-layer", "24", "--d-model", "2048", "--vocab-size", "50257",
                "--vocab-multiple", "128", "--seq-len", "2048"]
DS_MOE = {  # name: (moe section, the ZeRO stage the example script configures)
    "1.3B+MoE-128": ({"num_experts": 128, "moe_layer_interval": 2}, 1),
    "1.3B+PR-MoE-64/128": ({"num_experts": [64] * 10 + [128] * 2, "moe_layer_interval": 2,
                            "use_residual": True}, 2),
}
DS_MOE_EP = 64  # the PR-MoE script's EP_PARALLEL_SIZE = NUM_GPUS = 64

LLAMA = {  # name: (zmpi estimate flags, the published parameter count)
    "Llama-2 7B": (["--n-layer", "32", "--d-model", "4096", "--n-head", "32",
                    "--intermediate-size", "11008", "--vocab-size", "32000"], 6_738_415_616),
    "Llama-3 8B": (["--n-layer", "32", "--d-model", "4096", "--n-head", "32", "--n-kv-head", "8",
                    "--intermediate-size", "14336", "--vocab-size", "128256"], 8_030_261_248),
}


def estimate(*flags) -> dict:
    """`zmpi estimate ... --world-size RANKS --json`, parsed."""
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", *flags, "--world-size",
                          str(RANKS), "--json"], capture_output=True, text=True, cwd=REPO_ROOT,
                         check=True)
    return json.loads(out.stdout)


def gb(rows) -> dict:
    """{stage: device GB per rank} of zmpi estimate's rows."""
    return {r["stage"]: r["device_gb"] for r in rows}


def moe_rows() -> list[dict]:
    """Per DeepSpeed-MoE model and stage: Psi, Psi_experts, GB per rank at ep DS_MOE_EP and at
    ep 1 (zmpi estimate), and the formula's dense-over-dp plus experts-over-dp/ep GB."""
    rows = []
    for name, (section, script_stage) in DS_MOE.items():
        at_ep = estimate(*DS_MOE_SHAPE, "--moe", json.dumps({**section, "ep_size": DS_MOE_EP}))
        whole = estimate(*DS_MOE_SHAPE, "--moe", json.dumps(section))
        psi, experts = at_ep["params"], at_ep["expert_params"]
        for stage in STAGES:
            formula = (model_state_bytes(psi - experts, RANKS, stage)
                       + model_state_bytes(experts / DS_MOE_EP, RANKS // DS_MOE_EP, stage))
            rows.append({"model": name, "params": psi, "expert_params": experts,
                         "dp": RANKS, "ep": DS_MOE_EP, "stage": stage,
                         "script_stage": stage == script_stage,
                         "GB_per_rank": round(gb(at_ep["stages"])[stage], 3),
                         "formula_GB": round(formula / 1e9, 3),
                         "ep1_GB_per_rank": round(gb(whole["stages"])[stage], 3)})
    return rows


def llama_rows() -> list[dict]:
    """Per Llama model and stage: zmpi estimate's GB per rank at RANKS ranks against the ZeRO
    formula at the published parameter count."""
    rows = []
    for name, (flags, published) in LLAMA.items():
        got = estimate("--model", "llama", *flags)
        for stage in STAGES:
            rows.append({"model": name, "params": got["params"], "published_params": published,
                         "ranks": RANKS, "stage": stage,
                         "GB_per_rank": round(gb(got["stages"])[stage], 3),
                         "formula_GB": round(model_state_bytes(published, RANKS, stage) / 1e9,
                                             3)})
    return rows


def moe_markdown(moe) -> list[str]:
    md = [f"### DeepSpeed-MoE at dp {RANKS}, ep {DS_MOE_EP} (fp16, K = 12)", "",
          "| model | Psi | Psi_experts | stage | GB per rank (zmpi estimate) | formula GB | "
          "GB per rank at ep 1 |", "|---|---|---|---|---|---|---|"]
    for r in moe:
        mark = " (the script's)" if r["script_stage"] else ""
        md.append(f"| {r['model']} | {r['params']:,} | {r['expert_params']:,} | "
                  f"{r['stage']}{mark} | {r['GB_per_rank']} | {r['formula_GB']} | "
                  f"{r['ep1_GB_per_rank']} |")
    return md


def llama_markdown(llama) -> list[str]:
    md = [f"### Llama at {RANKS} ranks (fp16, K = 12)", "",
          "| model | Psi (zmpi estimate) | published | stage | GB per rank (zmpi estimate) | "
          "formula GB |", "|---|---|---|---|---|---|"]
    for r in llama:
        md.append(f"| {r['model']} | {r['params']:,} | {r['published_params']:,} | "
                  f"{r['stage']} | {r['GB_per_rank']} | {r['formula_GB']} |")
    return md


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/memory_published")
    args = ap.parse_args()
    moe, llama = moe_rows(), llama_rows()
    tables = {"moe": (moe, moe_markdown(moe)), "llama": (llama, llama_markdown(llama))}
    for name, (rows, md) in tables.items():  # the last run.json written holds both
        print("\n".join(md) + "\n")
        write_results(args.out, rows, md, Comm(), name=name, argv=sys.argv, ranks=RANKS,
                      ds_moe_shape=DS_MOE_SHAPE, ds_moe=DS_MOE, ds_moe_ep=DS_MOE_EP,
                      llama=llama)


if __name__ == "__main__":
    main()

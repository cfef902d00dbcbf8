"""`zmpi plan --moe`: the planner searches the expert-parallel degree of a GPT with MoE blocks,
counts each layout's expert states over the ranks holding the same experts and its MoE
activations (models/moe_counts.py, held to the ledger in tests/test_moe_accounting.py), prices
the all-to-all, and writes the chosen ep into the config, which `zmpi train` runs."""
import json
import subprocess
import sys

import pytest
from mpi_util import CLI, REPO_ROOT, launch_mpi

from zmpi.config import MoEConfig
from zmpi.memory import estimate_rows
from zmpi.models.gpt_counts import gpt_activation_bytes, gpt_expert_numel, gpt_num_params
from zmpi.models.moe_counts import moe_alltoall
from zmpi.plan.hardware import PRESETS
from zmpi.plan.layout import Job, Layout, layouts, to_config
from zmpi.plan.memory import stage_memory
from zmpi.plan.search import model_flops_per_step, plan
from zmpi.plan.time import _links, step_time

SECTION = {"num_experts": 4, "moe_layer_interval": 2}
JOB = Job(n_layer=4, d_model=64, n_head=4, vocab_size=64, seq_len=32, global_batch=8, nodes=1,
          gpus_per_node=4, precision="fp16", moe=json.dumps(SECTION))


def test_layouts_search_ep_over_the_data_parallel_ranks():
    """ep: every divisor of dp dividing every layer's expert count ({1, 2, 4} with 4 experts
    on 4 ranks, {1, 2} with a pyramid of 4 and 2); tp 1 and pp 1; offload at ep 1 only."""
    got = list(layouts(JOB))
    assert {(c.tp, c.pp) for c in got} == {(1, 1)}
    assert {c.ep for c in got} == {1, 2, 4}
    assert {c.offload for c in got if c.ep > 1} == {"none"}
    assert {c.offload for c in got if c.ep == 1} == {"none", "optimizer", "optimizer+param"}
    pyramid = Job(**{**JOB.__dict__, "moe": json.dumps({"num_experts": [4, 2],
                                                         "layers": [1, 3]})})
    assert {c.ep for c in layouts(pyramid)} == {1, 2}
    assert {c.ep for c in layouts(Job(**{**JOB.__dict__, "moe": None}))} == {1}


@pytest.mark.parametrize("stage", range(4))
def test_memory_at_ep_is_the_expert_states_over_the_ranks_holding_them(stage):
    """Model states: the dense parameters' ZeRO states over dp and each rank's 1 / ep of the
    experts' over dp / ep (`zmpi estimate --moe`'s rows, to the flat buffers' padding); the
    activations one micro-batch's `gpt_activation_bytes` with the MoE blocks at that ep."""
    psi = gpt_num_params(4, 64, 64, 32, moe=SECTION)
    experts = gpt_expert_numel(4, 64, SECTION)
    for ep in (1, 2, 4):
        layout = Layout(4, 1, 1, stage, "none", "none", False, 2, 1, "1f1b", ep)
        m = stage_memory(JOB, layout, 0, on_gpu=True)
        [row] = estimate_rows(psi, 4, [stage], 2, 12, psi_experts=experts if ep > 1 else 0,
                              ep=ep)
        assert 0 <= m.model_state["device"] - row["device_gb"] * 1e9 < 16 * 4 * 2 * 6, ep
        section = MoEConfig.from_dict({**SECTION, "ep_size": ep})
        want = gpt_activation_bytes(4, 64, 4, 64, 32, 2, 2, moe=section, block=32)
        assert m.activation["device"] == want["device"], ep


def test_the_step_time_prices_the_alltoall():
    """At ep > 1 the step pays each micro-batch's all-to-alls on the expert-parallel group's
    link (`moe_alltoall`: (ep - 1) / ep of each capacity buffer sent, a latency per peer and
    call); at ep 1 nothing, and the time's dict leaves the term out. The model FLOPs count
    each token's k experts and the gates beyond a dense GPT's."""
    hw = PRESETS["a100"]
    for ep, recompute in ((2, "none"), (4, "full")):
        layout = Layout(4, 1, 1, 1, "none", recompute, False, 2, 1, "1f1b", ep)
        a2a = moe_alltoall(4, 64, 32, 2, {**SECTION, "ep_size": ep}, recompute)
        link = _links(JOB, layout, hw)["ep"]
        want = link.seconds(a2a["sent_elements"] * 2,
                            link.latencies(a2a["calls"], (ep - 1) * a2a["calls"]))
        t = step_time(JOB, layout, hw)
        assert t.alltoall == pytest.approx(want) and t.alltoall > 0
        assert t.to_dict()["alltoall"] == t.alltoall
        assert t.total == pytest.approx(sum(v for k, v in t.to_dict().items() if k != "total"))
    t = step_time(JOB, Layout(4, 1, 1, 1, "none", "none", False, 2, 1, "1f1b", 1), hw)
    assert t.alltoall == 0 and "alltoall" not in t.to_dict()
    dense = Job(**{**JOB.__dict__, "moe": None})
    gates = 3 * 2 * 8 * 32 * 64 * 4 * 2  # 2 MoE blocks: d E a token, forward and backward
    assert model_flops_per_step(JOB) - model_flops_per_step(dense) == gates  # k = 1


def test_the_moe_plan_fits_and_runs_as_is(tmp_path):
    """The fastest layouts fit, the table names their ep and the all-to-all time, and the
    config carries the chosen ep_size; `zmpi train --config` runs the fastest layout at ep 2
    on 2 ranks as written (on this CPU the fastest of all is at ep 1, with offload)."""
    result = plan(JOB, PRESETS["a100"], top=3)
    assert result.best and all(c.memory.device <= 0.9 * PRESETS["a100"].device_memory
                               for c in result.best)
    best = result.best[0]
    assert to_config(JOB, best.layout)["moe"] == {**SECTION, "ep_size": best.layout.ep}
    out = tmp_path / "plan.json"
    flags = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--vocab", "65",
             "--seq-len", "16", "--global-batch", "4", "--nodes", "1", "--gpus-per-node", "2",
             "--precision", "fp32", "--hardware", "cpu", "--moe", "2", "--top", "12"]
    r = subprocess.run([sys.executable, "-m", "zmpi.cli", "plan", *flags, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("GPT with 2 MoE blocks 2 layers") and " ep 2, " in r.stdout
    chosen = json.loads(out.read_text())["moe"]["ep_size"]
    assert (", alltoall " in r.stdout) == (chosen > 1)
    job = Job(2, 32, 2, 65, 16, 4, 1, 2, "fp32", moe='{"num_experts": 2}')
    at_ep = next(c for c in plan(job, PRESETS["cpu"], top=100).best if c.layout.ep == 2)
    out.write_text(json.dumps(to_config(job, at_ep.layout)))
    run = launch_mpi(CLI, 2, ["train", "--config", str(out), "--steps", "1",
                              "--sample-tokens", "0", "--out", str(tmp_path / "run")],
                     timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ", ep 2)" in run.stdout, run.stdout

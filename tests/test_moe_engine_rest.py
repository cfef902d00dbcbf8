"""The rest of the engine at expert-parallel degree above 1 (docs/moe.md): offload of the
expert states, hybrid sharding and ZeRO++ over them, check_replicas over them, and the unit
model's evaluation routing.

One `mpiexec` launch per world size, 2 and 4 ranks ((dp, ep) = (2, 2), (4, 2)), of
tests/ranks/moe_rest_checks.py: a GPT with MoE blocks in fp64 under ZeRO 1-3 with the
optimizer offloaded to the host, the parameters too, both on NVMe, and the delayed update
(DPU), against the same run without offload (bit for bit, as tests/test_offload.py holds the
dense model) and against one process without offload (test_zero's MoE reference); hybrid
sharding (groups of 1, and of 2 at 4 ranks), hpZ and ZeRO++ against the same reference; its
checkpoints resumed at ep 2 and ep 1; a diverged expert replica named by check_replicas on
every rank; hybrid groups larger than the expert replicas refused. The rest runs in the
test's own process.
"""
import sys

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi
from test_zero import (
    LOSS_RTOL,
    QUANTIZED_LOSS_RTOL,
    QUANTIZED_MODEL_MOVE_RTOL,
    _parity_errors,
    moe_reference,
)

from zmpi.models.gpt import GPT
from zmpi.nn.module import UnitModel
from zmpi.nn.moe import MoE

sys.path.insert(0, str(RANKS_DIR))
import moe_rest_checks as checks  # noqa: E402
import zero_checks  # noqa: E402

SAME_AS = {  # case: (the case without offload it equals, expert strategy's offload flags)
    "stage1_optimizer": ("stage1", [True, False, False]),
    "stage2_optimizer": ("stage2", [True, False, False]),
    "stage2_nvme": ("stage2", [True, False, True]),
    "stage3_optimizer+param": ("stage3", [True, True, False]),
    "stage3_nvme": ("stage3", [True, True, True]),
    "stage3_hpz": ("stage3", [False, False, False]),  # hpZ alone: stage 3's bits (4 ranks)
}


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"n{n}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"moe_rest_n{request.param}")
    return request.param, out, run_mpi(RANKS_DIR / "moe_rest_checks.py", request.param,
                                       args=[out], timeout=300)


@pytest.fixture(scope="module")
def references():
    """One process on the whole batch, without offload: every step's update at once, and
    the delayed update (DPU) after its warm-up."""
    section, steps = zero_checks.MOE, checks.STEPS
    args = (section, checks.ACCUMULATION, checks.CLIP, steps)
    init = {k: p.data.copy() for k, p in GPT(zero_checks.GPT_CONFIG, seed=0, dtype=np.float64,
                                             moe=section).named_parameters()}
    return {"now": moe_reference(*args)[:2], "init": init,
            "delayed": moe_reference(*args, delay_after=checks.DPU_WARMUP)[:2]}


@pytest.mark.mpi
def test_offload_at_ep2_changes_nothing(run):
    """Optimizer offload (host, NVMe) and parameter offload at stages 1-3 hold the expert
    states where the engine's are (the expert strategy's flags), and train exactly as the
    same layout without offload: the losses, the gathered parameters, and this rank's
    expert master weights and Adam moments, bit for bit; so does hpZ at stage 3. In every
    case, the ledger's model states on the device and on the host are what the two
    strategies declare, and the expert strategy's groups are counted in their own kinds:
    what sent bytes is what is declared."""
    n, _, reports = run
    hybrid, hpz = ["experts_replica", "experts_shard", "replica", "shard"], [
        "experts", "experts_intra", "intra", "world"]  # hpZ over all of edp: no inter group
    kinds = {"stage3_hybrid1": hybrid, "stage3_hybrid2": hybrid, "stage3_hpz": hpz,
             "stage3_zeropp": sorted(hpz + ["inter"])}
    for r in reports:
        got = r["offload"]
        for name, case in got.items():
            for device, (held, declared) in case["ledger"].items():
                assert held == declared, f"n={n} rank {r['rank']} {name} {device}"
            expected, sent = case["traffic"]
            assert sorted(expected) == sorted(sent) == kinds.get(name, ["experts", "world"])
            assert all((sent[k] > 0) == (expected[k] > 0) for k in sent), (name, sent)
        for name, (plain, flags) in ((k, v) for k, v in SAME_AS.items() if k in got):
            where = f"n={n} rank {r['rank']} {name}"
            assert got[name]["expert_offload"] == flags, where
            for key in ("losses", "params", "expert_states"):
                assert got[name][key] == got[plain][key], f"{where}: {key} differs"


ESTIMATED = {  # case: zmpi estimate's offload flags for it (host offload; the estimate has
    "stage1": [],  # neither the NVMe tier nor the delayed update's second gradient buffer)
    "stage1_optimizer": ["--offload-optimizer"],
    "stage2_optimizer": ["--offload-optimizer"],
    "stage3_optimizer+param": ["--offload-optimizer", "--offload-param"],
}


@pytest.mark.mpi
def test_estimate_with_offload_is_the_ledger(run):
    """`zmpi estimate --moe` with the offload flags at ep 2 on the run's layout (fp64:
    --param-bytes 8 --optimizer-bytes 24) against each rank's ledger after training, on the
    device and on the host apart: the dense and the expert states placed alike
    (zmpi.memory.estimate_rows), what is held equal to the estimate up to the flat buffers'
    padding (under 40 bytes an element, fewer than n elements per unit, as
    test_zero.py's test_moe_estimate_is_the_ledger_at_ep bounds the whole)."""
    import json
    import subprocess

    from mpi_util import REPO_ROOT

    from zmpi.config import MoEConfig

    n, _, reports = run
    config = zero_checks.GPT_CONFIG
    units = config.n_layer + 2 + len(MoEConfig.from_dict(zero_checks.MOE).layer_experts(
        config.n_layer))  # the dense units and the expert strategy's
    for name, flags in ESTIMATED.items():
        stage = checks.cases("", n)[name][0]
        out = subprocess.run(
            [sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", str(config.n_layer),
             "--d-model", str(config.d_model), "--vocab-size", str(config.vocab_size),
             "--seq-len", str(config.seq_len), "--world-size", str(n), "--stage", str(stage),
             "--param-bytes", "8", "--optimizer-bytes", "24", "--json", *flags,
             "--moe", json.dumps({**zero_checks.MOE, "ep_size": 2})],
            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        [row] = json.loads(out.stdout)["stages"]
        for r in reports:
            for device, (held, _) in r["offload"][name]["ledger"].items():
                estimated = row[f"{device}_gb"] * 1e9
                where = f"n={n} rank {r['rank']} {name} {device}: held {held}, {estimated:.0f}"
                assert 0 <= held - round(estimated) < 40 * n * units, where


@pytest.mark.mpi
def test_offload_at_ep2_trains_as_one_process(run, references):
    """Every case, offloaded or not, DPU included (against one process that applies each
    update one step late after the warm-up, which differs from the undelayed run by more
    than 1e-4), hybrid sharding and hpZ too, ends with one process's parameters, each
    element within the bounds tests/test_offload.py holds the dense DPU to (rtol 1e-9, atol
    1e-12; measured 4e-14 of the largest), after one process's losses (1e-12). ZeRO++ with
    quantized weights and gradients: within the bounds test_zero holds it to (the model's
    distance from the reference within 0.8 of its move, the losses within 1e-2)."""
    n, out, reports = run
    now, delayed = references["now"][0], references["delayed"][0]
    assert max(np.abs(now[k] - delayed[k]).max() for k in now) > 1e-4  # the delay matters
    for name in checks.cases(out, n):
        dpu, quantized = name.endswith("_dpu"), name.endswith("_zeropp")
        ref, ref_losses = references["delayed" if dpu else "now"]
        with np.load(out / f"{name}.npz") as f:
            got = dict(f)
        assert sorted(got) == sorted(ref), name
        if quantized:
            move = _parity_errors(got, references["init"], ref)[2]
            assert move <= QUANTIZED_MODEL_MOVE_RTOL, f"n={n} {name}: {move:.2e} of the move"
        for key, want in () if quantized else ref.items():
            np.testing.assert_allclose(got[key], want, rtol=1e-9, atol=1e-12,
                                       err_msg=f"n={n} {name}: {key}")
        for r in reports:
            np.testing.assert_allclose(
                r["offload"][name]["losses"], ref_losses, err_msg=f"n={n} {name}",
                rtol=QUANTIZED_LOSS_RTOL if quantized else LOSS_RTOL["fp64"])
            if dpu:
                assert r["offload"][name]["delayed_steps"] == checks.STEPS - checks.DPU_WARMUP


@pytest.mark.mpi
def test_checkpoint_with_offload_or_hybrid_at_ep2_resumes(run):
    """A checkpoint saved with the optimizer on the host (stage 2), both states on NVMe
    (stage 3) or hybrid sharding at ep 2 resumes with the same config at ep 2 and at ep 1
    and continues the loss of the uninterrupted run."""
    n, _, reports = run
    for r in reports:
        for name in checks.RESUMED:
            want = r["offload"][name]["losses"][checks.RESUME_AT:]
            for ep in (2, 1):
                np.testing.assert_allclose(r["resume"][f"{name} ep {ep}"], want,
                                           rtol=LOSS_RTOL["fp64"], err_msg=f"n={n} {name} {ep}")


@pytest.mark.mpi
def test_check_replicas_names_a_diverged_expert_replica(run):
    """At (dp, ep) = (4, 2) ranks 1 and 3 hold the same experts: rank 3's changed copy of an
    expert parameter is named on every rank, the ranks 0 and 2 that compared nothing
    different included."""
    n, _, reports = run
    if n == 2:
        pytest.skip("each expert is on one rank at (dp, ep) = (2, 2): no replica to compare")
    for r in reports:
        assert r["diverged"] == (
            "replicas diverged after step 1: params (the experts) of unit 1 (Block) differs "
            "between the ranks of the expert-data-parallel group: ranks [1] hold copy 0; "
            "ranks [3] hold copy 1"), r["rank"]


def test_unit_model_inference_routes_as_in_evaluation():
    """UnitModel.inference (not only the GPT's) turns every MoE layer's training routing off
    and back to what it was, nested or after an error."""
    layer = MoE(8, num_experts=2, seed=0, rng=0)
    model = UnitModel([layer])
    with model.inference():
        assert not layer.training and not layer.router.training
        with model.inference():
            assert not layer.training
        assert not layer.training
    assert layer.training and layer.router.training
    with pytest.raises(KeyError), model.inference():
        raise KeyError
    assert layer.training
    layer.training = False  # a layer already in evaluation stays there
    with model.inference():
        pass
    assert not layer.training


@pytest.mark.mpi
def test_a_hybrid_group_larger_than_the_expert_replicas_is_one_line(run):
    """Hybrid groups of 2 at (dp, ep) = (2, 2), where each expert is on one rank: refused on
    every rank, naming the key and the expert-data-parallel size."""
    n, _, reports = run
    if n == 4:
        pytest.skip("groups of 2 fit the 2 ranks holding the same experts at (4, 2)")
    for r in reports:
        assert r["refused"] == (
            "zero_optimization.shard_group_size: 2 does not divide the 1 rank into equal shard "
            "groups (for the expert parameters: their groups are cut inside the dp / "
            "moe.ep_size = 1 ranks holding the same experts)"), r["rank"]

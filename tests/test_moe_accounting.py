"""The accounting of MoE blocks against what a run measures (docs/moe.md, "Checkpoints and
accounting"): the activations an MoE layer keeps (models/moe_counts.py, through
zmpi.models.gpt_counts.gpt_activation_bytes) byte for byte against the ledger's peak, as
tests/test_activation_memory.py holds the dense GPT; the all-to-all and expert-data-parallel
traffic of one training step at ep 2 against the counters of the "ep" and "edp" dimensions
(tests/ranks/moe_accounting_checks.py, one launch of 4 ranks); `zmpi estimate --moe
--micro-batch`, which prints both; and `zmpi train`'s size check, which counts the experts."""
import json

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi

from zmpi.cli import main
from zmpi.config import MoEConfig
from zmpi.memory import MemoryLedger, comm_volume_elements
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_activation_bytes
from zmpi.models.moe_counts import moe_alltoall
from zmpi.nn.module import activations_counted_in

SHAPE = {"vocab_size": 11, "n_layer": 2, "n_head": 2, "d_model": 8}
SECTIONS = {  # every array the layer may keep: top-1, top-2, PR-MoE with a shared expert
    "top1": {"num_experts": 4},  # and drops, Jitter's factors, dropless, a pyramid
    "top2": {"num_experts": 4, "k": 2},
    "residual": {"num_experts": 3, "k": 2, "use_residual": True, "num_shared_experts": 1,
                 "capacity_factor": 0.5},
    "jitter": {"num_experts": 4, "noisy_gate_policy": "Jitter", "moe_layer_interval": 2},
    "dropless": {"num_experts": [2, 4], "k": 2, "drop_tokens": False},
}
T, B = 16, 2


def _measure(section, policy, dtype):
    """The ledger's activation peak of one forward and backward of a bare GPT with the
    section's MoE blocks, and each MoE block's kept assignments."""
    model = GPT(GPTConfig(seq_len=T, **SHAPE), seed=0, dtype=dtype, moe=section)
    model.set_recompute(policy)
    for layer in model.moe_layers():
        layer.set_routing((0,), 0)
    rng = np.random.default_rng(1)
    V = SHAPE["vocab_size"]
    ids, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))  # arrays of their own
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        model.forward_loss(ids, targets)
        model.backward_loss()
    assert ledger.current("activation") == 0
    blocks = MoEConfig.from_dict(section).layer_experts(SHAPE["n_layer"])
    kept = {i: int(layer.routing.kept.sum()) for i, layer in zip(blocks, model.moe_layers(),
                                                                  strict=True)}
    return ledger.peak("activation"), kept


@pytest.mark.parametrize("policy", ("none", "full"))
@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("fp32", "fp64"))
@pytest.mark.parametrize("name", SECTIONS)
def test_moe_activations_are_the_ledgers_peak(name, dtype, policy):
    """Exact with the routing's kept assignments; the bound (every capacity slot filled, what
    `zmpi estimate` prints) at least that, and exact dropless (every assignment kept: k n
    rows in one process)."""
    section = SECTIONS[name]
    peak, kept = _measure(section, policy, dtype)
    shape = (SHAPE["n_layer"], SHAPE["d_model"], SHAPE["n_head"], SHAPE["vocab_size"], T, B,
             np.dtype(dtype).itemsize)
    exact = gpt_activation_bytes(*shape, recompute=policy, moe=section, kept_rows=kept)
    assert peak == exact["device"]
    bound = gpt_activation_bytes(*shape, recompute=policy, moe=section)["device"]
    assert bound >= peak
    if not section.get("drop_tokens", True):
        assert bound == peak
    dense = gpt_activation_bytes(*shape, recompute=policy)
    assert exact["blocks"] != [dense["layer"]] * SHAPE["n_layer"]


@pytest.fixture(scope="module")
def ep_run():
    """tests/ranks/moe_accounting_checks.py on 4 ranks: one step of each of its CASES."""
    return run_mpi(RANKS_DIR / "moe_accounting_checks.py", 4, timeout=180)


def _estimate(capsys, section, stage, recompute, *flags):
    """`zmpi estimate --json` of the rank script's GPT (fp32, 4 ranks, micro-batch 2)."""
    import moe_accounting_checks as checks

    c = checks.SHAPE
    main(["estimate", "--n-layer", str(c.n_layer), "--d-model", str(c.d_model),
          "--vocab-size", str(c.vocab_size), "--seq-len", str(c.seq_len), "--n-head",
          str(c.n_head), "--world-size", "4", "--stage", str(stage), "--precision", "fp32",
          "--param-bytes", "4", "--micro-batch", str(checks.MICRO_BATCH), "--recompute",
          recompute, "--moe", json.dumps(section), "--json", *flags])
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def rank_script_cases(monkeypatch):
    monkeypatch.syspath_prepend(str(RANKS_DIR))
    import moe_accounting_checks as checks

    return checks


@pytest.mark.mpi
def test_alltoall_and_edp_traffic_are_the_formula(ep_run, rank_script_cases, capsys):
    """At (dp, ep) = (4, 2) one step's "ep" counters are the all-to-alls of `moe_alltoall` per
    micro-batch (4 per MoE layer, 6 with full recompute; E x G x capacity x C elements each,
    half of them sent; dropless at most that, plus one allreduce_scalar per forward), and the
    "edp" counters the ZeRO traffic of each rank's Psi_experts / ep over the 2 ranks holding
    the same experts (2 passes, 3 at stage 3): both what `zmpi estimate --moe --micro-batch`
    prints."""
    checks = rank_script_cases
    for name, (stage, accumulation, recompute, section) in checks.CASES.items():
        estimate = _estimate(capsys, section, stage, recompute)
        a2a = moe_alltoall(checks.SHAPE.n_layer, checks.SHAPE.d_model, checks.SHAPE.seq_len,
                           checks.MICRO_BATCH, section, recompute)
        assert estimate["alltoall"] == a2a and a2a["calls"] > 0
        [row] = estimate["stages"]
        for r in ep_run:
            got, where = r["cases"][name], f"{name} rank {r['rank']}"
            assert (got["ep"], got["edp"]) == (2, 2), where
            ep = got["traffic"]["ep"]
            assert {op for op, c in ep.items() if c["calls"]} == (
                {"alltoall"} if section.get("drop_tokens", True) else
                {"alltoall", "allreduce_scalar"}), where
            assert ep["alltoall"]["calls"] == accumulation * a2a["calls"], where
            assert ep["allreduce_scalar"]["calls"] == accumulation * a2a["scalar_calls"]
            if a2a["upper_bound"]:  # dropless: the busiest expert's capacity, at most S
                assert 0 < ep["alltoall"]["bytes"] <= accumulation * 4 * a2a["elements"]
                assert ep["alltoall"]["sent"] * 2 == ep["alltoall"]["bytes"], where
            else:
                assert ep["alltoall"]["bytes"] == accumulation * 4 * a2a["elements"], where
                assert ep["alltoall"]["sent"] == accumulation * 4 * a2a["sent_elements"]
            edp_sent = sum(c["sent"] for c in got["traffic"]["edp"].values())
            assert edp_sent == 4 * comm_volume_elements(got["experts"], 2, stage), where
            assert edp_sent == 4 * row["expert_traffic_elements"], where


@pytest.mark.mpi
def test_expert_parallel_activations_are_the_ledgers_peak(ep_run, rank_script_cases,
                                                          capsys):
    """At ep 2 the experts run on every slot of the capacity buffers (E G capacity rows) and
    each rank keeps its rows' places and the outputs they got back: the ledger's peak over the
    step's micro-batches is the count with each micro-batch's kept assignments (plus, with
    gradient accumulation, the step's other token ids and targets: the micro-batches' are
    views of them), at most the bound `zmpi estimate` prints; dropless at most the bound."""
    checks = rank_script_cases
    c = checks.SHAPE
    for name, (stage, accumulation, recompute, section) in checks.CASES.items():
        blocks = list(MoEConfig.from_dict(section).layer_experts(c.n_layer))
        shape = (c.n_layer, c.d_model, c.n_head, c.vocab_size, c.seq_len, checks.MICRO_BATCH)
        bound = _estimate(capsys, section, stage, recompute)["activation"]["zmpi"]["device"]
        assert bound == gpt_activation_bytes(*shape, recompute=recompute, moe=section)["device"]
        views = 2 * 8 * (accumulation - 1) * checks.MICRO_BATCH * c.seq_len
        for r in ep_run:
            got, where = r["cases"][name], f"{name} rank {r['rank']}"
            assert got["activation"] <= bound + views, where
            if section.get("drop_tokens", True):
                exact = max(gpt_activation_bytes(
                    *shape, recompute=recompute, moe=section,
                    kept_rows=dict(zip(blocks, kept, strict=True)))["device"]
                    for kept in got["kept"])
                assert got["activation"] == exact + views, where


def test_estimate_prints_moe_activations_and_alltoall(capsys):
    """The text output: the all-to-all line at ep above 1 only, the MoE blocks' activations."""
    flags = ["estimate", "--n-layer", "4", "--d-model", "64", "--vocab-size", "100",
             "--seq-len", "32", "--world-size", "4", "--micro-batch", "2", "--stage", "1"]
    main([*flags, "--moe", '{"num_experts": 4, "ep_size": 2}'])
    text = capsys.readouterr().out
    a2a = moe_alltoall(4, 64, 32, 2, {"num_experts": 4, "ep_size": 2})
    assert a2a["calls"] == 16  # 4 MoE blocks, 4 all-to-alls each
    assert (f"expert-parallel all-to-all per step and micro-batch, over ep = 2 ranks: 16 calls "
            f"of capacity buffers, {a2a['elements']:.4g} elements") in text
    main([*flags, "--moe", "4"])
    assert "all-to-all" not in capsys.readouterr().out


def test_train_size_check_counts_the_experts(tmp_path, monkeypatch, capsys):
    """On a machine of 16 MiB the states of 2 blocks of d_model 64 fit as a dense GPT (16 bytes
    a parameter: 1.6 MB), not with 256 experts in each (2 x 256 x (8 d^2 + 5 d): 271 MB): one
    line naming the experts, before the model is built."""
    from zmpi.cli import inputs

    monkeypatch.setattr(inputs, "_host_memory", lambda: 16 * 2**20)
    with pytest.raises(SystemExit) as e:
        main(["train", "--n-layer", "2", "--d-model", "64", "--n-head", "2", "--seq-len", "8",
              "--batch", "1", "--steps", "1", "--sample-tokens", "0", "--moe-experts", "256",
              "--out", str(tmp_path / "run")])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, line
    params = 65 * 64 + 8 * 64 + 2 * (4 * 64 * 64 + 8 * 64 + 64 * 256 + 256 * (8 * 64 * 64 + 5 * 64))
    assert line.startswith(f"zmpi train: the model (n_layer 2, d_model 64, vocab_size 65, "
                           f"moe.num_experts 256: {params + 2 * 64:,} parameters) needs at least")
    assert line.endswith("check --n-layer, --d-model, model.vocab_size and moe.num_experts")

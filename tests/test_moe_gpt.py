"""A GPT with mixture-of-experts blocks, trained by the engine at expert-parallel degree 1
(docs/moe.md): the model's MoE blocks, the `moe` config section and its refusals (those of
ep_size above 1 included), what the engine tells each layer, the parameter counts, the `zmpi
train` flags and a checkpoint saved at dp 2 (stage 3) resumed at dp 1. Parity with one process
under ZeRO 0-3 at every world size, expert parallel where the experts allow, is in the shared
suite (tests/test_zero.py, test_moe_gpt_trains_as_one_process)."""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import CLI, REPO_ROOT, launch_mpi

from zmpi.checkpoint import CheckpointError, tools
from zmpi.checkpoint.manifest import _body_crc, read_manifest
from zmpi.config import Config, ConfigError, MoEConfig
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_expert_numel, gpt_num_params, gpt_unit_numels
from zmpi.nn.layers import MLP
from zmpi.nn.moe import MoE

SMALL = GPTConfig(vocab_size=16, seq_len=8, n_layer=3, n_head=2, d_model=16)
SECTIONS = [  # the counting covers each kind of MoE block
    {"num_experts": 4},
    {"num_experts": 4, "k": 2, "moe_layer_interval": 2},
    {"num_experts": [2, 8], "layers": [2, 0], "use_residual": True},  # block 2: 2, block 0: 8
    {"num_experts": 3, "layers": [1], "num_shared_experts": 2},
]


def _engine_config(section=None, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW",
                                                               "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 0}, **extra}
    if section is not None:
        cfg["moe"] = section
    return cfg


@pytest.mark.parametrize("section", SECTIONS, ids=range(len(SECTIONS)))
def test_moe_blocks_where_the_section_says_with_their_counts(section):
    """MoE blocks replace the MLP of the blocks named (every interval-th, or the list), each
    with its own expert count and random stream; the parameter count of gpt_num_params (and
    per unit) is what the model holds, and what the engine's layout and ledger hold."""
    model = GPT(SMALL, moe=section)
    layers = MoEConfig.from_dict(section).layer_experts(SMALL.n_layer)
    for i, block in enumerate(model.units[1:-1]):
        if i in layers:
            assert isinstance(block.mlp, MoE) and block.mlp.router.num_experts == layers[i]
        else:
            assert isinstance(block.mlp, MLP)
    assert [layer.router.seed for layer in model.moe_layers()] == sorted(layers)
    if "layers" in section and isinstance(section["num_experts"], list):
        assert layers == dict(zip(section["layers"], section["num_experts"], strict=True))
    held = [sum(p.data.size for _, p in unit.named_parameters()) for unit in model.units]
    assert held == gpt_unit_numels(3, 16, 16, 8, moe=section)
    engine = Engine(model, _engine_config(section))
    assert engine.num_params == sum(held) == gpt_num_params(3, 16, 16, 8, moe=section)
    assert engine.memory.current("param", "device") == 4 * sum(held)  # fp32, stage 0


def test_a_dense_gpt_is_unchanged():
    """moe None or an empty section builds the dense GPT, parameter for parameter."""
    dense = dict(GPT(SMALL).named_parameters())
    for moe in (None, {}):
        built = dict(GPT(SMALL, moe=moe).named_parameters())
        assert sorted(built) == sorted(dense)
        assert all(np.array_equal(built[k].data, dense[k].data) for k in dense)
        assert GPT(SMALL, moe=moe).moe_layers() == []


BAD = [  # (moe section, other config keys, the one line)
    ({"k": 2}, {}, "moe.k: acts on MoE layers: give moe.num_experts too"),
    ({"num_experts": 0}, {}, "moe.num_experts: must be an integer >= 1"),
    ({"num_experts": [4, 0]}, {}, "moe.num_experts: must be an integer >= 1"),
    ({"num_experts": [4, 6], "ep_size": 4}, {}, "moe.ep_size: 4 does not divide num_experts 6"),
    ({"num_experts": 4, "ep_size": 2}, {"zero_optimization": {"strategy": "my_plugin"}},
     "zero_optimization.strategy: 'my_plugin' is not built with moe.ep_size 2"),
    ({"num_experts": 4, "ep_size": 2}, {"optimizer": {"type": "OneBitAdam"}},
     "optimizer.type: OneBitAdam is not built with moe.ep_size 2"),
    ({"num_experts": 4, "k": 5}, {}, "moe.k: 5 experts per token, but a layer has only 4"),
    ({"num_experts": 4, "noisy_gate_policy": "Gumbel"}, {}, "moe.noisy_gate_policy: 'Gumbel'"),
    ({"num_experts": 4, "capacity_factor": 0}, {}, "moe.capacity_factor: must be > 0"),
    ({"num_experts": 4, "min_capacity": -1}, {}, "moe.min_capacity: must be >= 0"),
    ({"num_experts": 4, "aux_loss_coef": -0.1}, {}, "moe.aux_loss_coef: must be >= 0"),
    ({"num_experts": 4, "layers": [0, 0]}, {}, "moe.layers: lists a block twice"),
    ({"num_experts": 4, "layers": [1], "moe_layer_interval": 2}, {},
     "moe.moe_layer_interval: give moe_layer_interval or layers, not both"),
    ({"num_experts": 4, "top2_2nd_expert_sampling": True}, {},
     "moe.top2_2nd_expert_sampling: samples the choices after the first: it needs k >= 2"),
    ({"num_experts": 4, "drop_tokens": "yes"}, {}, "moe.drop_tokens: expected bool"),
    ({"num_experts": 4, "use_tutel": True}, {}, "moe.use_tutel: unknown key"),
]


@pytest.mark.parametrize("section,other,message", BAD, ids=range(len(BAD)))
def test_every_bad_moe_key_is_one_line_naming_it(section, other, message):
    from zmpi.config import moe as moe_config
    from zmpi.nn.moe import NOISY_GATE_POLICIES

    assert moe_config.NOISY_GATE_POLICIES == NOISY_GATE_POLICIES  # the layer's, as it takes them
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"moe": section, **other})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_an_expert_split_of_more_ranks_than_data_ranks_is_one_line():
    """ep must divide the data-parallel size: refused as the mesh is built, before any
    collective (one process: dp 1)."""
    section = {"num_experts": 4, "ep_size": 2}
    with pytest.raises(ValueError) as e:
        Engine(GPT(SMALL, moe=section), _engine_config(section))
    assert str(e.value).startswith("ep=2 does not divide the data-parallel size (1 rank)")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("section,message", [
    ({"num_experts": 4, "layers": [3]}, "moe.layers: block 3 is not in a model of 3 blocks"),
    ({"num_experts": 4, "moe_layer_interval": 4},
     "moe.moe_layer_interval: 4 puts no MoE layer in a model of 3 blocks"),
    ({"num_experts": [4, 4]}, "moe.num_experts: 2 counts for 3 MoE blocks"),
])
def test_a_section_that_does_not_fit_the_model_is_one_line(section, message):
    Config.from_dict({"moe": section})  # valid on its own
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        GPT(SMALL, moe=section)


def test_the_engine_refuses_a_model_the_moe_section_did_not_build():
    section = {"num_experts": 4}
    with pytest.raises(ConfigError, match="^moe: the config gives .* but the model was built "
                       "with no MoE; build it as GPT"):
        Engine(GPT(SMALL), _engine_config(section))
    with pytest.raises(ConfigError, match="^moe: the config has none but the model was built "
                       "with"):
        Engine(GPT(SMALL, moe=section), _engine_config())
    with pytest.raises(ConfigError, match="^moe: the config gives"):
        Engine(GPT(SMALL, moe={"num_experts": 2}), _engine_config(section))


def test_the_engine_routes_scales_and_reports_the_moe_losses():
    """Before each micro-batch the engine sets training, the key (step,), the global index of
    the micro-batch's first sequence and aux_loss_scale = the loss scale (fp16's 2^8 here);
    the reported loss is the cross-entropy plus every layer's auxiliary and z losses; eval
    routes without random draws (the same loss twice) and training resumes after it."""
    section = {"num_experts": 4, "k": 2, "noisy_gate_policy": "RSample", "z_loss_coef": 0.01}
    model = GPT(SMALL, moe=section)
    engine = Engine(model, _engine_config(section, gradient_accumulation_steps=2,
                                          fp16={"enabled": True, "initial_scale_power": 8}))
    seen, losses = [], engine.moe.losses

    def recording():
        seen.append([(layer.router.routing_key, layer.router.group_offset,
                      layer.aux_loss_scale, layer.training,
                      float(layer.aux_loss + layer.z_loss)) for layer in model.moe_layers()])
        return losses()

    engine.moe.losses = recording
    x, y = SyntheticSource(16, 8, 8, seed=1).sample(0)
    reported = engine.train_step(x, y)
    assert [[s[:4] for s in micro] for micro in seen] == [
        [((0,), 0, 256.0, True)] * 3, [((0,), 4, 256.0, True)] * 3]
    aux = sum(s[4] for micro in seen for s in micro) / 2
    alone = GPT(SMALL, moe=section)  # the same initial weights, fp32, routed as the engine did
    cross_entropy = []
    for rows, offset in ((slice(0, 4), 0), (slice(4, 8), 4)):
        for layer in alone.moe_layers():
            layer.set_routing((0,), offset)
        cross_entropy.append(alone.loss(x[rows], y[rows]))
    assert aux > 0
    assert reported == pytest.approx(np.mean(cross_entropy) + aux, rel=1e-2)
    assert abs(reported - np.mean(cross_entropy)) > 0.1 * aux  # the aux losses are in it
    first = engine.eval_loss(x, y)
    assert engine.eval_loss(x, y) == first
    assert all(layer.training for layer in model.moe_layers())


def test_the_engine_counts_each_layers_load_and_drops_over_the_steps_micro_batches():
    """engine.moe.statistics: per MoE layer the assignments routed to each expert before
    drops and those over capacity, summed over the step's 2 micro-batches: what one process
    routing the same rows counts; k assignments a token in all; the next step starts again
    from 0, a step that fp16 skips (its optimizer step count unchanged) too, and a recompute
    (full activation checkpointing) does not count twice."""
    from zmpi.comm import Comm

    section = {"num_experts": 4, "k": 2, "capacity_factor": 0.5, "min_capacity": 0}
    engine = Engine(GPT(SMALL, moe=section), _engine_config(
        section, gradient_accumulation_steps=2,
        activation_checkpointing={"recompute": "full"}))
    with pytest.raises(ValueError, match="^no MoE routing tallied since the last"):
        engine.moe.statistics(Comm())
    x, y = SyntheticSource(16, 8, 8, seed=1).sample(0)
    alone = GPT(SMALL, moe=section)  # the initial weights: step 0's routing
    want = [(np.zeros(4, np.int64), 0) for _ in alone.moe_layers()]
    for rows, offset in ((slice(0, 4), 0), (slice(4, 8), 4)):
        for layer in alone.moe_layers():
            layer.set_routing((0,), offset)
        alone.loss(x[rows], y[rows])
        want = [(load + layer.routing.load, dropped + int(layer.routing.dropped))
                for (load, dropped), layer in zip(want, alone.moe_layers(), strict=True)]
    engine.train_step(x, y)
    got = engine.moe.statistics(Comm())
    assert len(got) == 3 and all(load.sum() == 2 * 8 * 8 for load, _ in got)  # k per token
    assert all(dropped > 0 for _, dropped in got)  # capacity 2 of a group's 4 per expert
    for (load, dropped), (want_load, want_dropped) in zip(got, want, strict=True):
        assert load.tolist() == want_load.tolist() and dropped == want_dropped
    engine.train_step(x, y)
    assert all(load.sum() == 2 * 8 * 8 for load, _ in engine.moe.statistics(Comm()))
    with pytest.raises(ValueError, match="^no MoE routing tallied since the last"):
        engine.moe.statistics(Comm())
    skipping = Engine(GPT(SMALL, moe=section), _engine_config(
        section, fp16={"enabled": True, "initial_scale_power": 60}))
    for _ in range(2):  # 2^60 overflows float16: both steps skipped, global_steps stays 0
        skipping.train_step(x[:4], y[:4])
        assert all(load.sum() == 2 * 4 * 8 for load, _ in skipping.moe.statistics(Comm()))
    assert skipping.global_steps == 0 and skipping.scaler.skipped_steps == 2


def test_moe_flags_build_the_moe_section(tmp_path):
    from test_cli import _args

    from zmpi.cli.config_from_flags import build_config

    args = _args(moe_experts=8, moe_k=2, moe_interval=2, moe_capacity_factor=1.25)
    assert build_config(args, 2)["moe"] == {"num_experts": 8, "k": 2, "moe_layer_interval": 2,
                                            "capacity_factor": 1.25}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"moe": {"num_experts": 4, "use_residual": True}}))
    notes = []
    cfg = build_config(_args(config=str(path), moe_experts=2), 1, notes)
    assert cfg["moe"] == {"num_experts": 2, "use_residual": True}
    assert notes == ["--moe-experts overrides the config's moe.num_experts = 4 with 2"]


def test_zmpi_estimate_counts_the_experts():
    def psi(*flags):
        out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", "4",
                              "--d-model", "64", "--vocab-size", "100", "--seq-len", "32",
                              "--world-size", "2", "--json", *flags], capture_output=True,
                             text=True, cwd=REPO_ROOT, timeout=60)
        return out.returncode, (json.loads(out.stdout)["params"] if out.returncode == 0
                                else out.stderr.strip())

    section = {"num_experts": 4, "moe_layer_interval": 2, "use_residual": True}
    assert psi() == (0, gpt_num_params(4, 64, 100, 32))
    assert psi("--moe", json.dumps(section)) == (0, gpt_num_params(4, 64, 100, 32, moe=section))
    assert psi("--moe", "8") == (0, gpt_num_params(4, 64, 100, 32, moe={"num_experts": 8}))
    assert psi("--moe", "8", "--tp", "2") == (0, gpt_num_params(4, 64, 100, 32, 2,
                                                              moe={"num_experts": 8}))
    code, said = psi("--moe", "8", "--tp", "2", "--micro-batch", "1")
    assert code == 2 and said == ("zmpi estimate: --moe 8: --micro-batch counts the MoE blocks' "
                                  "activations and all-to-all at --tp 1 only: leave out "
                                  "--micro-batch, or give --tp 1")
    code, said = psi("--moe", '{"num_experts": 4, "layers": [9]}')
    assert code == 2 and "moe.layers: block 9 is not in a model of 4 blocks" in said
    code, said = psi("--moe", '{"num_experts": 4, "ep_size": 4}')
    assert code == 2 and said == ('zmpi estimate: --moe {"num_experts": 4, "ep_size": 4}: '
                                  'ep_size 4 does not divide the data-parallel size 2 '
                                  '(--world-size)')
    code, said = psi("--moe", '{"num_experts": 4, "ep_size": 2}', "--tp", "2")
    assert code == 2 and said.endswith("ep_size 2 does not divide the data-parallel size 1 "
                                       "(--world-size / --tp)")
    # offload at ep above 1 is built: the expert states placed as the dense ones (the ledger
    # at one layout: tests/test_moe_engine_rest.py, test_estimate_with_offload_is_the_ledger)
    assert psi("--moe", '{"num_experts": 4, "ep_size": 2}', "--offload-optimizer")[0] == 0


def test_zmpi_estimate_at_ep_counts_expert_states_over_ep_and_dp_over_ep():
    """--moe with ep_size E on N ranks: the dense parameters' states per rank by ZeRO over
    N, each rank's Psi_experts / E expert parameters' over the N / E ranks holding the same
    experts (docs/moe.md's table), e.g. stage 3 (2 + 2 + K) (Psi_dense + Psi_experts / E) / N;
    at E = 1 the dense count of the whole model. The engine's ledger against the same formula
    is in tests/test_zero.py (test_moe_estimate_is_the_ledger_at_ep)."""
    from zmpi.memory import model_state_bytes

    section = {"num_experts": 8, "moe_layer_interval": 2, "use_residual": True}
    psi = gpt_num_params(4, 64, 100, 32, moe=section)
    experts = 2 * 8 * (8 * 64 * 64 + 5 * 64)  # two MoE blocks of 8 experts
    assert gpt_expert_numel(4, 64, section) == experts
    for ep, n in ((1, 8), (2, 8), (4, 8), (8, 8), (2, 2)):
        out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", "4",
                              "--d-model", "64", "--vocab-size", "100", "--seq-len", "32",
                              "--world-size", str(n), "--json", "--moe",
                              json.dumps({**section, "ep_size": ep})],
                             capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
        got = json.loads(out.stdout)
        assert (got["params"], got["ep"]) == (psi, ep)
        assert got["expert_params"] == (experts if ep > 1 else 0)
        for row in got["stages"]:
            stage = row["stage"]
            want = model_state_bytes(psi, n, stage) if ep == 1 else \
                model_state_bytes(psi - experts, n, stage) + \
                model_state_bytes(experts / ep, n // ep, stage)
            assert row["device_gb"] == pytest.approx(want / 1e9, rel=1e-12), (ep, n, stage)


@pytest.mark.parametrize("section", SECTIONS)
def test_each_tensor_rank_holds_the_moe_block_count(section):
    """Under tensor parallelism every tensor rank of a GPT with MoE blocks holds
    gpt_unit_numels(..., tp)'s parameters per unit (moe_block_numel: every expert, PR-MoE's
    residual MLP and the shared experts split as the dense MLP, the router and coefficient
    whole) and gpt_expert_numel(..., tp) of the experts' (what the expert strategy holds
    before ep splits it). One process: the tensor group's rank and size are all that
    building the model reads of it (zmpi.parallel.expert.tensor); the engine's runs at tp 2
    are tests/test_moe_tensor.py's."""
    from types import SimpleNamespace

    config = GPTConfig(vocab_size=16, seq_len=8, n_layer=3, n_head=4, d_model=16,
                       vocab_multiple=1)
    for tp in (2, 4):
        for rank in range(tp):
            model = GPT(config, tp=SimpleNamespace(rank=rank, size=tp), moe=section)
            held = [sum(p.data.size for _, p in unit.named_parameters()) for unit in model.units]
            assert held == gpt_unit_numels(3, 16, 16, 8, tp, moe=section), (tp, rank)
            experts = sum(p.data.size for layer in model.moe_layers()
                          for _, p in layer.experts.named_parameters())
            assert experts == gpt_expert_numel(3, 16, section, tp), (tp, rank)


def test_zmpi_estimate_with_tp_and_ep_counts_each_tensor_ranks_share():
    """--moe with --tp 2 and ep_size 2 on 8 ranks: Psi is a tensor rank's share of the model
    (gpt_num_params at tp 2), its experts' states over the 4 / 2 data-parallel ranks holding
    the same experts and the dense ones' over the 4; with --offload-optimizer both placed as
    ZeRO-Offload places them (zmpi.memory.model_state_placement, group by group)."""
    from zmpi.memory import model_state_bytes, model_state_placement

    section = {"num_experts": 4, "moe_layer_interval": 2, "use_residual": True,
               "num_shared_experts": 1, "ep_size": 2}
    psi = gpt_num_params(4, 64, 100, 32, 2, moe=section)
    experts = gpt_expert_numel(4, 64, section, 2)
    assert experts == 2 * 4 * ((8 * 64 * 64 + 4 * 64) // 2 + 64)  # two MoE blocks of 4

    def estimate(*flags):
        out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", "4",
                              "--d-model", "64", "--vocab-size", "100", "--seq-len", "32",
                              "--world-size", "8", "--tp", "2", "--json", "--moe",
                              json.dumps(section), *flags],
                             capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    got = estimate()
    assert (got["params"], got["expert_params"], got["dp"], got["ep"]) == (psi, experts, 4, 2)
    for row in got["stages"]:
        want = model_state_bytes(psi - experts, 4, row["stage"]) + \
            model_state_bytes(experts / 2, 2, row["stage"])
        assert row["device_gb"] == pytest.approx(want / 1e9, rel=1e-12), row
    for row in estimate("--offload-optimizer", "--stage", "2")["stages"]:
        places = [model_state_placement(p, n, 2, offload_optimizer=True)
                  for p, n in ((psi - experts, 4), (experts / 2, 2))]
        for where in ("device", "host"):
            want = sum(sum(place[where].values()) for place in places)
            assert row[f"{where}_gb"] == pytest.approx(want / 1e9, rel=1e-12), (where, row)


def _losses(run_dir):
    lines = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    return {int(line.split(",")[0]): float(line.split(",")[1]) for line in lines}


@pytest.mark.mpi
def test_train_with_moe_flags_and_resume_a_stage3_checkpoint_at_dp_1(tmp_path):
    """`zmpi train --moe-experts 4 --moe-k 2` on 2 ranks at stage 3 in fp64 saves the expert
    shards with the rest; 1 rank resumes its step-2 checkpoint and continues the loss as the
    2-rank run went on (every layout routes the same tokens); the first line counts the
    experts."""
    flags = ["--moe-experts", "4", "--moe-k", "2", "--moe-interval", "2", "--stage", "3",
             "--precision", "fp64", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
             "--seq-len", "16", "--batch", "4", "--steps", "4", "--sample-tokens", "5"]
    result = launch_mpi(CLI, 2, timeout=180, args=[
        "train", *flags, "--save-every", "2", "--out", tmp_path / "two"])
    assert result.returncode == 0, result.describe()
    vocab = 65  # Tiny Shakespeare's characters
    count = gpt_num_params(2, 16, vocab, 16, moe={"num_experts": 4, "k": 2,
                                                 "moe_layer_interval": 2})
    assert f"zmpi train: GPT {count:,} params, 2 ranks" in result.stdout, result.stdout
    resumed = launch_mpi(CLI, 1, timeout=180, args=[
        "train", *flags, "--resume", tmp_path / "two" / "checkpoints", "--resume-tag", "step2",
        "--out", tmp_path / "one"])
    assert resumed.returncode == 0, resumed.describe()
    assert "resumed from" in resumed.stdout and "saved by 2 ranks" in resumed.stdout
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert sorted(one) == [2, 3]
    for step in (2, 3):
        assert one[step] == pytest.approx(two[step], rel=1e-12, abs=0)


@pytest.mark.mpi
def test_train_writes_every_pipeline_stages_moe_load_and_drops(tmp_path):
    """At pipeline.stages 2 each stage holds one of the two MoE blocks: metrics.csv (written by
    rank 0, stage 0) has both layers' columns, and each layer's load sums to k x the step's
    tokens (the second stage's gathered to rank 0)."""
    config = tmp_path / "pp.json"
    config.write_text(json.dumps({"moe": {"num_experts": 2, "k": 2},
                                  "pipeline": {"stages": 2}}))
    result = launch_mpi(CLI, 2, timeout=180, args=[
        "train", "--config", config, "--n-layer", "2", "--d-model", "16", "--n-head", "2",
        "--seq-len", "16", "--batch", "4", "--steps", "2", "--sample-tokens", "0",
        "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    header, *rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    names = header.split(",")
    assert [n for n in names if n.startswith("moe")] == [
        f"moe{j}_{c}" for j in (0, 1) for c in ("dropped", "load0", "load1")]
    for row in rows:
        cells = dict(zip(names, row.split(","), strict=True))
        for j in (0, 1):
            assert int(cells[f"moe{j}_load0"]) + int(cells[f"moe{j}_load1"]) == 2 * 4 * 16
            assert 0 <= int(cells[f"moe{j}_dropped"]) <= 2 * 4 * 16


@pytest.mark.mpi
def test_train_at_ep_2_saves_and_one_rank_resumes_at_ep_1(tmp_path):
    """`zmpi train` with a config's moe.ep_size 2 on 2 ranks trains (the banner counts every
    expert once) and saves the expert shards at ep 2 (--save-every); 1 rank at ep 1 resumes
    its step-1 checkpoint and continues the loss as the 2-rank run went on (fp64). Hugging
    Face weights into a run at ep 2 (--init-from) are refused, one line, before the run."""
    config, one = tmp_path / "moe.json", tmp_path / "moe1.json"
    config.write_text(json.dumps({"moe": {"num_experts": 4, "k": 2, "ep_size": 2}}))
    one.write_text(json.dumps({"moe": {"num_experts": 4, "k": 2, "ep_size": 1}}))
    flags = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "16",
             "--batch", "4", "--steps", "2", "--sample-tokens", "0", "--precision", "fp64"]
    result = launch_mpi(CLI, 2, timeout=180, args=["train", "--config", config, *flags,
                                                   "--save-every", "1", "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    count = gpt_num_params(2, 16, 65, 16, moe={"num_experts": 4, "k": 2})
    assert f"zmpi train: GPT {count:,} params, 2 ranks (dp 2 x pp 1 x tp 1, ep 2)" in \
        result.stdout, result.stdout
    # the memory table: what each rank holds is what the dense and the experts' strategies
    # declare, and the SC'20 formula of each over its group (the experts' left out before)
    table = result.stdout.split("model-state memory per rank")[1].splitlines()
    assert "both with the experts' over 1 rank" in table[1], table
    for row in table[3:5]:
        _, psi, _, device, declared, formula, *_ = row.split()
        assert device == declared == formula, table
        assert int(psi.replace(",", "")) < count  # two of the four experts of each layer
    saved, again = tmp_path / "run" / "checkpoints", tmp_path / "one_checkpoints"
    resumed = launch_mpi(CLI, 1, timeout=180, args=[
        "train", "--config", one, *flags, "--resume", saved, "--resume-tag", "step1",
        "--save-every", "1", "--ckpt-dir", again, "--out", tmp_path / "one"])
    assert resumed.returncode == 0, resumed.describe()
    assert "resumed from" in resumed.stdout and "saved by 2 ranks" in resumed.stdout
    assert _losses(tmp_path / "one")[1] == pytest.approx(_losses(tmp_path / "run")[1],
                                                         rel=1e-12, abs=0)
    # metrics.csv's expert load and drops per MoE layer: summed over the ep-2 run's ranks,
    # what one rank routing every row counts (the same tokens on every layout)
    header, *rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    moe = [i for i, name in enumerate(header.split(",")) if name.startswith("moe")]
    assert [header.split(",")[i] for i in moe] == [
        f"moe{j}_{c}" for j in (0, 1) for c in ("dropped", "load0", "load1", "load2", "load3")]
    by_step = {int(r.split(",")[0]): [int(r.split(",")[i]) for i in moe] for r in rows}
    resumed = (tmp_path / "one" / "metrics.csv").read_text().splitlines()[1:]
    assert [int(resumed[0].split(",")[i]) for i in moe] == by_step[1]
    assert all(sum(cells[1:5]) == 2 * 4 * 16 for cells in by_step.values())  # k x rows x T
    # the offline tools know the expert shards: the step-2 checkpoints of both runs (ep 2 on
    # 2 ranks, ep 1 on 1) consolidate to the same whole (E, ...) experts
    assert "experts over expert-parallel 2 x expert-data-parallel 1 (8 expert tensors)" in \
        tools.inspect(saved, "step2")
    assert tools.verify(saved, "step2") == [] and tools.verify(again, "step2") == []
    for directory, out in ((saved, "ep2.npz"), (again, "ep1.npz")):
        tools.consolidate(directory, tmp_path / out, "step2", npz=True)
    with np.load(tmp_path / "ep2.npz") as ep2, np.load(tmp_path / "ep1.npz") as ep1:
        assert sorted(ep2) == sorted(ep1) and ep2["units.1.mlp.experts.fc_weight"].shape[0] == 4
        for name in ep1:
            if name != "__tied__":
                np.testing.assert_allclose(ep2[name], ep1[name], rtol=1e-10, atol=1e-12,
                                           err_msg=name)
    shard = saved / "step2" / "ep001-rank00000-of-00001.h5"
    shard.write_bytes(shard.read_bytes()[:-1] + b"?")
    assert [p.split(":")[1].strip() for p in tools.verify(saved, "step2")] == ["corrupt"]
    # the expert section's entries are checked as the rest (checksum recomputed after each edit)
    path = saved / "step1" / "manifest.json"
    body = json.loads(path.read_text())
    for edit, said in ((lambda m: m["expert_files"][0].update(file="../x.h5"),
                        "expert_files[0] names '../x.h5', not 'ep000-rank00000-of-00001.h5'"),
                       (lambda m: m["expert_files"].pop(), "expert_files lists 1 shard for 1 "
                        "expert-data-parallel shards x ep 2"),
                       (lambda m: m["mesh"].update(ep=4), "mesh has ep 4, the experts are split "
                        "over 2"),
                       (lambda m: m.pop("experts"), "experts and expert_files come together")):
        tampered = json.loads(json.dumps(body))
        edit(tampered)
        del tampered["checksum"]
        tampered["checksum"] = _body_crc(tampered)
        path.write_text(json.dumps(tampered))
        with pytest.raises(CheckpointError, match="corrupt") as e:
            read_manifest(saved / "step1")
        assert said in str(e.value)
    refused = launch_mpi(CLI, 2, timeout=180, args=["train", "--config", config, *flags,
                                                    "--init-from", tmp_path / "hf",
                                                    "--out", tmp_path / "hf_run"])
    assert refused.returncode == 2, refused.describe()
    assert refused.stderr.strip().splitlines()[-1] == (
        "zmpi train: --init-from: Hugging Face weights into an expert-parallel run "
        "(moe.ep_size 2) are not built yet (docs/moe.md)"), refused.stderr
    assert not (tmp_path / "hf_run" / "checkpoints").exists()

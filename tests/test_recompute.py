"""Activation recompute (ZeRO-R's activation checkpointing; Korthikanti et al. 2022's selective
and full granularities): the same gradients bit for bit as without it, in this process (fp32
and fp64, attention in one block and in several) and on 2 ranks through the engine (ZeRO
stages 0-3, tensor parallelism with and without sequence parallelism, a 2-stage pipeline;
tests/ranks/recompute_checks.py); the activations it saves, counted by the ledger: selective
exactly the attention probabilities, full all but each unit's input and one unit's working set;
the config section and `zmpi train --recompute`."""
import numpy as np
import pytest
from mpi_util import CLI, RANKS_DIR, launch_mpi, run_mpi

from zmpi.config import Config, ConfigError
from zmpi.memory import MemoryLedger
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.nn.functional import ATTENTION_BLOCK
from zmpi.nn.module import activations_counted_in

POLICIES = ("none", "selective", "full")


def gradients_and_peak(cfg, policy, dtype, batch=2):
    """Every parameter's gradient after one forward and backward of `policy`, and the ledger's
    activation peak."""
    model = GPT(cfg, seed=0, dtype=dtype)
    model.set_recompute(policy)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        model.forward_loss(idx, np.roll(idx, -1, axis=1))
        model.backward_loss()
    assert ledger.current("activation") == 0  # everything saved was consumed
    return {n: p.grad.copy() for n, p in model.named_parameters()}, ledger.peak("activation")


@pytest.mark.parametrize("seq_len", (16, ATTENTION_BLOCK + 24), ids=("one_block", "blocks"))
@pytest.mark.parametrize("dtype", (np.float32, np.float64), ids=("fp32", "fp64"))
def test_recompute_gives_the_same_gradients_bit_for_bit(dtype, seq_len):
    cfg = GPTConfig(vocab_size=11, seq_len=seq_len, n_layer=3, n_head=2, d_model=8)
    want, _ = gradients_and_peak(cfg, "none", dtype)
    for policy in ("selective", "full"):
        got, _ = gradients_and_peak(cfg, policy, dtype)
        for name, w in want.items():
            assert np.array_equal(got[name], w), (policy, name)


@pytest.mark.parametrize("seq_len", (16, ATTENTION_BLOCK + 24), ids=("one_block", "blocks"))
def test_what_each_policy_saves(seq_len):
    """Selective saves exactly the attention probabilities: per layer and block of query rows
    [a, b), B x heads x (b - a) x b float32. Full keeps each block's input (B x T x C) and the
    token ids, plus at most one unit's working set at a time (the LM head and loss, or one
    block being recomputed)."""
    L, B, H, C = 3, 2, 2, 8
    cfg = GPTConfig(vocab_size=11, seq_len=seq_len, n_layer=L, n_head=H, d_model=C)
    _, none = gradients_and_peak(cfg, "none", np.float32, B)
    _, selective = gradients_and_peak(cfg, "selective", np.float32, B)
    _, full = gradients_and_peak(cfg, "full", np.float32, B)
    probs = sum(B * H * (min(a + ATTENTION_BLOCK, seq_len) - a) * min(a + ATTENTION_BLOCK,
                                                                       seq_len) * 4
                for a in range(0, seq_len, ATTENTION_BLOCK))
    assert none - selective == L * probs
    fewer = GPTConfig(vocab_size=11, seq_len=seq_len, n_layer=L - 1, n_head=H, d_model=C)
    block = none - gradients_and_peak(fewer, "none", np.float32, B)[1]  # one block's caches
    rest = none - L * block  # the embedding's, the LM head's and the loss's
    inputs = B * seq_len * 8 + L * B * seq_len * C * 4 + B * seq_len * C * 4  # ids, x per unit
    assert full <= inputs + max(block, rest), (full, inputs, block, rest)
    assert full < none / 2


@pytest.mark.mpi
def test_recompute_through_the_engine_is_exact_everywhere():
    reports = run_mpi(RANKS_DIR / "recompute_checks.py", 2, timeout=240)
    runs = {k: v for k, v in reports[0].items() if k != "rank"}
    assert len(runs) == 2 * (4 + 2 + 1 + 2)  # 2 policies x (dp2 x 4, tp2 x 2, sp x 1, pp2 x 2)
    for r in reports:
        for name, run in ((k, v) for k, v in r.items() if k != "rank"):
            assert run["equal"] and run["largest"] == 0.0 and run["losses_equal"], (name, run)
            assert run["peak"] < run["peak_none"], (name, run)
            if name.endswith("full"):
                assert run["peak"] < 0.55 * run["peak_none"], (name, run)


def test_the_config_section_acts_or_is_refused():
    assert Config.from_dict({}).activation_checkpointing.recompute == "none"
    for policy in POLICIES:
        c = Config.from_dict({"activation_checkpointing": {"recompute": policy}})
        assert c.activation_checkpointing.recompute == policy and c.notes() == []
    with pytest.raises(ConfigError, match="recompute: 'all': use one of none, selective, full"):
        Config.from_dict({"activation_checkpointing": {"recompute": "all"}})
    for key, value in (("partition_activations", True), ("cpu_checkpointing", True),
                       ("contiguous_memory_optimization", True), ("number_checkpoints", 4),
                       ("synchronize_checkpoint_boundary", True), ("profile", True)):
        default = None if key == "number_checkpoints" else False
        Config.from_dict({"activation_checkpointing": {key: default}})  # DeepSpeed's default
        with pytest.raises(ConfigError, match=rf"activation_checkpointing.{key}: zmpi always"):
            Config.from_dict({"activation_checkpointing": {key: value}})


def test_set_recompute_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="recompute 'some'"):
        GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2, d_model=8)) \
            .set_recompute("some")


@pytest.mark.mpi
def test_zmpi_train_recompute(tmp_path):
    result = launch_mpi(CLI, 2, timeout=120, args=[
        "train", "--recompute", "full", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
        "--seq-len", "16", "--batch", "4", "--steps", "3", "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    import json

    config = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert config["activation_checkpointing"]["recompute"] == "full"

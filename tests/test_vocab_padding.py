"""The vocabulary padded to a multiple (GPTConfig.vocab_multiple; 128 on a GPU, for aligned
LM-head GEMMs): in float64 the loss is the unpadded model's bit for bit and every real gradient
to an ulp (BLAS sums the LM head's input gradient over Vp columns in another order), the
padding rows stay zero with a gradient of exactly zero, their logits are -inf and are never
sampled, the counts say what is allocated, and a checkpoint loads across paddings in one
process (across tensor-parallel sizes: tests/ranks/tp_checkpoint_checks.py)."""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import REPO_ROOT

from zmpi.checkpoint import tools
from zmpi.checkpoint.manifest import read_manifest
from zmpi.config import Config, ConfigError
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig, default_vocab_multiple
from zmpi.models.gpt_counts import gpt_activation_bytes, gpt_num_params, gpt_unit_numels
from zmpi.parallel.tensor.vocab import vocab_shard
from zmpi.plan.layout import Job
from zmpi.plan.memory import stage_units

V, T = 13, 6


def _gpt(multiple, dtype=np.float64):
    return GPT(GPTConfig(V, T, 2, 2, 8, multiple), seed=3, dtype=dtype)


def _loss_and_grads(model):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, V, (2, T)), rng.integers(0, V, (2, T))
    loss = model.loss(x, y)
    model.backward_loss()
    return loss, {name: p.grad.copy() for name, p in model.named_parameters()}


def test_vocab_shard_pads_to_the_multiple_times_tp():
    assert vocab_shard(13) == (13, 0, 13)
    assert vocab_shard(13, 1, 0, 128) == (128, 0, 128)
    assert vocab_shard(50257, 1, 0, 128) == (50304, 0, 50304)  # nanoGPT's
    assert [vocab_shard(13, 2, r, 8) for r in range(2)] == [(16, 0, 8), (16, 8, 8)]
    assert vocab_shard(300, 2, 1, 128) == (512, 256, 256)
    with pytest.raises(ValueError, match="padding multiple must be >= 1"):
        vocab_shard(13, 1, 0, 0)


@pytest.mark.parametrize("multiple", [16, 128])
def test_padding_changes_no_real_loss_or_gradient_and_pads_get_none(multiple):
    plain, padded = _gpt(1), _gpt(multiple)
    wte = padded.units[0].wte
    assert plain.units[0].wte.shape == (V, 8) and wte.shape == (multiple, 8)
    loss, grads = _loss_and_grads(plain)
    padded_loss, padded_grads = _loss_and_grads(padded)
    assert padded_loss == loss
    for name, g in grads.items():  # BLAS sums dh over Vp columns in another order: an ulp
        np.testing.assert_allclose(padded_grads[name][:len(g)], g, rtol=0,
                                   atol=4 * np.finfo(np.float64).eps * np.abs(g).max(),
                                   err_msg=name)
    assert np.abs(wte.grad).sum() > 0 and not np.any(wte.grad[V:])  # exactly zero
    assert not np.any(wte.data[V:])
    assert padded.config.vocab_multiple == multiple and plain.config.vocab_multiple == 1


def test_padding_logits_are_minus_inf_and_never_sampled():
    plain, padded = _gpt(1), _gpt(16)
    with padded.inference():
        logits = padded.forward(np.zeros((1, T), np.int64))
    assert logits.shape[-1] == 16 and np.all(logits[..., V:] == -np.inf)
    assert np.all(np.isfinite(logits[..., :V]))
    prompt = np.array([[1, 2, 3]])
    assert np.array_equal(padded.generate(prompt, 12, rng=5), plain.generate(prompt, 12, rng=5))


def test_the_default_multiple_and_bad_ones():
    assert default_vocab_multiple(True) == 128 and default_vocab_multiple(False) == 1
    assert GPT(GPTConfig(V, T, 1, 2, 8)).config.vocab_multiple == 1  # NumPy: the CPU's
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="vocab_multiple must be an integer >= 1"):
            GPT(GPTConfig(V, T, 1, 2, 8, bad))
    with pytest.raises(ConfigError, match="model.vocab_multiple"):
        Config.from_dict({"model": {"vocab_multiple": 0}})


def test_counts_are_what_is_allocated():
    """gpt_num_params at vocab_multiple 1 and tp 1 is the model's parameters; with padding (or
    tp) what a rank allocates, as the engine's flat buffers hold it."""
    shape = (2, 8, V, T)
    engine = Engine(_gpt(16, np.float32), {"train_micro_batch_size_per_gpu": 2})
    assert engine.num_params == gpt_num_params(*shape, vocab_multiple=16)
    assert gpt_num_params(*shape, vocab_multiple=16) - gpt_num_params(*shape) == (16 - V) * 8
    assert gpt_unit_numels(*shape, tp=2, vocab_multiple=8)[0] == (8 + T) * 8
    plain = gpt_activation_bytes(2, 8, 2, V, T, 1)
    padded = gpt_activation_bytes(2, 8, 2, V, T, 1, vocab_multiple=16)
    assert padded["loss"] - plain["loss"] == 4 * T * (16 - V)  # the logits' padded columns


def _engine(multiple):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "model": {"vocab_multiple": multiple}}
    return Engine(GPT(GPTConfig(V, T, 2, 2, 8, multiple), seed=0), config)


def _train(engine, start, stop):
    data = SyntheticSource(V, T, 2, seed=0)
    return [engine.train_step(*data.sample(step)) for step in range(start, stop)]


@pytest.mark.parametrize("saved, loaded", [(16, 1), (1, 128), (16, 128)])
def test_a_checkpoint_loads_across_paddings(tmp_path, saved, loaded):
    """Saved padded, loaded unpadded and back (one process): every parameter the saver's
    after the load, and both train on alike; the manifest and consolidate give the real
    vocabulary (V rows)."""
    a = _engine(saved)
    _train(a, 0, 2)
    a.save_checkpoint(tmp_path)
    manifest = read_manifest(tmp_path / "step2")
    if saved > 1:
        assert manifest["tensor"]["splits"]["units.0.wte"]["full"] == V
    b = _engine(loaded)
    assert b.load_checkpoint(tmp_path).global_steps == 2
    pa, pb = a.gather_parameters(), b.gather_parameters()
    assert pa["units.0.wte"].shape == pb["units.0.wte"].shape == (V, 8)
    for name in pa:
        assert np.array_equal(pa[name], pb[name]), name
    np.testing.assert_allclose(_train(b, 2, 4), _train(a, 2, 4), rtol=1e-6)
    out = tools.consolidate(tmp_path, tmp_path.parent / f"{saved}-{loaded}.npz", npz=True)
    with np.load(out) as whole:
        assert whole["units.0.wte"].shape == (V, 8)


def test_the_engine_refuses_a_model_of_another_padding():
    with pytest.raises(ConfigError, match="model.vocab_multiple: the config is for "
                       "vocab_multiple 16, the model given has 1"):
        Engine(_gpt(1, np.float32), {"train_micro_batch_size_per_gpu": 2,
                                     "model": {"vocab_multiple": 16}})


def _cli(*args):
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", *args], capture_output=True,
                         text=True, cwd=REPO_ROOT, timeout=120)
    return out.returncode, out.stdout, out.stderr


def test_estimate_and_plan_count_the_padding(tmp_path):
    """zmpi estimate --vocab-multiple counts what a rank allocates; zmpi plan pads as zmpi does
    on its hardware (128 on a GPU's, none on a CPU's), in the embedding it stores and the
    logits it keeps."""
    shape = ["--n-layer", "2", "--d-model", "64", "--vocab-size", "1000", "--seq-len", "32"]
    params = {m: json.loads(_cli("estimate", *shape, "--world-size", "2", "--tp", "2",
                                 "--vocab-multiple", str(m), "--json")[1])["params"]
              for m in (1, 128)}
    assert params[128] - params[1] == (512 - 500) * 64  # 500 -> 512 rows a rank
    assert params[128] == gpt_num_params(2, 64, 1000, 32, tp=2, vocab_multiple=128)
    rc, _, err = _cli("estimate", "--params", "1e6", "--world-size", "2", "--vocab-multiple", "8")
    assert rc == 2 and "--vocab-multiple pads a GPT shape's vocabulary" in err
    rc, _, err = _cli("estimate", *shape, "--world-size", "2", "--vocab-multiple", "0")
    assert rc == 2 and "--vocab-multiple must be >= 1" in err
    job = Job(2, 64, 4, 1000, 32, 8, 1, 1, vocab_multiple=128)
    assert stage_units(job, 1, 1)[0][0] == (1024 + 32) * 64
    for hardware, multiple in (("h100", 128), ("cpu", 1)):
        rc, out, err = _cli("plan", "--hardware", hardware, "--n-layer", "2", "--d-model", "64",
                            "--n-head", "4", "--vocab", "1000", "--seq-len", "32",
                            "--global-batch", "8", "--nodes", "1", "--gpus-per-node", "2",
                            "--json", "--out", str(tmp_path / f"{hardware}.json"))
        assert rc == 0, err
        assert json.loads(out)["job"]["vocab_multiple"] == multiple

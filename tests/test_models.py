"""Models (GPT, MLPModel): whole-model float64 gradients incl. the tied wte, units and hooks,
determinism, causality, low-precision storage, generation, and the no-MPI import rule."""

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from gradcheck import check_model_loss

from zmpi.models import GPT, GPTConfig, MLPModel
from zmpi.models.gpt import LMHead, TokenPositionEmbedding
from zmpi.nn import Block, UnitHooks

TINY = GPTConfig(vocab_size=11, seq_len=6, n_layer=2, n_head=2, d_model=8)


@pytest.fixture
def rng():
    return np.random.default_rng(3)


def batch(rng, B=2, T=6, V=11):
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def perturb_(model, rng, scale=0.3):
    """Move parameters away from init (LayerNorm 1/0, biases 0) so every path carries gradient."""
    for p in model.parameters():
        p.data += rng.standard_normal(p.shape) * scale


def test_importing_nn_and_models_does_not_import_mpi4py():
    code = ("import zmpi.nn, zmpi.models.gpt, zmpi.models.mlp, sys; "
            "assert 'mpi4py' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gpt_units_names_and_tied_embedding():
    model = GPT(TINY)
    assert [type(u) for u in model.units] == [TokenPositionEmbedding, Block, Block, LMHead]
    head, emb = model.units[-1], model.units[0]
    assert head.shared_units == (emb,) and head.wte is emb.wte
    assert [n for n, _ in head.named_parameters()] == ["ln_f.weight", "ln_f.bias"]
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(names))
    assert names[:2] == ["units.0.wte", "units.0.wpe"] and names[-1] == "units.3.ln_f.bias"
    assert "units.1.attn.qkv.weight" in names
    assert sum(n.endswith("wte") for n in names) == 1
    V, T, L, C = 11, 6, 2, 8  # GPT-2 parameter count: embeddings + 12 C^2 + 13 C per layer + ln_f
    assert model.num_parameters() == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def test_gpt_init_is_seeded_and_gpt2_like():
    cfg = GPTConfig(vocab_size=50, seq_len=16, n_layer=8, n_head=4, d_model=64)
    a, b, c = GPT(cfg, seed=0), GPT(cfg, seed=0), GPT(cfg, seed=1)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        np.testing.assert_array_equal(pa.data, pb.data, err_msg=n)
        assert pa.data.dtype == np.float32
        if n.endswith("weight") and "ln" not in n:
            assert not np.array_equal(pa.data, pc.data)
    blk = a.units[1]
    assert abs(blk.attn.qkv.weight.data.std() - 0.02) < 2e-3
    assert abs(blk.mlp.proj.weight.data.std() - 0.02 / math.sqrt(16)) < 5e-4
    assert abs(blk.attn.proj.weight.data.std() - 0.02 / math.sqrt(16)) < 5e-4
    assert not blk.attn.qkv.bias.data.any() and np.all(blk.ln1.weight.data == 1)


def test_gpt_loss_gradients_float64_including_tied_wte(rng):
    model = GPT(TINY, seed=0, dtype=np.float64)
    perturb_(model, rng)
    idx, targets = batch(rng)
    names = check_model_loss(model, idx, targets, rng, max_elementwise=64,
                             elementwise=("units.0.wte",))
    assert len(names) == len(list(model.named_parameters()))


def test_tied_wte_gets_gradient_from_both_ends(rng):
    model = GPT(TINY, seed=0, dtype=np.float64)
    idx, targets = batch(rng)
    model.loss(idx, targets)
    model.backward_loss()
    total = model.units[0].wte.grad.copy()
    unused = np.setdiff1d(np.arange(11), idx)
    assert unused.size and np.abs(total[unused]).min() > 0  # head-only contribution
    model.zero_grad()
    model.units[-1].forward(model.units[2].forward(model.units[1].forward(
        model.units[0].forward(idx))))
    model.units[-1].backward(np.ones((2, 6, 11)))
    assert np.abs(model.units[0].wte.grad).sum() > 0  # the head writes into the owner's grad


def test_gpt_shorter_sequences_and_causality(rng):
    model = GPT(TINY, dtype=np.float64)
    perturb_(model, rng)
    idx = rng.integers(0, 11, (3, 4))  # T = 4 < seq_len = 6
    logits = model.forward(idx)
    assert logits.shape == (3, 4, 11)
    idx2 = idx.copy()
    idx2[:, 2] = (idx2[:, 2] + 1) % 11
    logits2 = model.forward(idx2)
    np.testing.assert_array_equal(logits2[:, :2], logits[:, :2])
    assert not np.allclose(logits2[:, 2:], logits[:, 2:])
    with pytest.raises(ValueError):
        model.forward(rng.integers(0, 11, (1, 7)))


def test_gpt_accumulation_loss_scale_and_cache_errors(rng):
    model = GPT(TINY, dtype=np.float64)
    idx, targets = batch(rng)
    with pytest.raises(RuntimeError):
        model.backward_loss()
    model.loss(idx, targets)
    model.backward_loss()
    once = [p.grad.copy() for p in model.parameters()]
    with pytest.raises(RuntimeError):
        model.backward_loss()  # consumed
    model.loss(idx, targets)
    model.backward(scale=3.0)  # same as backward_loss(scale=3.0)
    for g, p in zip(once, model.parameters(), strict=True):
        np.testing.assert_allclose(p.grad, 4 * g, rtol=1e-10, atol=1e-15)


def test_initial_loss_is_near_log_v(rng):
    cfg = GPTConfig(vocab_size=65, seq_len=16, n_layer=2, n_head=2, d_model=32)
    loss = GPT(cfg).loss(*batch(rng, B=4, T=16, V=65))
    assert abs(loss - math.log(65)) < 0.1


def test_hooks_wrap_every_unit_in_order(rng):
    model = GPT(TINY)
    calls = []

    class Recorder(UnitHooks):
        def before_forward(self, u):
            calls.append(("bf", model.units.index(u)))

        def after_forward(self, u):
            calls.append(("af", model.units.index(u)))

        def before_backward(self, u):
            calls.append(("bb", model.units.index(u)))

        def after_backward(self, u):
            calls.append(("ab", model.units.index(u)))

    model.hooks = Recorder()
    model.loss(*batch(rng))
    model.backward_loss()
    fwd = [x for i in range(4) for x in (("bf", i), ("af", i))]
    bwd = [x for i in reversed(range(4)) for x in (("bb", i), ("ab", i))]
    assert calls == fwd + bwd


@pytest.mark.parametrize("dtype, tol", [(np.float16, 2e-3), (ml_dtypes.bfloat16, 2e-2)])
def test_gpt_low_precision_storage(dtype, tol, rng):
    """Loss within `tol` (relative) of float32: weights are rounded once to the storage dtype."""
    cfg = GPTConfig(vocab_size=65, seq_len=16, n_layer=2, n_head=2, d_model=32)
    ref, low = GPT(cfg, seed=0), GPT(cfg, seed=0, dtype=dtype)
    idx, targets = batch(rng, B=4, T=16, V=65)
    loss_ref, loss = ref.loss(idx, targets), low.loss(idx, targets)
    assert abs(loss - loss_ref) <= tol * loss_ref
    low.backward_loss(scale=1024.0)  # as with a loss scale
    for n, p in low.named_parameters():
        assert p.data.dtype == dtype and p.grad.dtype == dtype, n
        assert np.all(np.isfinite(p.grad.astype(np.float32))), n


def test_mlp_model_gradients_2d_and_3d(rng):
    model = MLPModel(sizes=(5, 7, 6, 4), seed=0, dtype=np.float64)
    perturb_(model, rng, 0.1)
    assert len(model.units) == 3
    check_model_loss(model, rng.standard_normal((6, 5)), rng.integers(0, 4, 6), rng,
                     max_elementwise=64)
    check_model_loss(model, rng.standard_normal((2, 3, 5)), rng.integers(0, 4, (2, 3)), rng)
    a, b = MLPModel(), MLPModel()
    assert [n for n, _ in a.named_parameters()] == [
        f"units.{i}.fc.{w}" for i in range(3) for w in ("weight", "bias")]
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    assert all(np.array_equal(p.data, q.data) for p, q in pairs)
    assert a.num_parameters() == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 8 + 8


def test_gpt_training_reduces_loss(rng):
    cfg = GPTConfig(vocab_size=13, seq_len=8, n_layer=1, n_head=2, d_model=16)
    model = GPT(cfg)
    idx, targets = batch(rng, B=4, T=8, V=13)
    first = model.loss(idx, targets)
    model.backward_loss()
    for _ in range(30):
        for p in model.parameters():
            p.data -= 0.5 * p.grad
        model.zero_grad()
        model.loss(idx, targets)
        model.backward_loss()
    assert model.loss(idx, targets) < 0.5 * first


def test_generate(rng):
    model = GPT(TINY)
    idx = rng.integers(0, 11, (2, 3))
    out = model.generate(idx, 8, rng=0)  # grows past seq_len = 6: the context is cropped
    assert out.shape == (2, 11) and np.array_equal(out[:, :3], idx)
    assert out.min() >= 0 and out.max() < 11
    np.testing.assert_array_equal(out, model.generate(idx, 8, rng=0))
    greedy = model.generate(idx, 1, temperature=1e-6, rng=0)
    with pytest.raises(RuntimeError):  # generate leaves no stale cache behind
        model.units[1].backward(np.zeros((2, 3, 8)))
    np.testing.assert_array_equal(greedy[:, -1], model.forward(idx)[:, -1].argmax(-1))


def test_a_users_own_models_package_does_not_clash(tmp_path):
    """zmpi's models install as zmpi.models: a user's `models/` next to their script wins
    `import models`, and zmpi.models still loads."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("MINE = True\n")
    code = ("import models, zmpi.models.gpt; from zmpi.cli import main; "
            "assert models.MINE and zmpi.models.gpt.GPT")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)


def test_mlp_regressor_with_mse_and_gpt_with_ignore_index_grads(rng):
    from zmpi.nn import CrossEntropyLoss, MSELoss

    reg = MLPModel(sizes=(5, 8, 2), dtype=np.float64, loss=MSELoss())
    x, y = rng.standard_normal((4, 5)), rng.standard_normal((4, 2))
    check_model_loss(reg, x, y, rng)
    gpt = GPT(TINY, dtype=np.float64)
    gpt.loss_fn = CrossEntropyLoss(ignore_index=-100)
    idx, targets = batch(rng)
    targets[0, :2] = -100
    check_model_loss(gpt, idx, targets, rng)
    with pytest.raises(RuntimeError, match="without a preceding forward"):
        reg.backward_loss()

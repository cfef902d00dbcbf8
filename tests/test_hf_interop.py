"""Hugging Face interop (zmpi.checkpoint.hf): transformers' GPT2LMHeadModel and
LlamaForCausalLM (grouped-query; tied with llama3 rope_scaling), built from random weights
(CPU, float32, tiny) and saved with save_pretrained, imported by zmpi give the same logits,
loss and gradients; a checkpoint exported back (from an in-process run, and from one saved by
2 ranks under stage 3, or tensor parallel, after --init-from; a Llama's with fewer key/value
heads than tensor ranks) loads in transformers with the same logits; a bad directory is one
line. transformers and torch are test
dependencies only (the hf-test extra): these tests skip without them."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import CLI, child_env, launch_mpi

from zmpi.checkpoint import CheckpointError, hf
from zmpi.checkpoint.hf import HFError, export_hf, import_hf
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.llama import Llama, LlamaConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, T, L, H, D = 65, 16, 2, 2, 16  # Tiny Shakespeare's vocabulary, so zmpi train takes it
SHAPE = {"n_layer": L, "d_model": D, "n_head": H, "seq_len": T, "vocab_size": V}


def hf_model(seed=0):
    """A GPT2LMHeadModel of random weights (std 0.2, biases and LayerNorms too, so that a
    misplaced tensor shows), eval mode, float32."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the model, its save_pretrained directory)."""
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    model = hf_model()
    model.save_pretrained(path)
    return model, path


def batch(seed=1, n=3):
    ids = np.random.default_rng(seed).integers(0, V, (n, T + 1))
    return ids[:, :-1], ids[:, 1:]


def hf_outputs(model, x, y):
    """(logits, mean cross-entropy, {HF parameter name: gradient}) of transformers' model."""
    model.zero_grad()
    logits = model(torch.as_tensor(x)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.as_tensor(y).ravel())
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    return logits.detach().numpy(), loss.item(), grads


def engine_from(ckpt, stage=0):
    """A one-rank engine of the matching zmpi GPT with checkpoint `ckpt` loaded."""
    engine = Engine(GPT(GPTConfig(V, T, L, H, D, vocab_multiple=1), seed=5),
                    {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage},
                     "model": SHAPE})  # as zmpi train's config gives it: n_head for export
    engine.load_checkpoint(ckpt)
    return engine


def equals_transformers(zmodel, model, tensors, hf_grad) -> None:
    """zmpi's `zmodel` and transformers' `model` on one batch: the same logits and loss to 1e-5
    relative, and each of `tensors`' gradients to 1e-4 (`hf_grad(t, grads)`: tensor t's
    gradient from transformers' {name: grad}, in zmpi's layout)."""
    x, y = batch()
    logits, loss, grads = hf_outputs(model, x, y)
    ours = zmodel.forward(x)
    zmodel.clear_cache()
    assert relative(ours, logits) < 1e-5
    assert abs(zmodel.loss(x, y) - loss) / loss < 1e-5
    zmodel.backward_loss()
    named = dict(zmodel.named_parameters())
    for t in tensors:
        assert relative(named[t.zmpi].grad, hf_grad(t, grads)) < 1e-4, t


def train_two_steps_and_save(engine, ckpt):
    """Train `engine` 2 steps on one batch, save it to `ckpt` and close it: (that batch's
    inputs, the trained model's logits on them), for an export to be compared with."""
    x, y = batch(seed=2)
    for _ in range(2):
        engine.train_step(x, y)
    engine.save_checkpoint(ckpt)
    ours = engine.model.forward(x)
    engine.model.clear_cache()
    engine.close()
    return x, ours


def relative(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def test_the_table_is_zmpis_gpt():
    """GPT2.shapes and .tied are what models/gpt.py builds (the table cannot drift)."""
    model = GPT(GPTConfig(V, T, L, H, D, vocab_multiple=1))
    assert hf.GPT2.shapes(SHAPE) == {n: p.shape for n, p in model.named_parameters()}
    assert hf.GPT2.tied(SHAPE) == model.tied_parameters()
    assert {t.zmpi for u in hf.GPT2.units(SHAPE) for t in u} == set(hf.GPT2.shapes(SHAPE))


def test_import_gives_the_same_logits_loss_and_gradients(saved, tmp_path):
    model, path = saved
    ckpt = import_hf(path, tmp_path / "ck")
    assert ckpt == tmp_path / "ck" / "step0"
    engine = engine_from(tmp_path / "ck")
    assert engine.global_steps == 0 and engine.optimizer.step_count == 0
    # wte's gradient: from both ends, as HF's tied one
    equals_transformers(engine.model, model, (t for u in hf.GPT2.units(SHAPE) for t in u),
                        lambda t, grads: grads["transformer." + t.hf])


def test_a_sharded_directory_and_bfloat16_import_alike(saved, tmp_path):
    """model.safetensors.index.json's shards read as the single file does; a bfloat16
    directory keeps its dtype (the master weights are its values exactly)."""
    model, path = saved
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / hf.INDEX).is_file()
    import_hf(tmp_path / "sharded", tmp_path / "a")
    import_hf(path, tmp_path / "b")
    from zmpi.checkpoint.tools import consolidate

    for name in "ab":
        consolidate(tmp_path / name, tmp_path / f"{name}.npz", npz=True)
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert all(np.array_equal(a[k], b[k]) for k in b.files if k != "__tied__")
    hf_model().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # (the fixture's unchanged)
    import_hf(tmp_path / "bf16", tmp_path / "c")
    from zmpi.checkpoint.manifest import read_manifest

    assert read_manifest(tmp_path / "c" / "step0")["dtype"] == "bfloat16"
    consolidate(tmp_path / "c", tmp_path / "c.npz", npz=True)
    wte = np.load(tmp_path / "c.npz")["units.0.wte"]
    want = model.transformer.wte.weight.detach().to(torch.bfloat16).float().numpy()
    assert np.array_equal(wte, want)


def hf_logits(directory, x, dtype=None):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    with torch.no_grad():
        return loaded(torch.as_tensor(x)).logits.float().numpy()


def test_export_after_training_loads_in_transformers(saved, tmp_path):
    """Import, train 2 steps (stage 2), save; the export gives transformers the logits the
    trained zmpi model gives; --dtype float16 writes F16 weights."""
    _, path = saved
    import_hf(path, tmp_path / "ck")
    engine = engine_from(tmp_path / "ck", stage=2)
    x, ours = train_two_steps_and_save(engine, tmp_path / "trained")
    out = export_hf(tmp_path / "trained", tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [hf.CONFIG, hf.GENERATION, hf.WEIGHTS]
    assert relative(hf_logits(out, x), ours) < 1e-5
    export_hf(tmp_path / "trained", tmp_path / "half", dtype="float16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "half" / hf.WEIGHTS), "np") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {np.dtype(np.float16)}
    assert relative(hf_logits(tmp_path / "half", x, torch.float32), ours) < 1e-2


@pytest.mark.mpi
@pytest.mark.parametrize("layout", [["--stage", "3"], ["--tp", "2", "--stage", "1"]],
                         ids=["dp2-stage3", "tp2"])
def test_init_from_at_two_ranks_then_export(saved, tmp_path, layout):
    """zmpi train --init-from at 2 ranks (stage 3 over dp 2; tensor parallel, each rank a
    slice of the split tensors), lr 1e-20 (the steps change no float32 weight): every rank's
    shard came from the directory, and the checkpoint it saves exports to the very tensors
    transformers saved, which transformers loads, giving the same logits."""
    model, path = saved
    result = launch_mpi(CLI, 2, timeout=240, args=[
        "train", "--init-from", str(path), *layout, "--steps", "2", "--lr", "1e-20",
        "--n-layer", str(L), "--n-head", str(H), "--d-model", str(D), "--seq-len", str(T),
        "--batch", "4", "--sample-tokens", "2", "--save-every", "2",
        "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "run")])
    assert result.returncode == 0, result.describe()
    assert f"initialised from {path}" in result.stdout + result.stderr
    out = export_hf(tmp_path / "ck", tmp_path / "out")
    from safetensors import safe_open

    with safe_open(str(out / hf.WEIGHTS), "np") as f:
        for name, p in model.named_parameters():
            if name != "lm_head.weight":
                assert np.array_equal(f.get_tensor(name), p.detach().numpy()), name
    x, _ = batch(seed=3)
    with torch.no_grad():
        assert relative(hf_logits(out, x), model(torch.as_tensor(x)).logits.numpy()) < 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_init_from_gives_the_models_loss_and_a_fresh_optimizer(saved, stage):
    """The parameters the forward uses (not only the master weights) are the directory's."""
    model, path = saved
    engine = Engine(GPT(GPTConfig(V, T, L, H, D, vocab_multiple=1), seed=7),
                    {"train_micro_batch_size_per_gpu": 3, "model": SHAPE,
                     "zero_optimization": {"stage": stage}})
    assert "initialised from" in hf.init_from(engine, path)
    x, y = batch(seed=4)
    _, loss, _ = hf_outputs(model, x, y)
    assert abs(engine.eval_loss(x, y) - loss) / loss < 1e-5
    assert engine.global_steps == 0 and engine.optimizer.step_count == 0
    engine.close()


def test_init_from_a_model_of_another_shape_is_one_line(saved):
    _, path = saved
    engine = Engine(GPT(GPTConfig(V, T, L + 1, H, D, vocab_multiple=1)),
                    {"train_micro_batch_size_per_gpu": 1, "model": {"n_head": H}})
    with pytest.raises(CheckpointError) as e:  # on every rank
        hf.init_from(engine, path)
    assert "the model differs from this run's: n_layer 2 (this run 3)" in str(e.value)
    assert "\n" not in str(e.value)
    engine.close()


def _bad(tmp_path, saved, case):
    """A directory spoilt as `case` says."""
    _, path = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / hf.CONFIG).read_text())
    if case == "not a directory":
        return tmp_path / "nowhere"
    if case == "no config.json":
        (bad / hf.CONFIG).unlink()
    elif case == "config not JSON":
        (bad / hf.CONFIG).write_text("{not json")
    elif case == "llama keys missing":
        config["model_type"] = "llama"
    elif case == "bert":
        config["model_type"] = "bert"
    elif case == "exact GELU":
        config["activation_function"] = "gelu"
    elif case == "shape":
        config["n_positions"] = T * 2
    elif case == "no weights":
        (bad / hf.WEIGHTS).rename(bad / "pytorch_model.bin")
    elif case in ("missing tensor", "extra tensor", "untied head"):
        from safetensors.numpy import load_file, save_file

        tensors = load_file(bad / hf.WEIGHTS)
        if case == "missing tensor":
            del tensors["transformer.h.1.mlp.c_fc.bias"]
        elif case == "extra tensor":
            tensors["transformer.h.0.mlp.gate.weight"] = np.zeros((2, 2), np.float32)
        else:
            tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
        save_file(tensors, bad / hf.WEIGHTS, metadata={"format": "pt"})
    elif case == "corrupt weights":
        (bad / hf.WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    (bad / hf.CONFIG).write_text(json.dumps(config)) if case not in (
        "no config.json", "config not JSON") else None
    return bad


BAD = {"not a directory": "missing: no such Hugging Face model directory",
       "no config.json": "missing: no config.json",
       "config not JSON": "corrupt: not JSON",
       "llama keys missing": "corrupt: hidden_size is None, not an integer >= 1",
       "bert": "model_type 'bert': zmpi has no such model",
       "exact GELU": "activation_function 'gelu'",
       "shape": "transformer.wpe.weight is (16, 16), config.json gives (32, 16)",
       "no weights": "missing: no model.safetensors or model.safetensors.index.json (only "
                     "pytorch_model.bin",
       "missing tensor": "1 tensor missing (transformer.h.1.mlp.c_fc.bias)",
       "extra tensor": "1 tensor that zmpi's gpt2 has no place for "
                       "(transformer.h.0.mlp.gate.weight)",
       "untied head": "lm_head.weight differs from transformer.wte.weight",
       "corrupt weights": "corrupt: not a safetensors file"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_directory_is_one_line(saved, tmp_path, case):
    with pytest.raises(HFError) as e:
        import_hf(_bad(tmp_path, saved, case), tmp_path / "ck")
    assert BAD[case] in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "ck" / "latest").exists()


def test_the_commands_say_one_line_and_exit_codes(saved, tmp_path):
    """import-hf into a non-empty directory: exit 2; a Llama directory without a Llama's keys:
    exit 1; export-hf of
    a checkpoint saved without a model section asks for --n-head: exit 2."""
    _, path = saved

    def zmpi(*args):
        return subprocess.run([sys.executable, str(CLI), "ckpt", *map(str, args)],
                              capture_output=True, text=True, timeout=120, env=child_env())

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    done = zmpi("import-hf", path, tmp_path / "full")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "not empty" in done.stderr
    llama = _bad(tmp_path, saved, "llama keys missing")
    done = zmpi("import-hf", llama, tmp_path / "ck")
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "hidden_size is None" in done.stderr
    engine = Engine(GPT(GPTConfig(V, T, L, H, D, vocab_multiple=1)),
                    {"train_micro_batch_size_per_gpu": 1})
    engine.save_checkpoint(tmp_path / "script")
    engine.close()
    done = zmpi("export-hf", tmp_path / "script", tmp_path / "out")
    assert done.returncode == 2 and "give --n-head" in done.stderr
    done = zmpi("export-hf", tmp_path / "script", tmp_path / "out", "--n-head", H)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out" / hf.CONFIG).read_text())["n_head"] == H


@pytest.mark.mpi
def test_train_init_from_refusals_are_one_line(saved, tmp_path):
    """zmpi train --init-from of another model: one line naming what differs, exit 1; with
    --resume: one line, exit 2."""
    _, path = saved
    tiny = ["--n-head", str(H), "--d-model", str(D), "--seq-len", str(T), "--steps", "1",
            "--batch", "2", "--sample-tokens", "0", "--out", str(tmp_path / "run")]
    done = launch_mpi(CLI, 1, timeout=120, args=[
        "train", "--init-from", str(path), "--n-layer", str(L + 1), *tiny])
    assert done.returncode == 1, done.describe()
    assert done.stderr.count("\n") == 1
    assert "the model differs from this run's: n_layer 2 (this run 3)" in done.stderr
    done = launch_mpi(CLI, 1, timeout=120, args=[
        "train", "--init-from", str(path), "--resume", str(tmp_path), "--n-layer", str(L), *tiny])
    assert done.returncode == 2 and "--init-from and --resume: give one" in done.stderr
    assert done.stderr.count("\n") == 1


# ---- Llama ---------------------------------------------------------------------------------
# two tiny Llamas: grouped-query (4 heads, 2 key/value heads) with an untied head; tied, with
# llama3 rope_scaling, rope_theta 5e5 and one key/value head (fewer than tp 2, for the launch)
LLAMAS = {
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "tied-llama3": dict(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                        rope_theta=5e5, rope_scaling={
                            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
}
LLAMA_SHAPE = dict(vocab_size=V, hidden_size=D, intermediate_size=24, num_hidden_layers=L,
                   max_position_embeddings=T, rms_norm_eps=1e-5)


def llama_section(kind):
    """zmpi's model section of LLAMAS[kind] (LlamaConfig's names)."""
    return {"model_type": "llama", **LLAMA_SHAPE, **LLAMAS[kind]}


def save_llama(kind, path):
    """The LlamaForCausalLM LLAMAS[kind] of random weights (std 0.2), eval, float32, saved
    with save_pretrained in `path`."""
    torch.manual_seed(2)
    config = transformers.LlamaConfig(**LLAMA_SHAPE, **copy.deepcopy(LLAMAS[kind]),
                                      attention_dropout=0.0)  # (it adds rope_theta to scaling)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(LLAMAS))
def llama_saved(request, tmp_path_factory):
    """(kind, its model, its save_pretrained directory) for each of LLAMAS."""
    path = tmp_path_factory.mktemp("hf") / request.param
    return request.param, save_llama(request.param, path), path


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """The save_pretrained directory of LLAMAS["gqa"]."""
    path = tmp_path_factory.mktemp("hf") / "gqa"
    save_llama("gqa", path)
    return path


def llama_engine(kind, ckpt=None, stage=0):
    """A one-rank engine of the matching zmpi Llama, checkpoint `ckpt` loaded where given."""
    section = llama_section(kind)
    model = Llama(LlamaConfig(**{k: v for k, v in section.items() if k != "model_type"},
                              vocab_multiple=1), seed=5)
    engine = Engine(model, {"train_micro_batch_size_per_gpu": 3, "model": section,
                            "zero_optimization": {"stage": stage}})
    if ckpt is not None:
        engine.load_checkpoint(ckpt)
    return engine


def test_the_llama_table_is_zmpis_llama():
    """Llama.shapes, .tied and .model_of agree with what models/llama.py builds."""
    for kind in LLAMAS:
        section = llama_section(kind)
        m = {k: v for k, v in section.items() if k != "model_type"}
        model = Llama(LlamaConfig(**m, vocab_multiple=1))
        shapes = {n: p.shape for n, p in model.named_parameters()}
        assert hf.Llama.shapes(m) == shapes
        assert hf.Llama.tied(m) == model.tied_parameters()
        assert {t.zmpi for u in hf.Llama.units(m) for t in u} == set(shapes)
        assert hf.Llama.model_of(shapes).items() <= m.items()
    assert hf.Llama.COMPUTE == {k: getattr(LlamaConfig, k) for k in hf.Llama.COMPUTE}


def test_a_llama_checkpoint_without_its_model_section_does_not_export(tmp_path):
    """Saved by a script (no model section): no shape shows the heads or RoPE, so export-hf
    refuses it in one line rather than guess."""
    m = {k: v for k, v in llama_section("gqa").items() if k != "model_type"}
    engine = Engine(Llama(LlamaConfig(**m, vocab_multiple=1)),
                    {"train_micro_batch_size_per_gpu": 1})
    engine.save_checkpoint(tmp_path / "script")
    engine.close()
    with pytest.raises(CheckpointError) as e:
        export_hf(tmp_path / "script", tmp_path / "out")
    assert "its config has no Llama model section" in str(e.value)
    assert "\n" not in str(e.value)


def test_llama_import_gives_the_same_logits_loss_and_gradients(llama_saved, tmp_path):
    """Every projection transposed, q and k not permuted (RoPE's halves are transformers'
    rotate_half), the key/value heads grouped as transformers' repeat_kv groups them."""
    kind, model, path = llama_saved
    import_hf(path, tmp_path / "ck")
    engine = llama_engine(kind, tmp_path / "ck")
    m = {k: v for k, v in llama_section(kind).items() if k != "model_type"}

    def grad(t, grads):
        g = grads[t.stored("model.")]
        return g.T if t.transpose else g

    equals_transformers(engine.model, model, (t for u in hf.Llama.units(m) for t in u), grad)
    engine.close()


def test_llama_export_after_training_loads_in_transformers(llama_saved, tmp_path):
    """Import, train 2 steps (stage 2), save, export: config.json carries the key/value heads,
    rope_theta and rope_scaling, and transformers gives the trained zmpi model's logits."""
    kind, _, path = llama_saved
    import_hf(path, tmp_path / "ck")
    engine = llama_engine(kind, tmp_path / "ck", stage=2)
    x, ours = train_two_steps_and_save(engine, tmp_path / "trained")
    out = export_hf(tmp_path / "trained", tmp_path / "out")
    config = json.loads((out / hf.CONFIG).read_text())
    want = LLAMAS[kind]
    assert config["num_key_value_heads"] == want["num_key_value_heads"]
    assert config["tie_word_embeddings"] == want["tie_word_embeddings"]
    assert config["rope_scaling"] == want.get("rope_scaling")
    assert relative(hf_logits(out, x), ours) < 1e-5


@pytest.mark.mpi
def test_llama_init_from_at_tp_2_with_one_kv_head_then_export(tmp_path):
    """zmpi train --model llama --init-from at tp 2 with one key/value head (replicated on
    both tensor ranks; tied, llama3 rope_scaling), lr 1e-20: the checkpoint it saves exports
    to the very tensors transformers saved, and transformers gives the same logits."""
    kind, path = "tied-llama3", tmp_path / "hf"
    model = save_llama(kind, path)
    section = {k: v for k, v in llama_section(kind).items()
               if k not in ("vocab_size", "hidden_size", "num_hidden_layers",
                            "num_attention_heads")}
    (tmp_path / "c.json").write_text(json.dumps({"model": section}))
    result = launch_mpi(CLI, 2, timeout=240, args=[
        "train", "--config", str(tmp_path / "c.json"), "--init-from", str(path), "--tp", "2",
        "--steps", "2", "--lr", "1e-20", "--n-layer", str(L), "--n-head", "2", "--d-model",
        str(D), "--seq-len", str(T), "--batch", "4", "--sample-tokens", "2",
        "--save-every", "2", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "run")])
    assert result.returncode == 0, result.describe()
    assert f"initialised from {path} (llama" in result.stdout + result.stderr
    out = export_hf(tmp_path / "ck", tmp_path / "out")
    from safetensors import safe_open

    with safe_open(str(out / hf.WEIGHTS), "np") as f:
        assert set(f.keys()) == {n for n, _ in model.named_parameters()} - {"lm_head.weight"}
        for name, p in model.named_parameters():
            if name != "lm_head.weight":
                assert np.array_equal(f.get_tensor(name), p.detach().numpy()), name
    x, _ = batch(seed=3)
    with torch.no_grad():
        assert relative(hf_logits(out, x), model(torch.as_tensor(x)).logits.numpy()) < 1e-5


LLAMA_BAD = {  # config.json spoilt -> what the one line names
    "attention_bias": ({"attention_bias": True}, "attention_bias True: zmpi's Llama computes "
                       "False"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias True"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act 'gelu': zmpi's Llama computes 'silu'"),
    "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
             "rope_scaling.rope_type must be one of 'default', 'linear', 'llama3', got 'yarn'"),
    "yarn, transformers 4": ({"rope_parameters": None, "rope_scaling": {
        "type": "yarn", "factor": 4.0}}, "got 'yarn'"),
    "head_dim": ({"head_dim": 8}, "head_dim 8: zmpi's Llama computes hidden_size / "
                 "num_attention_heads (4)"),
    "eps": ({"rms_norm_eps": "tiny"}, "corrupt: rms_norm_eps is 'tiny', not a number > 0"),
}


@pytest.mark.parametrize("case", sorted(LLAMA_BAD))
def test_a_llama_zmpi_lacks_is_one_line(gqa_dir, tmp_path, case):
    bad = tmp_path / "bad"
    shutil.copytree(gqa_dir, bad)
    config = json.loads((bad / hf.CONFIG).read_text())
    change, message = LLAMA_BAD[case]
    config.update(change)
    (bad / hf.CONFIG).write_text(json.dumps(config))
    with pytest.raises(HFError) as e:
        import_hf(bad, tmp_path / "ck")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_init_from_a_llama_of_other_heads_is_one_line(gqa_dir):
    """A run whose key/value heads or RoPE differ from the directory's is refused, naming them
    (no shape shows the heads)."""
    path = gqa_dir
    section = {**llama_section("gqa"), "num_key_value_heads": 4, "rope_theta": 5e5}
    model = Llama(LlamaConfig(**{k: v for k, v in section.items() if k != "model_type"},
                              vocab_multiple=1))
    engine = Engine(model, {"train_micro_batch_size_per_gpu": 1, "model": section})
    with pytest.raises(CheckpointError) as e:
        hf.init_from(engine, path)
    assert str(e.value).endswith("the model differs from this run's: num_key_value_heads 2 "
                                 "(this run 4); rope_theta 10000.0 (this run 500000.0)")
    engine.close()

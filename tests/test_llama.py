"""The Llama model (models/llama.py): float64 finite differences through the whole model, its
parameter count against the formula (llama_unit_numels, what zmpi estimate and plan count),
what it refuses; and, in one 4-rank launch (tests/ranks/llama_checks.py), trained by the
engine in float64 against one process: ZeRO stages 0-3, optimizer offload to the host and
stage 3 with optimizer states and parameters on NVMe at dp 4; tensor
parallelism at (dp, tp) = (2, 2) with key/value heads replicated (n_kv_head 1 < tp) and split
(n_kv_head 2 = tp), at tp 4 with each key/value head on two ranks; pipelines at (dp, pp) =
(2, 2) and (pp, tp) = (2, 2) with a tied head; sequence parallelism at (dp, tp) = (2, 2)
with replicated key/value heads; block-sparse attention at (dp, tp) = (2, 2) with one
key/value head (each rank its query heads' layouts); a checkpoint saved at (dp, tp) = (2, 2)
loaded at dp 4."""
import numpy as np
import pytest
from gradcheck import directional_check
from mpi_util import RANKS_DIR, run_mpi

from zmpi.models.llama import Llama, LlamaConfig, llama_flops_per_token, llama_unit_numels
from zmpi.nn.llama_layers import GroupedQueryAttention

LAUNCH = ["4,1,1,2", "2,1,2,1", "2,1,2,2", "1,1,4,2", "2,2,1,2", "1,2,2,1,tied", "2,1,2,1,sp",
          "2,1,2,1,sparse"]


def small(**kw):
    return LlamaConfig(**{"vocab_size": 11, "hidden_size": 16, "intermediate_size": 24,
                          "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "max_position_embeddings": 8,
                          "vocab_multiple": 1, **kw})


@pytest.mark.parametrize("tied", [False, True])
def test_whole_model_gradients_match_finite_differences(tied):
    model = Llama(small(tie_word_embeddings=tied, rope_theta=100.0), seed=1, dtype=np.float64)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
    model.loss(x, y)
    model.backward_loss()

    def loss():
        value = model.loss(x, y)
        model.clear_cache()
        return value

    for name, p in list(model.named_parameters()):
        directional_check(loss, p.data, p.grad, rng, n_dirs=1, name=name)
    assert ("units.3.lm_head" in dict(model.named_parameters())) is not tied
    assert model.tied_parameters() == ({"units.3.wte": "units.0.wte"} if tied else {})


@pytest.mark.parametrize("kw", [{}, {"num_key_value_heads": 1, "tie_word_embeddings": True},
                                {"num_key_value_heads": 4, "vocab_size": 50}])
def test_parameter_count_is_the_formulas(kw):
    cfg = small(**kw)
    numels = [sum(p.data.size for _, p in u.named_parameters())
              for u in Llama(cfg, dtype=np.float64).units]
    assert numels == llama_unit_numels(cfg)
    d, f, L, V = 16, 24, 2, cfg.vocab_size  # V d (1 + untied) + L (2 d^2 + 2 d kv hd + 3 d f
    kv = cfg.num_key_value_heads            # + 2 d) + d
    assert sum(numels) == V * d * (1 + (not cfg.tie_word_embeddings)) \
        + L * (2 * d * d + 2 * d * kv * 4 + 3 * d * f + 2 * d) + d


def test_flops_count_swiglu_and_the_smaller_kv():
    cfg = small(num_key_value_heads=1)
    d, f, s = 16, 24, 8
    per_block = 2 * (2 * d * d + 2 * d * 4 + 3 * d * f) + 2 * d * (s + 1)
    assert llama_flops_per_token(cfg, s) == 2 * per_block + 2 * d * 11


@pytest.mark.parametrize("kw, message", [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"hidden_size": 18}, "num_attention_heads=4 does not divide hidden_size=18"),
    ({"hidden_size": 12, "num_attention_heads": 4}, "head size 3 must be even"),
    ({"seq_len": 9}, "seq_len 9 > max_position_embeddings 8"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"intermediate_size": 0}, "intermediate_size must be an integer >= 1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
])
def test_bad_shapes_are_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        Llama(small(**kw))


def test_a_batch_longer_than_seq_len_is_refused():
    model = Llama(small(seq_len=4))
    with pytest.raises(ValueError, match="time <= 4"):
        model.check_batch(np.zeros((1, 5), np.int64), np.zeros((1, 5), np.int64))


@pytest.fixture(scope="module")
def reports():
    return run_mpi(RANKS_DIR / "llama_checks.py", 4, LAUNCH, timeout=300)


@pytest.mark.mpi
def test_llama_trains_like_one_process_at_every_layout(reports):
    runs = reports[0]["runs"]
    assert len(runs) == 6 + 2 * (len(LAUNCH) - 1)  # 0-3, offload, NVMe at dp 4; stages 1, 3 else
    for name, run in runs.items():  # float64: what is left is rounding
        assert run["names_match"], name
        assert run["model_move"] <= 1e-12 and run["loss_diff"] <= 1e-13, (name, run)
    assert all(r["runs"].keys() == runs.keys() for r in reports)


@pytest.mark.mpi
def test_each_tensor_rank_holds_the_formulas_share(reports):
    for name, run in reports[0]["runs"].items():
        dp, pp, tp, kv, *_ = name.split("_")[0].split(",")
        if int(pp) > 1:
            continue  # a stage holds some units (plus a tied copy): the pipeline's own tests
        cfg = LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=24,
                          num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=int(kv), max_position_embeddings=8)
        assert run["local_params"] == sum(llama_unit_numels(cfg, int(tp))), name


@pytest.mark.mpi
def test_a_checkpoint_saved_under_tensor_parallelism_loads_at_another_layout(reports):
    for r in reports:
        assert r["checkpoint"] == {"saved_at": "2,1,2,1", "names_match": True, "max_diff": 0.0}


@pytest.mark.parametrize("section, message", [
    ({"model_type": "llama", "n_layer": 2}, "model.n_layer: a GPT key; model_type 'llama' names "
     "it num_hidden_layers"),
    ({"hidden_size": 64}, "model.hidden_size: a Llama key; model_type 'gpt' names it d_model"),
    ({"rope_theta": 1e4}, "model.rope_theta: a Llama key: set model_type \"llama\""),
    ({"model_type": "bert"}, "model.model_type: 'bert': use 'gpt' or 'llama'"),
    ({"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 3},
     "model.num_key_value_heads: 3 does not divide num_attention_heads 4"),
    ({"model_type": "llama", "seq_len": 65, "max_position_embeddings": 64},
     "model.seq_len: 65 > max_position_embeddings 64"),
    ({"model_type": "llama", "rms_norm_eps": 0}, "model.rms_norm_eps: must be > 0"),
    ({"model_type": "llama", "tie_word_embeddings": 1}, "model.tie_word_embeddings: expected "
     "bool"),
])
def test_bad_model_sections_are_one_line(section, message):
    from zmpi.config import Config, ConfigError

    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"train_micro_batch_size_per_gpu": 1, "model": section})


def test_gpt_only_paths_are_refused_for_a_llama():
    from zmpi.config import Config, ConfigError

    with pytest.raises(ConfigError, match="moe: a Llama has no MoE blocks yet"):
        Config.from_dict({"train_micro_batch_size_per_gpu": 1, "model": {"model_type": "llama"},
                          "moe": {"num_experts": 2}})
    for extra in ({"sparse_attention": {"mode": "fixed"}}, {"attention_kernel": "flash"}):
        Config.from_dict({"train_micro_batch_size_per_gpu": 1, "model": {"model_type": "llama"},
                          **extra})  # the grouped-query flash and block-sparse paths


@pytest.mark.parametrize("section, message", [
    ({"n_layer": 2}, "model.n_layer: a GPT key; model_type 'llama' names it num_hidden_layers"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling.rope_type must be "
     "one of 'default', 'linear', 'llama3', got 'yarn'"),  # checked as the model is built
])
def test_zmpi_train_model_llama_refuses_a_bad_section_in_one_line(tmp_path, section, message):
    import json
    import subprocess
    import sys

    from mpi_util import REPO_ROOT

    config = tmp_path / "c.json"
    config.write_text(json.dumps({"model": section}))
    result = subprocess.run([sys.executable, "-m", "zmpi.cli", "train", "--model", "llama",
                             "--config", str(config), "--steps", "1", "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"zmpi train: config {config}: {message}"]


@pytest.mark.mpi
def test_zmpi_train_model_llama_with_tp_2(tmp_path):
    """One key/value head replicated over the 2 tensor ranks, block-sparse attention."""
    import json

    from mpi_util import CLI, launch_mpi

    config = tmp_path / "llama.json"
    section = {"model_type": "llama", "num_key_value_heads": 1, "intermediate_size": 40,
               "rope_theta": 5e5, "tie_word_embeddings": True, "max_position_embeddings": 16,
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    config.write_text(json.dumps({"model": section, "sparse_attention": {
        "mode": "local", "block": 4, "num_sliding_window_blocks": 1}}))
    result = launch_mpi(CLI, 2, timeout=120, args=[
        "train", "--config", config, "--tp", "2", "--steps", "4", "--n-layer", "1",
        "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "4",
        "--sample-tokens", "5", "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    built = meta["model"]
    assert {k: built[k] for k in section if k != "model_type"} == \
        {k: v for k, v in section.items() if k != "model_type"}
    assert (built["hidden_size"], built["num_hidden_layers"], built["num_attention_heads"]) == \
        (16, 1, 2)
    assert meta["config"]["model"]["num_hidden_layers"] == 1  # the flags wrote its names
    params = sum(llama_unit_numels(LlamaConfig(**{k: v for k, v in built.items()
                                                  if k != "vocab_multiple"}, vocab_multiple=1)))
    assert result.stdout.startswith(f"zmpi train: Llama {params:,} params, 2 ranks (dp 1 x pp 1 "
                                    "x tp 2)"), result.stdout[:300]
    assert "sparse attention local (block 4, 67% of causal blocks)" in result.stdout.splitlines()[0]


def _estimate(*flags):
    import subprocess
    import sys

    from mpi_util import REPO_ROOT

    return subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", *map(str, flags)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)


@pytest.mark.parametrize("flags, params", [  # the published counts of the two checkpoints
    (["--n-layer", 32, "--n-head", 32, "--intermediate-size", 11008, "--vocab-size", 32000],
     6_738_415_616),  # Llama-2 7B: multi-head, untied
    (["--n-layer", 32, "--n-head", 32, "--n-kv-head", 8, "--intermediate-size", 14336,
      "--vocab-size", 128256], 8_030_261_248),  # Llama-3 8B: 8 key/value heads
])
def test_zmpi_estimate_counts_llama_2_and_3(flags, params):
    import json

    result = _estimate("--model", "llama", "--d-model", 4096, *flags, "--world-size", 64,
                       "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["params"] == params


@pytest.mark.parametrize("flags, message", [
    (["--n-kv-head", 2], "--n-kv-head: a Llama's; add --model llama"),
    (["--model", "llama"], "--model llama: needs --n-head"),
    (["--model", "llama", "--n-head", 4, "--moe", 4], "--model llama: a Llama has no MoE "
     "blocks"),
    (["--model", "llama", "--n-head", 4, "--n-kv-head", 3], "num_key_value_heads=3 does not "
     "divide num_attention_heads=4"),
])
def test_zmpi_estimate_refuses_what_a_llama_cannot_be(flags, message):
    result = _estimate("--n-layer", 2, "--d-model", 64, "--world-size", 2, *flags)
    line, = result.stderr.strip().splitlines()  # one line
    assert result.returncode == 2 and line.startswith("zmpi estimate: ") and message in line


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recompute_gives_the_same_gradients(policy):
    """Selective recompute drops the grouped-query attention's probabilities, full keeps each
    unit's input: the same operations again, so the same gradients bit for bit."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
    grads = []
    for p in ("none", policy):
        model = Llama(small(), seed=1, dtype=np.float64)
        model.set_recompute(p)
        model.loss(x, y)
        model.backward_loss()
        grads.append({n: q.grad.copy() for n, q in model.named_parameters()})
    assert all(np.array_equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert GroupedQueryAttention.recompute_core is False  # the class default is untouched


def test_train_size_check_counts_a_llama_as_a_llama(tmp_path, monkeypatch, capsys):
    """The size check `zmpi train` makes before building the model (16 bytes a parameter
    against the machine's memory) counts a Llama by llama_num_params: on a machine whose
    memory lies between the GPT formula's count of the same shape and the Llama's (untied
    head, SwiGLU), the Llama is refused in one line giving its own count."""
    from zmpi.cli import inputs, main
    from zmpi.models.gpt_counts import gpt_num_params
    from zmpi.models.llama import llama_num_params

    llama = llama_num_params(LlamaConfig(vocab_size=65, hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=8))
    gpt = gpt_num_params(2, 64, 65, 8)
    assert llama > gpt  # the memory below fits the GPT count, not the Llama's
    monkeypatch.setattr(inputs, "_host_memory", lambda: 8 * (llama + gpt))
    with pytest.raises(SystemExit) as e:
        main(["train", "--model", "llama", "--n-layer", "2", "--d-model", "64", "--n-head", "2",
              "--seq-len", "8", "--batch", "1", "--steps", "1", "--sample-tokens", "0",
              "--out", str(tmp_path / "run")])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, line
    assert line.startswith(f"zmpi train: the Llama (n_layer 2, d_model 64, vocab_size 65: "
                           f"{llama:,} parameters) needs at least"), line

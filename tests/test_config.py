"""Config: DeepSpeed JSON in, typed and validated objects out, round trip, batch rule."""

import ast
import dataclasses
import json
import pathlib
import pickle

import pytest

from zmpi.config import (
    BF16Config,
    Config,
    ConfigError,
    FP16Config,
    OffloadConfig,
    OptimizerConfig,
    ZeroConfig,
)

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.json"))

DEEPSPEED_EXAMPLE = """
{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 100,
  "wall_clock_breakdown": false,
  "optimizer": {"type": "adamw",
                "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16,
           "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
  "zero_optimization": {"stage": 2, "allgather_partitions": true,
                        "allgather_bucket_size": 200000000, "overlap_comm": true,
                        "reduce_scatter": true, "reduce_bucket_size": 2e8,
                        "contiguous_gradients": true,
                        "round_robin_gradients": false}
}
"""


def test_defaults():
    c = Config()
    assert c.zero_optimization.stage == 0 and c.strategy_name == "stage0"
    assert c.dtype_name == "float32" and c.optimizer.type == "AdamW"
    assert c.optimizer.betas == (0.9, 0.999) and c.zero_optimization.prefetch
    assert c.zero_optimization.offload_optimizer == OffloadConfig(device="none")
    assert Config.from_dict({}) == c


def test_deepspeed_example_loads(tmp_path):
    d = json.loads(DEEPSPEED_EXAMPLE)
    c = Config.from_dict(d)
    assert c.zero_optimization.reduce_bucket_size == 200_000_000  # "2e8", as in DeepSpeed
    assert c.zero_optimization.allgather_bucket_size == 200_000_000
    assert isinstance(c.zero_optimization.reduce_bucket_size, int)
    assert c.notes() == [
        "wall_clock_breakdown: accepted without effect (zmpi train reports tokens/s and the DPU "
        "timing)",
        "zero_optimization.round_robin_gradients: accepted without effect (gradient shards are "
        "copied to the host unit by unit)"]
    assert c.optimizer == OptimizerConfig("AdamW", 3e-4, (0.9, 0.95), 1e-8, 0.1)
    assert c.fp16.enabled and c.fp16.loss_scale == 0.0 and c.fp16.min_loss_scale == 1.0
    assert isinstance(c.fp16.min_loss_scale, float)  # int accepted, stored as float
    assert c.zero_optimization.stage == 2 and c.zero_optimization.overlap_comm
    assert c.gradient_clipping == 1.0 and c.dtype_name == "float16"
    assert c.strategy_name == "stage2"
    assert c.resolve_batch(4).train_batch_size == 64
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(d))
    assert Config.from_json(path) == c == Config.from_json(str(path)) == Config.from_json(
        json.dumps(d))


def test_non_integral_float_where_int_expected_fails():
    with pytest.raises(ConfigError, match=r"reduce_bucket_size: expected int, got float "
                                          r"\(2\.5\)"):
        Config.from_json(DEEPSPEED_EXAMPLE.replace("2e8", "2.5"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_configs_load_and_round_trip(path):
    if "auto" in path.name:  # "auto" optimizer/scheduler values: zmpi train fills them in
        with pytest.raises(ConfigError, match="'auto' has nothing to be derived"):
            Config.from_json(path)
        return
    c = Config.from_json(path)
    assert Config.from_dict(c.to_dict()) == c
    assert c.resolve_batch(2).train_batch_size is not None


def test_example_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"gpt_stage0_fp32.json", "gpt_stage3_fp16.json", "gpt_stage2_fp16.json"} <= names


def test_round_trip_non_defaults():
    c = Config(train_batch_size=24, train_micro_batch_size_per_gpu=3,
               gradient_accumulation_steps=2, gradient_clipping=0.5,
               optimizer=OptimizerConfig("Adam", 1e-2, (0.8, 0.9), 1e-6, 0.01),
               bf16=BF16Config(True),
               zero_optimization=ZeroConfig(stage=3, strategy="hybrid", overlap_comm=True,
                                            prefetch=False, reduce_bucket_size=10,
                                            offload_optimizer=OffloadConfig("cpu", True)),
               seed=7, steps_per_print=1)
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["optimizer"] == {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.9],
                                                         "eps": 1e-6, "weight_decay": 0.01,
                                                         "adam_w_mode": True}}
    assert Config.from_dict(d) == c
    assert c.strategy_name == "hybrid" and c.dtype_name == "bfloat16"
    assert "train_batch_size" not in Config().to_dict()  # None keys omitted


def test_optimizer_type_normalised():
    for t, want in [("adam", "Adam"), ("ADAMW", "AdamW"), ("AdamW", "AdamW")]:
        assert Config.from_dict({"optimizer": {"type": t}}).optimizer.type == want
    assert OptimizerConfig(type="adam").type == "Adam"


def test_replace():
    c = Config()
    c2 = c.replace(seed=3, zero_optimization={"stage": 3}, optimizer={"lr": 0.5})
    assert (c2.seed, c2.zero_optimization.stage, c2.optimizer.lr) == (3, 3, 0.5)
    assert c2.zero_optimization.reduce_bucket_size == c.zero_optimization.reduce_bucket_size
    assert c.zero_optimization.stage == 0  # frozen original unchanged
    assert c.replace(fp16=FP16Config(enabled=True)).dtype_name == "float16"
    with pytest.raises(ConfigError, match=r"^zero_optimization\.stage: must be one of 0, 1, 2, 3, "
                                          r"got 5"):
        c.replace(zero_optimization={"stage": 5})
    with pytest.raises(ConfigError, match="stagee"):
        c.replace(stagee=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.seed = 1


@pytest.mark.parametrize("d, match", [
    ({"zero_optimization": {"stagee": 1}},
     r"zero_optimization\.stagee: unknown key; did you mean 'stage'\? allowed keys: stage, "),
    ({"zero_optimizaton": {}}, r"^zero_optimizaton: unknown key; did you mean "
                               r"'zero_optimization'\?.*allowed keys:.*train_batch_size"),
    ({"fp16": {"enabled": True, "autocast": True}}, r"^fp16\.autocast: unknown key; did you "
                                                    r"mean 'auto_cast'"),
    ({"optimizer": {"params": {"lrr": 1}}}, r"optimizer\.params\.lrr: unknown key; did you "
                                            r"mean 'lr'\? allowed keys: lr, betas, eps"),
    ({"optimizer": {"type": "Adam", "param": {}}}, r"optimizer\.param: unknown key; did you "
                                                   r"mean 'params'\?"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme": "/x"}}},
     r"zero_optimization\.offload_optimizer\.nvme: unknown key"),
])
def test_unknown_keys(d, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(d)


@pytest.mark.parametrize("d, match", [
    ({"zero_optimization": {"stage": True}}, r"zero_optimization\.stage: expected int, got bool"),
    ({"zero_optimization": {"stage": "2"}}, r"zero_optimization\.stage: expected int, got str"),
    ({"zero_optimization": {"stage": 2.5}}, r"zero_optimization\.stage: expected int, got float"),
    ({"fp16": {"enabled": 1}}, r"fp16\.enabled: expected bool, got int"),
    ({"gradient_clipping": "1.0"}, r"gradient_clipping: expected float, got str"),
    ({"gradient_clipping": True}, r"gradient_clipping: expected float, got bool"),
    ({"optimizer": {"params": {"betas": [0.9]}}},
     r"optimizer\.params\.betas: expected list of 2 numbers"),
    ({"optimizer": {"params": {"betas": [0.9, "x"]}}},
     r"optimizer\.params\.betas\[1\]: expected float, got str"),
    ({"optimizer": {"type": 3}}, r"optimizer\.type: expected str, got int"),
    ({"zero_optimization": []}, r"zero_optimization: expected object, got list"),
    ({"zero_optimization": {"strategy": 3}}, r"zero_optimization\.strategy: expected str or null"),
    ({"zero_optimization": {"reduce_scatter": "yes"}},
     r"zero_optimization\.reduce_scatter: zmpi always reduce-scatters .* got 'yes'"),
    ({"train_batch_size": 8.5}, r"train_batch_size: expected int or null, got float"),
    ({"optimizer": {"params": []}}, r"optimizer\.params: expected object, got list"),
])
def test_wrong_types(d, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(d)


@pytest.mark.parametrize("d, match", [
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization\.stage: must be one of 0, 1, 2, 3,"
                                          r" got 4"),
    ({"zero_optimization": {"stage": -1}}, r"stage: must be one of 0, 1, 2, 3, got -1"),
    ({"optimizer": {"type": "SGD"}}, r"optimizer\.type: unknown optimizer 'SGD'; allowed: Adam, "
                                     r"AdamW"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     r"fp16 and bf16 are both enabled"),
    ({"optimizer": {"params": {"lr": 0}}}, r"optimizer\.params\.lr: must be > 0, got 0"),
    ({"optimizer": {"params": {"lr": -1e-3}}}, r"optimizer\.params\.lr: must be > 0"),
    ({"optimizer": {"params": {"betas": [1.0, 0.9]}}},
     r"optimizer\.params\.betas\[0\]: must be in \[0, 1\), got 1\.0"),
    ({"optimizer": {"params": {"betas": [0.9, -0.1]}}}, r"betas\[1\]: must be in \[0, 1\)"),
    ({"optimizer": {"params": {"eps": 0}}}, r"optimizer\.params\.eps: must be > 0"),
    ({"optimizer": {"params": {"weight_decay": -1}}}, r"weight_decay: must be >= 0"),
    ({"gradient_clipping": -1}, r"gradient_clipping: must be >= 0 \(0 = off\), got -1"),
    ({"train_micro_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu: must be >= 1"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps: must be >= 1, got 0"),
    ({"train_batch_size": 0}, r"train_batch_size: must be >= 1, got 0"),
    ({"steps_per_print": 0}, r"steps_per_print: must be >= 1"),
    ({"seed": -1}, r"seed: must be >= 0"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     r"zero_optimization\.offload_optimizer\.nvme_path: required with \"device\": \"nvme\""),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     r"zero_optimization\.offload_param\.nvme_path: required"),
    ({"zero_optimization": {"offload_param": {"device": "gpu"}}},
     r"zero_optimization\.offload_param\.device: must be one of 'none', 'cpu', 'nvme', got "
     r"'gpu'"),
    ({"zero_optimization": {"offload_optimizer": {"delay_update": True}}},
     r"zero_optimization\.offload_optimizer\.delay_update: needs the optimizer on the host"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "delay_update_warmup": -1}}},
     r"zero_optimization\.offload_optimizer\.delay_update_warmup: must be >= 0"),
    ({"zero_optimization": {"reduce_bucket_size": 0}},
     r"zero_optimization\.reduce_bucket_size: must be >= 1"),
    ({"zero_optimization": {"strategy": ""}}, r"zero_optimization\.strategy: must not be empty"),
    ({"fp16": {"loss_scale": -1}}, r"fp16\.loss_scale: must be >= 0 \(0 = dynamic\)"),
    ({"fp16": {"min_loss_scale": 0}}, r"fp16\.min_loss_scale: must be > 0"),
    ({"fp16": {"hysteresis": 0}}, r"fp16\.hysteresis: must be >= 1"),
    ({"fp16": {"loss_scale_window": 0}}, r"fp16\.loss_scale_window: must be >= 1"),
    ({"fp16": {"initial_scale_power": 100}}, r"fp16\.initial_scale_power: must be in 0\.\.64"),
])
def test_invalid_values(d, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(d)


def test_direct_construction_is_validated():
    with pytest.raises(ConfigError, match=r"^stage: expected int, got bool"):
        ZeroConfig(stage=True)
    with pytest.raises(ConfigError, match=r"^lr: must be > 0"):
        OptimizerConfig(lr=0.0)
    with pytest.raises(ConfigError, match="both enabled"):
        Config(fp16=FP16Config(enabled=True), bf16=BF16Config(enabled=True))
    assert OptimizerConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)


def test_config_error_is_value_error_and_picklable():
    with pytest.raises(ValueError):
        Config.from_dict({"seed": -1})
    e = pickle.loads(pickle.dumps(ConfigError("a.b", "bad")))
    assert (e.key, e.msg, str(e)) == ("a.b", "bad", "a.b: bad")


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_json('{"seed": }')
    with pytest.raises(FileNotFoundError):
        Config.from_json(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="expected object, got list"):
        Config.from_dict([])


def test_resolve_batch_fills_in():
    c = Config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3)
    r = c.resolve_batch(2)
    assert r.train_batch_size == 24 and c.train_batch_size is None
    assert r.resolve_batch(2) == r  # consistent: returned unchanged


def test_resolve_batch_checks():
    c = Config(train_batch_size=32, train_micro_batch_size_per_gpu=4,
               gradient_accumulation_steps=2)
    assert c.resolve_batch(4) is c
    with pytest.raises(ConfigError, match=r"train_batch_size: 32 != train_micro_batch_size_per_gpu"
                                          r" \(4\) \* gradient_accumulation_steps \(2\) \* "
                                          r"world_size \(2\) = 16; gradient_accumulation_steps=4"
                                          r" would match"):
        c.resolve_batch(2)
    with pytest.raises(ConfigError, match=r"= 24$"):
        c.resolve_batch(3)  # 32 not divisible by 4*3: no hint
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigError, match="world_size: must be an int >= 1"):
            c.resolve_batch(bad)


def test_deepspeed_keys_zmpi_always_behaves_as_accept_only_that_value():
    c = Config.from_dict({"zero_optimization": {"stage": 1, "reduce_scatter": True,
                                                "contiguous_gradients": True}})
    assert c == Config(zero_optimization=ZeroConfig(stage=1)) and c.notes() == []
    for section, key, value in [("zero_optimization", "reduce_scatter", False),
                                ("zero_optimization", "zero_quantized_nontrainable_weights",
                                 True),
                                ("zero_optimization", "mics_shard_size", 8),
                                ("fp16", "consecutive_hysteresis", True),
                                (None, "prescale_gradients", True)]:
        d = {key: value} if section is None else {section: {key: value}}
        path = key if section is None else f"{section}.{key}"
        with pytest.raises(ConfigError, match=rf"^{path}: zmpi always .* \(only .* is "
                                              rf"supported\), got {value!r}"):
            Config.from_dict(d)
    with pytest.raises(ConfigError, match="strategy.*hybrid"):
        Config.from_dict({"zero_optimization": {"mics_shard_size": 8}})


def test_inert_keys_are_noted_with_their_path():
    c = Config.from_dict({"flops_profiler": {"enabled": True},
                          "zero_optimization": {"stage": 3, "sub_group_size": 1e9,
                                                "offload_param": {"device": "cpu",
                                                                  "buffer_count": 5}}})
    assert [n.split(":")[0] for n in c.notes()] == [
        "flops_profiler", "zero_optimization.sub_group_size",
        "zero_optimization.offload_param.buffer_count"]
    assert "no FLOP profiler" in c.notes()[0]
    assert c.replace(seed=3).notes() == c.notes()  # replace keeps them


def test_auto_values():
    c = Config.from_dict({"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": 2,
                          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                "stage3_prefetch_bucket_size": "auto"}})
    r = c.resolve_batch(4)
    assert (r.train_micro_batch_size_per_gpu, r.gradient_accumulation_steps) == (6, 2)
    assert r.zero_optimization.reduce_bucket_size == 500_000_000
    assert r.zero_optimization.stage3_prefetch_bucket_size is None
    assert "train_micro_batch_size_per_gpu: 'auto' is 6" in r.notes()
    both = Config.from_dict({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": "auto"}).resolve_batch(2)
    assert (both.train_micro_batch_size_per_gpu, both.gradient_accumulation_steps) == (4, 1)
    derived = Config.from_dict({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3})
    assert derived.resolve_batch(2).train_batch_size == 6
    three = Config.from_dict({"train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                              "train_micro_batch_size_per_gpu": 4}).resolve_batch(2)
    assert (three.train_batch_size, three.gradient_accumulation_steps) == (8, 1)
    given = Config.from_dict({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"})
    assert given.replace(train_micro_batch_size_per_gpu=8).resolve_batch(2) \
        .train_micro_batch_size_per_gpu == 8  # replaced: no longer "auto", kept
    with pytest.raises(ConfigError, match="train_batch_size: 16 != "):
        given.replace(train_micro_batch_size_per_gpu=2).resolve_batch(2)
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu: 'auto' needs "
                                          "train_batch_size"):
        Config.from_dict({"train_micro_batch_size_per_gpu": "auto"}).resolve_batch(2)
    with pytest.raises(ConfigError, match="does not split over 4 ranks"):
        Config.from_dict({"train_batch_size": 6,
                          "train_micro_batch_size_per_gpu": "auto"}).resolve_batch(4)
    for d, key in [({"gradient_clipping": "auto"}, "gradient_clipping"),
                   ({"optimizer": {"params": {"lr": "auto"}}}, "optimizer.params.lr"),
                   ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
                    "scheduler.params.warmup_num_steps")]:
        with pytest.raises(ConfigError, match=rf"^{key}: 'auto' has nothing to be derived"):
            Config.from_dict(d)
    # the flag named is the one zmpi train fills that key from (--steps never fills a warm-up)
    for key, hint in [("warmup_num_steps", r"give a value \(zmpi train takes it from "
                                           r"--warmup-steps\)$"),
                      ("total_num_steps", r"\(zmpi train fills it from --steps\)$"),
                      ("warmup_type", r"give a value$")]:
        with pytest.raises(ConfigError, match=rf"^scheduler.params.{key}: .*{hint}"):
            Config.from_dict({"scheduler": {"type": "WarmupDecayLR", "params": {key: "auto"}}})


def test_scheduler_section():
    c = Config.from_dict({"scheduler": {"type": "WarmupDecayLR",
                                        "params": {"total_num_steps": 100}}})
    assert c.scheduler.type == "WarmupDecayLR"
    assert Config.from_dict(c.to_dict()) == c
    for d, match in [({"type": "Cosine"}, "scheduler.type: unknown scheduler 'Cosine'; "
                                          "allowed: WarmupLR"),
                     ({"type": "WarmupDecayLR"}, "scheduler.params.total_num_steps: "
                                                 "WarmupDecayLR needs it"),
                     ({"type": "WarmupLR", "params": {"warmup_steps": 5}},
                      "scheduler.params.warmup_steps: unknown parameter of WarmupLR; allowed: "
                      "warmup_min_lr"),
                     ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
                      "scheduler.params.warmup_num_steps: must be a positive integer"),
                     ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
                      "scheduler.params.warmup_type: must be 'log' or 'linear'"),
                     ({"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": "x"}},
                      "scheduler.params.cycle_max_lr: expected a number"),
                     ({"params": {"warmup_num_steps": 5}}, "scheduler.params: given without")]:
        with pytest.raises(ConfigError, match=match):
            Config.from_dict({"scheduler": d})


ZMPI = pathlib.Path(__file__).parent.parent / "zmpi"


@pytest.mark.parametrize("module", sorted(
    [p.relative_to(ZMPI).as_posix() for pkg in ("config", "data")
     for p in (ZMPI / pkg).glob("*.py")] + ["memory.py", "optim/lr_schedules.py"]))
def test_no_mpi_import(module):
    """config, memory, data and the schedules are per-process bookkeeping: they never import
    MPI or the rest of zmpi (config reads the LR schedules' parameter tables and the pipeline's
    schedule names and partition methods, the sparse_attention section's modes in
    zmpi.nn.sparsity, and counts nouns with zmpi.words; data checks its files are regular
    ones with zmpi.files, which imports nothing of zmpi's; the config and
    data packages' modules import each other relatively)."""
    tree = ast.parse((ZMPI / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        names = [n for n in names if n not in ("zmpi.optim.lr_schedules",
                                               "zmpi.parallel.pipeline.partition",
                                               "zmpi.parallel.pipeline.schedule", "zmpi.words",
                                               "zmpi.nn.sparsity", "zmpi.files")]
        assert not any(n.split(".")[0] in ("mpi4py", "zmpi") for n in names), names


def test_docs_config_table_lists_every_key():
    """docs/config.md's key table names every field, _ALWAYS and _INERT key of every section."""
    from zmpi.config import (
        AioConfig,
        DebugConfig,
        MemoryBudgetConfig,
        OffloadParamConfig,
        SchedulerConfig,
    )

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "config.md").read_text()
    table = doc[doc.index("| how | keys |"):doc.index("Where zmpi's default differs")]
    for cls in (Config, OptimizerConfig, SchedulerConfig, FP16Config, BF16Config, ZeroConfig,
                OffloadConfig, OffloadParamConfig, DebugConfig, MemoryBudgetConfig, AioConfig):
        for key in [f.name for f in dataclasses.fields(cls)] + list(cls._ALWAYS) + \
                list(cls._INERT):
            assert f"`{key}" in table or f"{key}`" in table or f".{key}" in table, \
                (cls.__name__, key)


def test_keys_idle_under_the_rest_of_the_config_are_noted():
    """Keys set away from their defaults that the rest of the config leaves without effect
    (stage 3's at stages 0-2, fp16's loss scaling with fp16 off, the pipeline's with one
    stage) are named in the notes the engine prints; at their defaults, or where they act,
    nothing is said."""
    idle = Config.from_dict({"zero_optimization": {"stage": 1, "stage3_max_live_parameters": 1},
                             "fp16": {"loss_scale": 128}, "pipeline": {"schedule": "gpipe"}})
    assert idle.notes() == ["fp16.loss_scale: no effect with fp16 disabled",
                            "zero_optimization.stage3_max_live_parameters: no effect at stage 1",
                            "pipeline.schedule: no effect at stages 1"]
    acting = Config.from_dict({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1},
                               "fp16": {"enabled": True, "loss_scale": 128},
                               "pipeline": {"stages": 2, "schedule": "gpipe"}})
    assert acting.notes() == []
    plugin = {"zero_optimization": {"strategy": "hybrid", "stage3_max_live_parameters": 1}}
    assert Config.from_dict(plugin).notes() == []  # a strategy may act on them at any stage

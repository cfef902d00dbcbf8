"""The `zmpi` command: `estimate` reproduces the paper's table; `train` runs end to end."""
import json
import os
import subprocess
import sys

import pytest
from mpi_util import CLI, REPO_ROOT, launch_mpi

from zmpi.cli.config_from_flags import DEFAULTS


def test_estimate_reproduces_design_table():
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--params", "7.5e9",
                          "--world-size", "64"], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT).stdout
    gb = [line.split()[1] for line in out.splitlines()[2:]]
    assert gb == ["120.0", "31.4", "16.6", "1.9"], out


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`zmpi estimate ... | head -0`: status 1 and no BrokenPipeError traceback (the pipe's
    read end is closed before the command, still importing, writes a line)."""
    proc = subprocess.Popen([sys.executable, "-m", "zmpi.cli", "estimate", "--params", "7.5e9",
                             "--world-size", "64"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1 and "Error" not in err, err


def test_train_two_ranks_end_to_end(tmp_path):
    result = launch_mpi(CLI, 2, timeout=180, args=[
        "train", "--stage", "3", "--precision", "fp16", "--steps", "30", "--n-layer", "1",
        "--delay-update", "10", "--profile",
        "--d-model", "32", "--seq-len", "32", "--sample-tokens", "20",
        "--out", tmp_path / "run", "--log-dir", tmp_path / "logs"])
    assert result.returncode == 0, result.describe()
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert meta["world_size"] == 2 and meta["engine"]["strategy"] == "stage3"
    assert meta["git_revision"] and meta["environment"]["mpi_library"]
    assert meta["optimizer_timing"]["delayed_steps"] == 30 - 10  # --delay-update 10
    lines = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    losses = [float(line.split(",")[1]) for line in lines[1:]]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.3  # it learns
    table = result.stdout[result.stdout.index("model-state memory"):].splitlines()
    assert table[1] == ("declared: the strategy's own expected_model_state(); ZeRO-3: the "
                        "SC'20 formula of ZeRO stage 3 over 2 ranks (closest to its sharding)")
    assert table[2].split()[3:] == ["device", "MiB", "declared", "ZeRO-3", "host", "MiB",
                                    "declared", "ZeRO-3", "device", "peak"], table
    for row in table[3:5]:  # per rank: measured == declared == stage 3's formula (+ offload)
        _rank, _psi, _padding, device, *device_formulas, host, host_formula, host_zero, _ = \
            row.split()
        assert [device, device] == device_formulas and host == host_formula == host_zero, table
        assert float(host) > 0 and "optimizer on" in table[0]
    assert "--- sample ---" in result.stdout
    assert "time per step by phase" in result.stdout
    profile = meta["profile"].splitlines()  # header, 2 ranks, critical path, header, 3 units
    assert len(profile) == 8 and profile[4].split()[:2] == ["unit", "forward"]
    assert profile[3].split()[:4] in (["critical", "path:", "rank", "0"],
                                      ["critical", "path:", "rank", "1"])
    units = [line.split() for line in profile[5:]]
    assert [u[1] for u in units] == ["TokenPositionEmbedding", "Block", "LMHead"]
    assert all(float(ms) > 0 for u in units for ms in u[2:4])  # forward, backward
    assert (tmp_path / "logs" / "rank1.log").read_text().count("step") >= 3


def _args(**kw):
    import argparse

    base = {"config": None, "batch": None, "lr": None, "stage": None, "precision": None,
            "seed": None, "strategy": None, "offload_optimizer": False, "offload_param": False,
            "delay_update": None, "shard_group_size": None, "lr_schedule": None,
            "warmup_steps": None, "steps": 100, "profile": False, "data": None,
            "vocab_size": None, "recompute": None,
            **{k: DEFAULTS[k] for k in ("seq_len", "n_layer", "n_head", "d_model")}}
    return argparse.Namespace(**{**base, **kw})


def test_flags_override_config(tmp_path):
    from zmpi.cli.config_from_flags import build_config
    from zmpi.config import Config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 64, "gradient_accumulation_steps": 2,
                                "fp16": {"enabled": True, "loss_scale_window": 100}}))
    cfg = Config.from_dict(build_config(_args(config=str(path)), 4)).resolve_batch(4)
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.train_batch_size == 64
    cfg = Config.from_dict(build_config(_args(config=str(path), precision="bf16", batch=16), 4))
    assert cfg.dtype_name == "bfloat16" and cfg.fp16.loss_scale_window == 100
    assert cfg.resolve_batch(4).train_micro_batch_size_per_gpu == 2
    assert Config.from_dict(build_config(_args(config=str(path), precision="fp32"), 4)) \
        .dtype_name == "float32"
    with pytest.raises(SystemExit, match="does not split"):
        build_config(_args(batch=30), 4)
    notes = []
    build_config(_args(config=str(path), precision="bf16", stage=1), 4, notes)
    assert notes == ["--precision overrides the config's fp16.enabled = True with False"]


def test_offload_flags_set_deepspeed_keys(tmp_path):
    from zmpi.cli.config_from_flags import build_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "none", "pin_memory": False}}}))
    notes = []
    zero = build_config(_args(config=str(path), delay_update=5, offload_param=True), 2,
                        notes)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False,
                                         "delay_update": True, "delay_update_warmup": 5}
    assert zero["offload_param"] == {"device": "cpu"}
    assert notes == ["--delay-update overrides the config's "
                     "zero_optimization.offload_optimizer.device = 'none' with 'cpu'"]


def test_estimate_with_offload_gives_device_and_host_memory():
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--params", "7.5e9",
                          "--world-size", "64", "--offload-optimizer"], capture_output=True,
                         text=True, check=True, cwd=REPO_ROOT).stdout
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[2:]}
    assert rows["0"] == ["-", "-"] and "needs stage 1, 2 or 3" in out
    assert rows["1"] == ["30.0", "1.6"] and rows["2"] == ["15.0", "1.6"]
    assert rows["3"] == ["0.2", "1.6"], out


def _train(tmp_path, n, *extra):
    result = launch_mpi(CLI, n, timeout=180, args=[
        "train", "--precision", "fp16", "--n-layer", "1", "--d-model", "32", "--seq-len", "32",
        "--batch", "4", "--sample-tokens", "5", *extra])
    assert result.returncode == 0, result.describe()
    return result


def _losses(run_dir):
    lines = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    return {int(line.split(",")[0]): float(line.split(",")[1]) for line in lines}


def test_train_save_every_and_resume(tmp_path):
    """8 steps straight == 4 steps, an async save, a new mpiexec resuming to 8 (bit for bit,
    2 ranks, stage 3); resuming the same checkpoint on 1 rank at stage 0 goes on too."""
    _train(tmp_path, 2, "--stage", "3", "--steps", "8", "--out", tmp_path / "whole")
    _train(tmp_path, 2, "--stage", "3", "--steps", "4", "--save-every", "2", "--keep-last",
           "1", "--async-save", "--out", tmp_path / "first", "--ckpt-dir", tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".zmpi-lock", "latest", "step4"]
    out = _train(tmp_path, 2, "--stage", "3", "--steps", "8", "--resume", tmp_path / "ck",
                 "--out", tmp_path / "second").stdout
    assert "resumed from" in out and \
        "step 4, saved by 2 ranks, dp 2 x pp 1 x tp 1, with stage3" in out
    whole, second = _losses(tmp_path / "whole"), _losses(tmp_path / "second")
    assert sorted(second) == [4, 5, 6, 7]
    assert [second[s] for s in second] == [whole[s] for s in second]
    _train(tmp_path, 1, "--stage", "0", "--steps", "8", "--resume", tmp_path / "ck",
           "--out", tmp_path / "third")
    third = _losses(tmp_path / "third")
    assert third[4] == pytest.approx(whole[4], rel=1e-3)  # same weights, sums in fp16 order


def test_resume_from_a_bad_checkpoint_is_one_clear_line(tmp_path):
    result = launch_mpi(CLI, 2, timeout=120, args=[
        "train", "--steps", "2", "--n-layer", "1", "--d-model", "32", "--resume",
        tmp_path / "nowhere", "--out", tmp_path / "run"])
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.describe()
    assert result.stderr.count("cannot resume") == 1 and "missing" in result.stderr


def test_checkpoint_flags_without_save_every_are_rejected():
    out = subprocess.run([sys.executable, "-m", "zmpi.cli", "train", "--keep-last", "2"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 2 and "only with --save-every" in out.stderr


def test_seed_and_strategy_flags(tmp_path):
    from zmpi.cli.config_from_flags import build_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"seed": 7, "zero_optimization": {"strategy": "stage2"}}))
    assert build_config(_args(config=str(path)), 1)["seed"] == 7  # the config's seed holds
    notes = []
    assert build_config(_args(config=str(path), seed=3), 1, notes)["seed"] == 3
    assert notes == ["--seed overrides the config's seed = 7 with 3"]
    assert build_config(_args(config=str(path), stage=2), 1)["zero_optimization"]["stage"] == 2
    with pytest.raises(SystemExit, match="--stage 1 contradicts the strategy 'stage2'"):
        build_config(_args(config=str(path), stage=1), 1)
    cfg = build_config(_args(strategy="mypkg.mod:Mine"), 1)
    assert cfg["zero_optimization"] == {"strategy": "mypkg.mod:Mine"}


def test_shard_group_size_flag():
    from zmpi.cli.config_from_flags import build_config

    cfg = build_config(_args(strategy="hybrid", shard_group_size=2), 4)
    assert cfg["zero_optimization"] == {"strategy": "hybrid", "shard_group_size": 2}


def _train_here(*flags) -> str:
    """`zmpi train` in this process (one rank); its stdout."""
    import contextlib
    import io

    from zmpi.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["train", *map(str, flags)])
    return out.getvalue()


def test_the_run_names_its_stage_and_where_it_came_from(tmp_path):
    """Without --config zmpi train runs ZeRO-3; a config without a stage runs DeepSpeed's
    stage 0 (docs/recompute.md's JSON ran at stage 0, `--recompute full` alone at stage 3,
    and --help said 3 for both). The first line says which and why, counts in the singular
    where one, and --profile times full recompute on its own (its column read 0.0 unless the
    config also set activation_checkpointing.profile)."""
    recompute = tmp_path / "recompute.json"
    recompute.write_text(json.dumps({"activation_checkpointing": {"recompute": "full"}}))
    staged = tmp_path / "staged.json"
    staged.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    tiny = ["--steps", "1", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len",
            "8", "--batch", "2", "--sample-tokens", "0"]
    for i, (flags, said) in enumerate((
            ([], "stage3 (zmpi train's default without --config)"),
            (["--config", staged], f"stage2 (zero_optimization.stage in {staged})"),
            (["--config", staged, "--stage", "1"], "stage1 (--stage)"),
            (["--strategy", "stage0"], "stage0 (--strategy)"))):
        out = _train_here(*tiny, *flags, "--out", tmp_path / f"run{i}")
        first = next(line for line in out.splitlines() if line.startswith("zmpi train: GPT"))
        assert f"1 rank (dp 1 x pp 1 x tp 1), {said}, float32, " in first, first
        assert first.endswith(", 1 step") and "over 1 step:" in out, out
    out = _train_here("--config", recompute, "--profile", "--steps", "3", "--n-layer", "2",
                      "--d-model", "64", "--n-head", "2", "--seq-len", "32", "--batch", "4",
                      "--sample-tokens", "0", "--out", tmp_path / "profiled")
    assert f"stage0 (DeepSpeed's default: {recompute} gives no zero_optimization.stage)" in out
    run = json.loads((tmp_path / "profiled" / "run.json").read_text())
    assert run["config"]["activation_checkpointing"]["profile"] is True
    units = run["profile"].splitlines()[-4:]  # the embedding, 2 blocks (recomputed), LM head
    assert [u.split()[1] for u in units] == ["TokenPositionEmbedding", "Block", "Block", "LMHead"]
    assert all(float(u.split()[-1]) > 0 for u in units[1:3]), units
    help_text = subprocess.run([sys.executable, "-m", "zmpi.cli", "train", "--help"],
                               capture_output=True, text=True, cwd=REPO_ROOT).stdout
    assert "ZeRO stage (default: without --config 3; with --config its " \
           "zero_optimization.stage, and 0 where it gives none, as in DeepSpeed)" in \
           " ".join(help_text.split()), help_text


SMALL = ["--n-layer", "1", "--d-model", "32", "--seq-len", "32", "--sample-tokens", "5",
         "--steps", "4"]


def test_memory_table_shows_a_plugins_declaration_beside_its_closest_stage(
        tmp_path, monkeypatch, isolated_registry):
    """The tutorial strategy of docs/strategies.md shards the optimizer only: its table
    compares its own declaration with ZeRO-1's formula, and says which column is which."""
    from test_strategies_doc import example_code

    (tmp_path / "zero1_allreduce.py").write_text(example_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    out = _train_here("--strategy", "zero1_allreduce:Zero1Allreduce", "--steps", "1",
                      "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8",
                      "--batch", "2", "--sample-tokens", "0", "--out", tmp_path / "run")
    table = out[out.index("model-state memory"):].splitlines()
    assert "ZeRO-1: the SC'20 formula of ZeRO stage 1 over 1 rank" in table[1], table
    _rank, _psi, _padding, device, declared, zero, *_ = table[3].split()
    assert device == declared == zero, table  # at N = 1, stage 1 holds what stage 0 does


def test_stage_formula_is_the_closest_stages_and_refuses_what_it_lacks():
    from types import SimpleNamespace

    import numpy as np

    from zmpi.cli.report import closest_zero_stage, stage_formula
    from zmpi.memory import model_state_bytes

    def strategy(flags, offload=False):
        return SimpleNamespace(
            shard_optimizer=flags[0], shard_gradients=flags[1], shard_parameters=flags[2],
            dtype=np.dtype(np.float16), master_dtype=np.dtype(np.float32), world_size=4,
            layout=SimpleNamespace(full_numel=4000), offload_optimizer=offload,
            offload_param=False, grads_spare=None)

    for stage, flags in enumerate([(0, 0, 0), (1, 0, 0), (1, 1, 0), (1, 1, 1)]):
        s = strategy(flags)
        assert closest_zero_stage(s) == stage
        assert stage_formula(s) == {"device": model_state_bytes(4000, 4, stage), "host": 0}
    assert stage_formula(strategy((1, 1, 0), offload=True)) == {"device": 4000 * 2,
                                                                 "host": 1000 * (2 + 12)}
    assert stage_formula(strategy((0, 0, 0), offload=True)) is None  # stage 0 has no offload


def test_traffic_line_says_when_overflow_steps_were_skipped():
    """1.236 MiB per step against a declared 1.545 looked like a mismatch: the line says that
    2 of the steps were skipped on an fp16 overflow, and sent less."""
    from types import SimpleNamespace

    from zmpi.cli.report import traffic_line

    engine = SimpleNamespace(expected_traffic=lambda: {"shard": 1.545 * 2**20},
                             sent_bytes=lambda: {"shard": 6.18 * 2**20},
                             mesh=SimpleNamespace(tp=1))
    line = traffic_line(engine, 5, skipped=2)
    assert line == ("traffic sent by this rank over 5 steps: shard 6.18 MiB (1.236 per step; "
                    "declared 1.545 without accumulation); 2 of 5 steps skipped on an fp16 "
                    "overflow, which send less than declared (no update to publish)")
    assert "skipped" not in traffic_line(engine, 5)


@pytest.mark.mpi
def test_fp64_trains_like_one_process_at_any_world_size(tmp_path):
    """--precision fp64: the float64 model the parity suite uses. The losses of 1, 2 and 3
    ranks (3: uneven shards) agree to rounding; fp32's differ in the 7th digit and beyond."""
    losses = {}
    for n in (1, 2, 3):
        out = tmp_path / f"n{n}"
        result = launch_mpi(CLI, n, timeout=180, args=[
            "train", "--precision", "fp64", "--stage", "3", "--steps", "6", "--batch", "6",
            "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "16",
            "--sample-tokens", "0", "--out", out])
        assert result.returncode == 0, result.describe()
        assert ", float64, global batch 6 x 16 tokens" in result.stdout, result.stdout
        rows = (out / "metrics.csv").read_text().splitlines()[1:]
        losses[n] = [float(row.split(",")[1]) for row in rows]
    assert len(losses[1]) == 6 and losses[1][-1] < losses[1][0]
    for n in (2, 3):
        assert losses[n] == pytest.approx(losses[1], rel=1e-12, abs=0), (n, losses)


@pytest.mark.mpi
@pytest.mark.parametrize("name,extra", [
    ("ds_stage2_offload_warmupdecay.json", []),
    ("ds_stage3_bf16_cosine.json", []),
    ("hf_stage1_auto.json", ["--batch", "16", "--warmup-steps", "2", "--lr", "2e-3"]),
])
def test_public_style_configs_run_at_two_ranks(tmp_path, name, extra):
    """Config files of the kind public training repositories carry run as they are; the lr
    column of metrics.csv follows the schedule (DeepSpeed semantics: step k at rate k-1)."""
    from zmpi.cli.config_from_flags import _read_config, build_config
    from zmpi.optim.lr_schedules import build

    result = launch_mpi(CLI, 2, timeout=180, args=[
        "train", "--config", REPO_ROOT / "configs" / name, *SMALL, *extra,
        "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0].endswith(",lr,skipped_steps") and len(rows) == 5
    args = _args(config=str(REPO_ROOT / "configs" / name), steps=4,
                 **{k.lstrip("-").replace("-", "_"): float(v) if k == "--lr" else int(v)
                    for k, v in zip(extra[::2], extra[1::2], strict=True)})
    cfg = build_config(args, 2)
    opt = cfg["optimizer"]["params"]
    schedule = build(cfg["scheduler"]["type"], cfg["scheduler"]["params"], opt["lr"],
                     opt.get("betas", (0.9, 0.999)))
    lrs = [float(r.split(",")[-2]) for r in rows[1:]]
    skipped = [0] + [int(r.split(",")[-1]) for r in rows[1:]]  # fp16 overflows, cumulative
    # step k runs at rate(applied steps before it - 1); a skipped step shows the rate it
    # would have run at and does not advance the schedule
    assert lrs == pytest.approx([schedule.lr(k - skipped[k] - 1) for k in range(4)],
                                rel=1e-12)
    if name.startswith("hf"):
        assert "'auto' is" in result.stdout  # the resolved values are printed
    assert _read_config(args.config)  # the file itself is unchanged JSON
    stderr_notes = [line for line in result.stderr.splitlines() if "zmpi config:" in line]
    assert len(stderr_notes) <= 1  # accepted-without-effect keys: one line, rank 0 only


@pytest.mark.mpi
def test_config_errors_are_one_line_on_rank_0(tmp_path):
    bad = {
        "unknown.json": ('{"zero_optimization": {"stagee": 2}}',
                         "zero_optimization.stagee: unknown key; did you mean 'stage'?"),
        "invalid.json": ('{"fp16": {"enabled": true,}}', "not valid JSON: "),
        "always.json": ('{"zero_optimization": {"stage": 2, "reduce_scatter": false}}',
                        "zero_optimization.reduce_scatter: zmpi always reduce-scatters"),
        "missing.json": (None, "cannot read"),
    }
    for name, (text, message) in bad.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        result = launch_mpi(CLI, 2, timeout=60,
                            args=["train", "--config", path, *SMALL])
        assert result.returncode != 0, name
        lines = result.ranks_stderr()
        assert len(lines) == 1 and message in lines[0], (name, result.stderr)
        assert lines[0].startswith(f"zmpi train: config {path}: ")


@pytest.mark.mpi
def test_train_on_a_binary_token_file(tmp_path):
    import numpy as np

    (np.arange(20000) * 13 % 97).astype(np.uint16).tofile(tmp_path / "train.bin")
    result = launch_mpi(CLI, 2, timeout=120, args=[
        "train", "--data", tmp_path / "train.bin", "--vocab-size", "97", *SMALL,
        "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    assert "GPT" in result.stdout and len((tmp_path / "run" / "metrics.csv").read_text()
                                          .splitlines()) == 5
    sample = (tmp_path / "run" / "sample.txt").read_text().split()
    assert len(sample) == 8 + 5 and all(0 <= int(t) < 97 for t in sample)


def test_estimate_from_a_shape_per_stage_precision_offload_and_json():
    from zmpi.models.gpt import GPT, GPTConfig
    from zmpi.models.gpt_counts import gpt_num_params

    assert gpt_num_params(2, 32, 65, 16) == GPT(GPTConfig(65, 16, 2, 2, 32)).num_parameters()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", *args],
                              capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout

    out = json.loads(run("--params", "1e9", "--world-size", "4", "--stage", "2",
                         "--precision", "fp32", "--json"))
    # fp32: 4 B params + (4 B grads + 12 B master, m, v) / 4 = 8 GB per rank; 2 Psi 3/4 sent
    assert [s["stage"] for s in out["stages"]] == [2]
    assert out["stages"][0]["device_gb"] == pytest.approx(8.0)
    assert out["stages"][0]["traffic_elements"] == pytest.approx(1.5e9)
    off = json.loads(run("--params", "1e9", "--world-size", "4", "--stage", "2",
                         "--offload-optimizer", "--json"))["stages"][0]
    # fp16 stage 2 + optimizer offload: device 2 Psi (params), host (12 + 2) Psi / 4
    assert (off["device_gb"], off["host_gb"]) == (pytest.approx(2.0), pytest.approx(3.5))
    assert "stage 3" in run("--params", "1e9", "--world-size", "4", "--offload-param")
    table = run("--n-layer", "48", "--d-model", "1600", "--world-size", "64")
    assert "Psi = 1.558e+09" in table  # GPT-2 XL's shape, tied head
    text = run("--n-layer", "2", "--d-model", "16", "--seq-len", "8", "--world-size", "2",
               "--tp", "2", "--micro-batch", "4", "--sequence-parallel")
    # (4 L + 2) B T C = 10 x 4 x 8 x 16 each way, 3 B T allreduced
    assert "5120 elements reduce-scattered and as many allgathered" in text
    assert "96 allreduced" in text
    refused = subprocess.run([sys.executable, "-m", "zmpi.cli", "estimate", "--n-layer", "2",
                              "--world-size", "2", "--sequence-parallel"],
                             capture_output=True, text=True, cwd=REPO_ROOT)
    assert refused.returncode != 0
    assert "--sequence-parallel needs --tp above 1 and --micro-batch" in refused.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["memory_budget", "small_drive"])
def test_engine_build_failures_are_one_line_from_rank_0(tmp_path, case):
    """Issue 49: what building the engine raises alike on every rank was a traceback from
    each rank: a model beyond the config's memory_budget (OutOfMemory: the input, exit 2), an
    nvme_path on a drive too small for the swap files (NVMeError: the machine, exit 1; a
    300 KiB tmpfs, skipped where this process cannot mount one)."""
    config, zero = tmp_path / "c.json", {"stage": 3}
    if case == "small_drive":
        drive = tmp_path / "drive"
        drive.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(drive)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(drive)}}
    config.write_text(json.dumps({"zero_optimization": zero, **(
        {"memory_budget": {"device": 100000}} if case == "memory_budget" else {})}))
    try:
        result = launch_mpi(CLI, 2, timeout=60, args=[
            "train", "--config", config, "--n-layer", "2", "--d-model", "128", "--steps", "1",
            "--out", tmp_path / "run"])
    finally:
        if case == "small_drive":
            assert os.listdir(drive) == []  # nothing reserved, nothing left
            subprocess.run(["umount", str(drive)], check=True)
    want = {"memory_budget": (2, f"zmpi train: config {config}: device memory budget of 0.1 "
                                 "MiB exceeded: params (param, "),
            "small_drive": (1, f"zmpi train: nvme_path {tmp_path / 'drive'}: 0.3 MiB free, "
                               "the optimizer state of this rank needs ")}[case]
    lines = result.ranks_stderr()
    assert result.returncode == want[0] and len(lines) == 1, result.describe()
    assert lines[0].startswith(want[1]), result.describe()

"""Bad inputs to `zmpi train` and the data loader: each is one line from rank 0 on stderr and
exit code 2, never a traceback, never a silently replaced value, never once per rank; a
nanoGPT meta.pkl is read without running code. Most cases run in-process (`main([...])`,
one rank); two launches at 2 ranks check that the line is printed once."""
import json
import pickle

import numpy as np
import pytest
from mpi_util import CLI, RANKS_DIR, launch_mpi

from zmpi.cli import main
from zmpi.cli.config_from_flags import InputError, build_config
from zmpi.config import Config, ConfigError
from zmpi.data import load_tokens

TINY = ["--steps", "1", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len",
        "8", "--sample-tokens", "0"]


class _RunsCode:
    """Unpickling this calls open(marker, "w"): it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _token_file(directory, n=2000, vocab=65):
    directory.mkdir(parents=True, exist_ok=True)
    (np.arange(n) % vocab).astype(np.uint16).tofile(directory / "train.bin")
    return directory / "train.bin"


def _nanogpt_meta(vocab=65):
    chars = [chr(32 + i) for i in range(vocab)]
    return {"vocab_size": vocab, "itos": dict(enumerate(chars)),
            "stoi": {c: i for i, c in enumerate(chars)}}


# --- Item A: meta.pkl never runs code -----------------------------------------------------

def test_meta_pkl_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    data = _token_file(tmp_path / "evil")
    marker = tmp_path / "marker"
    with open(tmp_path / "evil" / "meta.pkl", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    with pytest.raises(ValueError, match=r"meta\.pkl: not a plain-data pickle: refused global"):
        load_tokens(data)
    assert not marker.exists()
    # the same through zmpi train: one line, exit code 2, nothing ran
    err = _train_fails(["--data", str(data)], tmp_path)
    assert "meta.pkl: not a plain-data pickle" in err and not marker.exists()


def test_plain_nanogpt_meta_pkl_and_meta_json_still_work(tmp_path):
    data = _token_file(tmp_path / "pkl")
    with open(tmp_path / "pkl" / "meta.pkl", "wb") as f:
        pickle.dump(_nanogpt_meta(65), f)
    tokens, vocab = load_tokens(data)
    assert vocab == 65 and len(tokens) == 2000
    data = _token_file(tmp_path / "json")
    (tmp_path / "json" / "meta.json").write_text(json.dumps({"vocab_size": 65}))
    assert load_tokens(data)[1] == 65


@pytest.mark.parametrize("meta,message", [
    ({**_nanogpt_meta(), "vocab_size": True}, r"vocab_size must be an int in 1\.\.65536"),
    ({**_nanogpt_meta(), "vocab_size": 0}, r"vocab_size must be an int in 1\.\.65536"),
    ({**_nanogpt_meta(), "vocab_size": 70000}, r"vocab_size must be an int in 1\.\.65536"),
    ({**_nanogpt_meta(), "vocab_size": 65.0}, r"vocab_size must be an int in 1\.\.65536"),
    ({"itos": {}}, r'has no "vocab_size" key'),
    ([65], r"holds a list, not a dict"),
])
def test_bad_vocabulary_metadata_is_a_value_error_naming_the_file(tmp_path, meta, message):
    data = _token_file(tmp_path / "d")
    with open(tmp_path / "d" / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    with pytest.raises(ValueError, match=r"meta\.pkl: " + message):
        load_tokens(data)
    (tmp_path / "d" / "meta.pkl").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=r"meta\.pkl: not a plain-data pickle"):
        load_tokens(data)


# --- Item B: one line, exit code 2 ---------------------------------------------------------

def _tiny_with(flags) -> list[str]:
    """TINY without the flags that `flags` gives (a repeated flag gets a note of its own)."""
    given = {str(f).split("=", 1)[0] for f in flags if str(f).startswith("--")}
    pairs = zip(TINY[::2], TINY[1::2], strict=True)
    return [item for flag, value in pairs if flag not in given for item in (flag, value)]


def _train_fails(flags, tmp_path) -> str:
    """Run `zmpi train TINY flags` in-process; assert exit code 2 and no traceback; return
    stderr (the caller checks it is one line via `_one_line`)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main(["train", *_tiny_with(flags), "--out", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2, (exit_info.value.code, err.getvalue())
    return _one_line(err.getvalue())


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_unknown_flag_is_one_line_and_exit_2(tmp_path):
    line = _train_fails(["--foo"], tmp_path)
    assert line == "zmpi: unrecognized arguments: --foo (see zmpi --help)"


def _config(tmp_path, text) -> list:
    path = tmp_path / "c.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return ["--config", str(path)]


FLAG_CASES = [  # (flags, what the line says)
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--batch", "-4"], "--batch must be >= 1, got -4"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--steps", "-3"], "--steps must be >= 1, got -3"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--n-layer", "0"], "--n-layer must be >= 1, got 0"),
    (["--d-model", "0"], "--d-model must be >= 1, got 0"),
    (["--n-head", "3", "--d-model", "32"], "--n-head 3 does not divide --d-model 32"),
    (["--sample-tokens", "-1"], "--sample-tokens must be >= 0, got -1"),
    (["--warmup-steps", "0"], "--warmup-steps must be >= 1, got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
    (["--keep-last", "2"], "--keep-last and --async-save act only with --save-every K"),
    (["--steps", "abc"], "zmpi train: argument --steps: invalid int value: 'abc'"),
    (["--lr-schedule", "constant", "--warmup-steps", "3"],
     "--warmup-steps needs a schedule, not constant"),
    (["--vocab-size", "200"], "--vocab-size acts only with --data"),
    (["--resume-tag", "step1"], "--resume-tag and --resume-fallback act only with --resume"),
]


@pytest.mark.parametrize("flags,message", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_bad_flags_are_one_line_and_exit_2(tmp_path, flags, message):
    line = _train_fails(flags, tmp_path)
    assert line.startswith("zmpi train: ") and message in line, line


CONFIG_CASES = [  # (config, what the line says after "config FILE: ")
    ({"train_batch_size": 0}, "train_batch_size: must be >= 1, got 0"),
    ({"train_batch_size": True}, "train_batch_size: expected int or null, got bool (True)"),
    ('{"train_batch_size": Infinity}', "train_batch_size: must be a finite number, got inf"),
    ('{"wall_clock_breakdown": NaN}', "wall_clock_breakdown: must be a finite number, got nan"),
    ('{"optimizer": {"params": {"betas": [0.9, 1e400]}}}',
     "optimizer.params.betas[1]: must be a finite number, got inf"),
    ('{"train_batch_size": 4, "train_batch_size": 8}',
     "train_batch_size: given twice in one object: give it once"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": -1, "cycle_max_lr": 1}}},
     "scheduler.params.cycle_min_lr: must be a finite number >= 0, got -1"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}},
     "scheduler.params.total_num_steps: must be a number of steps >= 1, got 0"),
    ({"zero_optimization": {"stage": 1, "strategy": "stage3"}},
     "zero_optimization.stage: 1 contradicts the strategy 'stage3', which shards as ZeRO "
     "stage 3: give one of them"),
    ({"zero_optimization": None}, "zero_optimization: expected object, got NoneType (None)"),
    ({"model": None}, "model: expected object, got NoneType (None)"),
    ({"model": {"n_layer": "2"}}, "model.n_layer: expected int or null, got str ('2')"),
    ({"model": {"n_layer": 0}}, "model.n_layer: must be >= 1, got 0"),
    ({"seed": 3.0}, "seed: expected int, got float (3.0)"),
    ({"train_batch_size": 32.0}, "train_batch_size: expected int or null, got float (32.0)"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: must be >= 1, got 0"),
    ({"gradient_accumulation_steps": 2.5},
     "gradient_accumulation_steps: expected int, got float (2.5)"),
    ({"train_micro_batch_size_per_gpu": False},
     "train_micro_batch_size_per_gpu: expected int, got bool (False)"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping: must be a finite number, got nan"),
    ({"zero_optimization": {"strategy": "zmpi_no_such_module:Foo"}},
     "zero_optimization.strategy: cannot load partition strategy 'zmpi_no_such_module:Foo': "
     "No module named 'zmpi_no_such_module'"),
    ({"zero_optimization": {"strategy": "zmpi.zero.strategy:NoSuchClass"}},
     "zero_optimization.strategy: cannot load partition strategy "
     "'zmpi.zero.strategy:NoSuchClass': module 'zmpi.zero.strategy' has no attribute "
     "'NoSuchClass'"),
]


@pytest.mark.parametrize("config,message", CONFIG_CASES,
                         ids=[str(c[0])[:50] for c in CONFIG_CASES])
def test_bad_config_values_are_one_line_and_exit_2(tmp_path, config, message):
    flags = _config(tmp_path, config)
    line = _train_fails(flags, tmp_path)
    assert line == f"zmpi train: config {flags[1]}: {message}", line


def test_batch_that_does_not_split_and_strategy_flag(tmp_path):
    flags = _config(tmp_path, {"train_batch_size": 7, "gradient_accumulation_steps": 2})
    line = _train_fails(flags, tmp_path)
    assert line == (f"zmpi train: global batch 7 (train_batch_size in {flags[1]}) does not "
                    "split over 1 data-parallel rank x 2 accumulation steps")
    line = _train_fails(["--strategy", "zmpi_no_such_module:Foo"], tmp_path)
    assert line.startswith("zmpi train: config from the flags: zero_optimization.strategy: "
                           "cannot load partition strategy")


def test_bad_data_files_are_one_line_and_exit_2(tmp_path):
    line = _train_fails(["--data", str(tmp_path / "missing.bin"), "--vocab-size", "10"],
                        tmp_path)
    assert line.startswith(f"zmpi train: --data {tmp_path / 'missing.bin'}: ")
    assert line.endswith(": not found")
    short = _token_file(tmp_path / "short", n=20, vocab=10)  # 18 + 2 after the split
    line = _train_fails(["--data", str(short), "--vocab-size", "10"], tmp_path)
    assert "20 tokens are too few for --seq-len 8" in line and "each need seq_len + 1 = 9" in line
    line = _train_fails(["--data", str(short), "--vocab-size", "65537"], tmp_path)  # uint16 ids
    assert line == (f"zmpi train: --data {short}: vocab_size must be an int in 1..65536 (the "
                    "ids are uint16), got 65537")
    (tmp_path / "short" / "meta.json").write_text('{"vocab_size": "x"}')
    line = _train_fails(["--data", str(short)], tmp_path)
    assert "meta.json: vocab_size must be an int in 1..65536" in line
    (tmp_path / "short" / "meta.json").write_text('{"vocab_size": 10')
    assert "meta.json: not valid JSON" in _train_fails(["--data", str(short)], tmp_path)
    nometa = _token_file(tmp_path / "nometa", vocab=10)
    assert "give the vocabulary size" in _train_fails(["--data", str(nometa)], tmp_path)
    assert "token id 9 >= vocab size 5" in _train_fails(
        ["--data", str(nometa), "--vocab-size", "5"], tmp_path)


def test_build_config_refuses_instead_of_replacing(tmp_path):
    """--batch 0 and train_batch_size 0 used to become 32 (an `or`); build_config (also an API)
    refuses them before any arithmetic."""
    import argparse

    base = {"config": None, "batch": None, "lr": None, "stage": None, "precision": None,
            "seed": None, "strategy": None, "offload_optimizer": False, "offload_param": False,
            "delay_update": None, "shard_group_size": None, "lr_schedule": None,
            "warmup_steps": None, "steps": 10}
    with pytest.raises(InputError, match="--batch must be >= 1, got 0"):
        build_config(argparse.Namespace(**{**base, "batch": 0}), 1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 0}))
    with pytest.raises(ConfigError, match="train_batch_size: must be >= 1, got 0"):
        build_config(argparse.Namespace(**{**base, "config": str(path)}), 1)
    path.write_text(json.dumps({"gradient_accumulation_steps": 0}))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: must be >= 1"):
        build_config(argparse.Namespace(**{**base, "config": str(path), "batch": 8}), 1)
    # at 2 ranks these were "does not split" (true taken as 1, inf % 2 is nan), per rank
    for text, message in (('{"train_batch_size": true}', "expected int or null, got bool"),
                          ('{"train_batch_size": Infinity}', r"must be a finite number, got inf"),
                          ('{"gradient_accumulation_steps": 2.5}', r"expected int, got float")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            build_config(argparse.Namespace(**{**base, "config": str(path)}), 2)


def test_config_api_types_are_strict():
    """The engine's Config: bool and float refused for the batch keys, inf/nan anywhere."""
    for d, message in [
        ({"train_batch_size": 32.0}, r"train_batch_size: expected int or null, got float"),
        ({"train_micro_batch_size_per_gpu": 4.0}, r"expected int, got float \(4\.0\)"),
        ({"gradient_accumulation_steps": True}, r"expected int, got bool"),
        ({"train_batch_size": float("inf")}, r"expected int or null, got float \(inf\)"),
        ({"optimizer": {"params": {"lr": float("inf")}}},
         r"optimizer\.params\.lr: must be a finite number, got inf"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Config.from_dict(d)
    assert Config.from_dict({"zero_optimization": {"reduce_bucket_size": 5e8}}) \
        .zero_optimization.reduce_bucket_size == 500_000_000  # sizes: "5e8" still an int


def test_a_problem_on_some_ranks_only_ends_every_rank(capsys):
    """The ranks exchange their checks' outcome; rank 0 prints the first problem, naming the
    ranks that saw it when not all did."""
    from zmpi.cli.inputs import _agree_on_inputs

    class TwoRanks:
        size = 2

        def __init__(self, problems):
            self.problems = problems

        def allgather_object(self, _):
            return self.problems

    _agree_on_inputs(TwoRanks([(None, "d"), (None, "d")]), None, "d")  # nothing wrong: returns
    with pytest.raises(SystemExit) as exit_info:
        _agree_on_inputs(TwoRanks([(None, "d"), ("--data x: missing", None)]), None, "d")
    assert exit_info.value.code == 2
    assert _one_line(capsys.readouterr().err) == "zmpi train: --data x: missing (on rank 1 only)"
    with pytest.raises(SystemExit) as exit_info:  # rank 1 read another config
        _agree_on_inputs(TwoRanks([(None, "d"), (None, "e")]), None, "d")
    assert exit_info.value.code == 2
    assert _one_line(capsys.readouterr().err) == (
        "zmpi train: the ranks read different inputs: the config, or the data's size, on rank "
        "1 differs from rank 0's (each node reads its own copy of the files: give every node "
        "the same ones)")


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["flag", "config"])
def test_two_ranks_print_the_line_once(tmp_path, case):
    """At 2 ranks: a flag error (found before MPI work) and a config error found by every rank
    (a batch of 7 does not split over 2 ranks) are each one line, from rank 0, exit code 2."""
    if case == "flag":
        extra, message = ["--steps", "0"], "zmpi train: --steps must be >= 1, got 0"
    else:
        extra = _config(tmp_path, {"train_batch_size": 7})
        message = (f"zmpi train: global batch 7 (train_batch_size in {extra[1]}) does not "
                   "split over 2 data-parallel ranks x 1 accumulation step")
    result = launch_mpi(CLI, 2, timeout=60, args=[
        "train", *_tiny_with(extra), "--out", tmp_path / "run", *extra])
    assert result.returncode == 2, result.describe()
    lines = result.ranks_stderr()
    assert lines == [message] and "Traceback" not in result.stderr, result.describe()


@pytest.mark.mpi
def test_a_config_bad_on_one_rank_only_ends_both_without_a_hang(tmp_path):
    """Rank 1 reads a model section that fails its check before any data is read (the check
    used to run before the ranks compared notes, and rank 0 waited for rank 1 forever)."""
    model = {"n_layer": 1, "d_model": 16, "n_head": 2, "seq_len": 8}
    (tmp_path / "c0.json").write_text(json.dumps({"model": model}))
    (tmp_path / "c1.json").write_text(json.dumps({"model": {**model, "n_layer": 0}}))
    result = launch_mpi(RANKS_DIR / "cli_per_rank.py", 2, timeout=60, args=[
        "train", "--steps", "1", "--sample-tokens", "0", "--out", tmp_path / "run",
        "--config", tmp_path / "c{rank}.json"])
    assert result.returncode == 2, result.describe()
    assert result.ranks_stderr() == [
        f"zmpi train: config {tmp_path}/c1.json: model.n_layer: must be >= 1, got 0 (on "
        "rank 1 only)"], result.describe()


def test_an_earlier_run_in_out_is_kept(tmp_path):
    """--out naming a directory that holds a run (its run.json) is refused unless resuming:
    the earlier run's metrics and run.json would be replaced."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    line = _train_fails([], tmp_path)
    assert line == (f"zmpi train: --out {tmp_path / 'run'} holds an earlier run (run.json): "
                    "give another directory, or --resume to go on with that run there")
    assert (tmp_path / "run" / "run.json").read_text() == "{}"


def test_lr_acts_on_the_configs_schedule_or_is_refused(tmp_path):
    """--lr with the config's WarmupLR sets its warmup_max_lr (noted); with OneCycle, whose
    rates are its own, it is refused; with no optimizer section the default lr is not
    reported as the config's."""
    notes = []
    schedule = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.001}}
    cfg = build_config(_namespace(tmp_path, {"scheduler": schedule}, lr=0.5), 1, notes)
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 0.5
    assert "--lr overrides the config's scheduler.params.warmup_max_lr = 0.001 with 0.5" in notes
    assert not any("optimizer.params.lr" in n for n in notes), notes
    cycle = {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01}}
    with pytest.raises(InputError, match="--lr has no effect under the config's OneCycle"):
        build_config(_namespace(tmp_path, {"scheduler": cycle}, lr=0.5), 1, [])


def test_auto_train_batch_size_follows_the_micro_batch(tmp_path):
    """"train_batch_size": "auto" with a micro-batch given is derived from it by the engine
    (micro x accumulation x dp), not replaced by zmpi train's default batch."""
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3}
    cfg = build_config(_namespace(tmp_path, config), 2, [])
    assert cfg["train_batch_size"] == "auto"
    assert Config.from_dict(cfg).resolve_batch(2).train_batch_size == 6


def _namespace(tmp_path, config, **flags):
    """build_config's argparse namespace: no flags given but `flags`, the config in a file."""
    import argparse

    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    base = {name: None for name in (
        "batch", "lr", "stage", "strategy", "precision", "tp", "pp", "sequence_parallel",
        "delay_update", "shard_group_size", "lr_schedule", "warmup_steps", "seed", "recompute",
        "seq_len", "n_layer", "n_head", "d_model")}
    return argparse.Namespace(**{**base, "offload_optimizer": False, "offload_param": False,
                                 "steps": 10, "config": str(path), **flags})


def test_model_shape_keys_given_as_whole_floats_build_that_model(tmp_path):
    """model.vocab_size 1e3 or 100.0 (JSON floats) passed the config's checks and then was a
    TypeError in GPT; like every shape key it is the integer it names, and 100.5 is refused."""
    import contextlib
    import io

    for text, vocab in (("1e3", 1000), ("100.0", 100)):
        flags = _config(tmp_path, f'{{"model": {{"vocab_size": {text}}}}}')
        out = tmp_path / f"run{vocab}"
        with contextlib.redirect_stdout(io.StringIO()):
            main(["train", *TINY, *flags, "--out", str(out)])
        run = json.loads((out / "run.json").read_text())
        assert run["model"]["vocab_size"] == vocab and run["config"]["model"]["vocab_size"] \
            == vocab and type(run["config"]["model"]["vocab_size"]) is int
    flags = _config(tmp_path, '{"model": {"vocab_size": 100.5}}')
    assert _train_fails(flags, tmp_path) == f"zmpi train: config {flags[1]}: model.vocab_size: " \
                                            "expected int or null, got float (100.5)"


def test_output_paths_that_are_files_are_one_line(tmp_path):
    """--out and --log-dir naming a file are input errors, found with the other checks (the
    logger used to be made first, and a file as --log-dir was a traceback on every rank)."""
    (tmp_path / "file").write_text("")
    for flag in ("--out", "--log-dir"):
        flags = [flag, str(tmp_path / "file")] + (["--out", str(tmp_path / "run")]
                                                  if flag == "--log-dir" else [])
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
            main(["train", *TINY, *flags])
        assert exit_info.value.code == 2
        assert _one_line(err.getvalue()) == f"zmpi train: {flag} {tmp_path / 'file'} is a " \
                                            "file, not a directory"


def test_stage_and_a_strategy_that_shards_alike_agree(tmp_path):
    """--stage 3 with the hybrid strategy (a ZeRO-3 strategy) is no contradiction; with
    stage 2 it is, found by what the strategy shards rather than by its name."""
    assert build_config(_namespace(tmp_path, {}, stage=3, strategy="hybrid"), 1, [])
    line = _train_fails(["--stage", "2", "--strategy", "hybrid"], tmp_path)
    assert "zero_optimization.stage: 2 contradicts the strategy 'hybrid', which shards as " \
           "ZeRO stage 3" in line, line

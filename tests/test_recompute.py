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
from zmpi.nn.attention import ATTENTION_BLOCK
from zmpi.nn.checkpointing import InputStore
from zmpi.nn.module import activations_counted_in

POLICIES = ("none", "selective", "full")


def run_once(cfg, policy, dtype=np.float32, batch=2, interval=0, store=None, steps=1):
    """Every parameter's gradient after `steps` forwards and backwards under `policy` (with
    `interval` and kept inputs in `store`), and the ledger that counted the activations."""
    model = GPT(cfg, seed=0, dtype=dtype)
    model.set_recompute(policy, interval, store)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, cfg.vocab_size, (batch, cfg.seq_len))
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        for _ in range(steps):
            model.zero_grad()
            model.forward_loss(idx, np.roll(idx, -1, axis=1))
            model.backward_loss()
    return {n: p.grad.copy() for n, p in model.named_parameters()}, ledger


def gradients_and_peak(cfg, policy, dtype, batch=2):
    """run_once's gradients and the ledger's activation peak; nothing stays counted."""
    grads, ledger = run_once(cfg, policy, dtype, batch)
    assert ledger.current("activation") == 0  # everything saved was consumed
    return grads, ledger.peak("activation")


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


class _OneRank:
    """A tensor group of one rank (what InputStore's partition takes from a Comm)."""
    rank, size = 0, 1

    def allgather_inplace(self, buf):
        return buf


STORES = {"plain": {}, "host": {"to_host": True}, "contiguous": {"slots": 4},
          "host_contiguous": {"to_host": True, "slots": 4},
          "partition_of_one": {"partition": _OneRank()},
          "synchronized_profiled": {"synchronize": True, "profile": True}}


@pytest.mark.parametrize("interval", (0, 2, 3), ids=("every_unit", "pairs", "threes"))
@pytest.mark.parametrize("where", STORES)
def test_kept_inputs_give_the_same_gradients_and_are_counted(where, interval):
    """DeepSpeed's options on the kept inputs (zmpi.nn.checkpointing.InputStore), with full
    recompute of single units or groups: the gradients of no recompute bit for bit, over two
    steps (slots reused); the kept inputs counted as "saved_input", on the host with to_host,
    in one constant buffer with slots; what the recompute keeps as "recompute"."""
    L, B, T, C = 3, 2, 16, 8
    cfg = GPTConfig(vocab_size=11, seq_len=T, n_layer=L, n_head=2, d_model=C)
    want, _ = run_once(cfg, "none", steps=2)
    store = InputStore(**STORES[where])
    got, ledger = run_once(cfg, "full", interval=interval, store=store, steps=2)
    for name, w in want.items():
        assert np.array_equal(got[name], w), name
    every = interval or 1
    kept = [B * T * 8] + [B * T * C * 4] * L  # token ids, then each block's input (fp32)
    kept = kept[::every]  # one input per group of units
    device = "host" if store.to_host else "device"
    other = "device" if store.to_host else "host"
    assert ledger.peak("saved_input", other) == 0
    if store.slots is None:
        assert ledger.peak("saved_input", device) == sum(kept)
        assert ledger.current("activation") == 0
    else:  # one buffer of 4 slots of the largest input; it grew once, from the token ids
        assert ledger.current("saved_input", device) == 4 * B * T * C * 4
        assert ledger.peak("saved_input", device) == 4 * (B * T * 8 + B * T * C * 4)
        assert ledger.current("activation") == ledger.current("saved_input")
    assert ledger.peak("recompute") > 0
    assert set(store.recompute_seconds) == ({0, 1, 2, 3} if store.profile else set())


def test_recompute_keeps_groups_of_units_for_their_recompute():
    """A group of k units keeps one input and recomputes k units at once: fewer saved inputs,
    a larger recompute working set."""
    cfg = GPTConfig(vocab_size=11, seq_len=16, n_layer=4, n_head=2, d_model=8)
    peaks = {k: run_once(cfg, "none" if k else "full", interval=k)[1] for k in (0, 2, 5)}
    saved = {k: ledger.peak("saved_input") for k, ledger in peaks.items()}
    recompute = {k: ledger.peak("recompute") for k, ledger in peaks.items()}
    assert saved[0] > saved[2] > saved[5] == 2 * 16 * 8  # 5 units, 1 group: the token ids
    assert recompute[0] < recompute[2] < recompute[5]


def test_too_few_slots_is_a_clear_error():
    cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=8)
    with pytest.raises(RuntimeError, match="number_checkpoints is 3, but more inputs"):
        run_once(cfg, "full", store=InputStore(slots=3))
    run_once(cfg, "full", interval=2, store=InputStore(slots=2))  # 2 groups: 2 slots do


@pytest.mark.mpi
def test_recompute_through_the_engine_is_exact_everywhere():
    reports = run_mpi(RANKS_DIR / "recompute_checks.py", 2, timeout=300)
    runs = {k: v for k, v in reports[0].items() if k not in ("rank", "options", "slots")}
    assert len(runs) == 2 * (4 + 2 + 1 + 2)  # 2 policies x (dp2 x 4, tp2 x 2, sp x 1, pp2 x 2)
    for r in reports:
        for name, run in ((k, v) for k, v in r.items() if k not in ("rank", "options", "slots")):
            assert run["equal"] and run["largest"] == 0.0 and run["losses_equal"], (name, run)
            assert run["peak"] < run["peak_none"], (name, run)
            if name.endswith("full"):
                assert run["peak"] < 0.55 * run["peak_none"], (name, run)
        options = r["options"]
        assert len(options) == 6
        for name, run in options.items():
            assert run["equal"] and run["largest"] == 0.0 and run["losses_equal"], (name, run)
            assert run["peak"] < run["peak_none"], (name, run)
        full, part = options["tp2_partition"]["peaks_full"], options["tp2_partition"]["peaks"]
        # Each rank keeps half of every input: 3 blocks' 4 x 8 x 16 fp32 and the 4 x 8 token
        # ids. Unpartitioned, the ids are a view of the whole batch's (both micro-batches).
        assert part["saved_device"] == (3 * 4 * 8 * 16 * 4 + 4 * 8 * 8) // 2
        assert full["saved_device"] == 3 * 4 * 8 * 16 * 4 + 2 * 4 * 8 * 8
        cpu = options["dp2_cpu"]
        # dp 2: micro-batches of 2 rows; on the host, copies of the 2 x 8 token ids
        assert cpu["peaks"]["saved_host"] == 3 * 2 * 8 * 16 * 4 + 2 * 8 * 8
        assert cpu["peaks_full"]["saved_device"] == 3 * 2 * 8 * 16 * 4 + 2 * 2 * 8 * 8
        assert cpu["peaks"]["saved_device"] == 0 and cpu["peaks_full"]["saved_host"] == 0
        everything = options["tp2_everything"]["peaks"]
        assert everything["saved_device"] == 0 and everything["saved_host"] > 0
        assert everything["timed_units"] == 4  # the embedding and 3 blocks, timed
        grouped = options["dp2_interval2"]
        assert grouped["peaks"]["recompute"] > grouped["peaks_full"]["recompute"]
    # number_checkpoints at pp 2, 4 micro-batches: too few refused alike on both stages as the
    # engine is built, naming the least, which the busier stage then fills exactly
    for schedule in ("1f1b", "gpipe"):
        runs = [r["slots"][schedule] for r in reports]
        least = runs[0]["least"]
        assert max(run["used"] for run in runs) == least, (schedule, runs)
        for run in runs:
            assert run["one"] == runs[0]["one"] and run["fewer"] == runs[0]["fewer"]
            key = "activation_checkpointing.number_checkpoints: "
            assert run["one"].startswith(f"{key}1 is fewer than the {least} inputs this layout "
                                         "keeps at once"), run["one"]
            assert run["fewer"].startswith(f"{key}{least - 1} is fewer"), run["fewer"]
            assert run["one"].endswith(f"give {least} to {5 * 4}")  # 5 units x 4 micro-batches
            assert all(np.isfinite(run["losses"]))
    # a stage holds all 4 micro-batches under GPipe, p - s under 1F1B
    assert reports[0]["slots"]["gpipe"]["least"] > reports[0]["slots"]["1f1b"]["least"]


def test_the_config_section_acts_or_is_refused():
    assert Config.from_dict({}).activation_checkpointing.recompute == "none"
    for policy in POLICIES:
        c = Config.from_dict({"activation_checkpointing": {"recompute": policy}})
        assert c.activation_checkpointing.recompute == policy and c.notes() == []
    with pytest.raises(ConfigError, match="recompute: 'all': use one of none, selective, full"):
        Config.from_dict({"activation_checkpointing": {"recompute": "all"}})
    for key in ("partition_activations", "cpu_checkpointing", "synchronize_checkpoint_boundary",
                "profile"):
        for keys in ({"recompute": "full"}, {}):  # with full recompute, or an interval
            c = Config.from_dict({"activation_checkpointing": {key: True, **keys},
                                  "pipeline": {"activation_checkpoint_interval": 0 if keys else 2}})
            assert getattr(c.activation_checkpointing, key) is True
        with pytest.raises(ConfigError, match=rf"activation_checkpointing.{key}: acts on the "
                                              "inputs full recompute keeps"):
            Config.from_dict({"activation_checkpointing": {key: True, "recompute": "selective"}})
    contiguous = {"contiguous_memory_optimization": True, "number_checkpoints": 4}
    Config.from_dict({"activation_checkpointing": {"recompute": "full", **contiguous}})
    for keys in ({"contiguous_memory_optimization": True}, {"number_checkpoints": 4}):
        with pytest.raises(ConfigError, match="number_checkpoints: sizes the buffer"):
            Config.from_dict({"activation_checkpointing": {"recompute": "full", **keys}})
    with pytest.raises(ConfigError, match="number_checkpoints: must be >= 1"):
        Config.from_dict({"activation_checkpointing": {"recompute": "full", **contiguous,
                                                       "number_checkpoints": 0}})
    with pytest.raises(ConfigError, match="partition_activations: with sequence_parallel"):
        Config.from_dict({"activation_checkpointing": {"recompute": "full",
                                                       "partition_activations": True},
                          "tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}})
    with pytest.raises(ConfigError, match="activation_checkpoint_interval: 2 recomputes groups"):
        Config.from_dict({"activation_checkpointing": {"recompute": "selective"},
                          "pipeline": {"activation_checkpoint_interval": 2}})
    with pytest.raises(ConfigError, match="activation_checkpoint_interval: must be >= 0"):
        Config.from_dict({"pipeline": {"activation_checkpoint_interval": -1}})


def test_set_recompute_refuses_what_it_cannot_do():
    model = GPT(GPTConfig(vocab_size=11, seq_len=8, n_layer=1, n_head=2, d_model=8))
    with pytest.raises(ValueError, match="recompute 'some'"):
        model.set_recompute("some")
    with pytest.raises(ValueError, match="selective recompute .* takes no interval"):
        model.set_recompute("selective", 2)
    with pytest.raises(ValueError, match="interval must be an int >= 0"):
        model.set_recompute("full", -1)


@pytest.mark.mpi
def test_zmpi_train_recompute(tmp_path):
    result = launch_mpi(CLI, 2, timeout=120, args=[
        "train", "--recompute", "full", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
        "--seq-len", "16", "--batch", "4", "--steps", "3", "--out", tmp_path / "run"])
    assert result.returncode == 0, result.describe()
    import json

    config = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert config["activation_checkpointing"]["recompute"] == "full"


STANDIN_RUN = """
import json
import numpy as np
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

cfg = GPTConfig(vocab_size=11, seq_len=16, n_layer=3, n_head=2, d_model=8)
rng = np.random.default_rng(1)
idx = rng.integers(0, 11, (2, 16))
slots = {"contiguous_memory_optimization": True, "number_checkpoints": 4}
out = {}
for name, keys, interval in (("none", {}, 0), ("host", {"cpu_checkpointing": True}, 0),
                             ("host_slots", {"cpu_checkpointing": True, **slots}, 2),
                             ("device_slots", slots, 0),
                             ("synchronized", {"synchronize_checkpoint_boundary": True,
                                               "profile": True}, 0)):
    policy = "none" if name == "none" else "full"
    engine = Engine(GPT(cfg, seed=0), {
        "train_micro_batch_size_per_gpu": 2,
        "pipeline": {"activation_checkpoint_interval": interval},
        "activation_checkpointing": {"recompute": policy, **keys}}, Comm())
    for _ in range(2):
        engine.train_step(idx, np.roll(idx, -1, axis=1))
    out[name] = {"params": {n: p.tolist() for n, p in engine.gather_parameters().items()},
                 "host": engine.memory.peak("saved_input", "host"),
                 "device": engine.memory.peak("saved_input", "device")}
    engine.close()
print(json.dumps(out))
"""


def test_kept_inputs_on_the_cupy_standin():
    """The GPU path of InputStore (side-stream copies into page-locked host memory, copies
    back, slots in device or pinned memory) through the engine on the strict CuPy stand-in:
    after 2 steps the parameters of no recompute bit for bit, the kept inputs on the host
    where asked."""
    import json
    import os
    import subprocess
    import sys

    from mpi_util import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT / 'tests' / 'standin'}:{REPO_ROOT}",
           "ZMPI_BACKEND": "cupy", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", STANDIN_RUN], env=env, cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in ("host", "host_slots", "device_slots", "synchronized"):
        assert out[name]["params"] == out["none"]["params"], name
    assert out["host"]["device"] == 0 and out["host"]["host"] > 0
    assert out["host_slots"]["device"] == 0 and out["host_slots"]["host"] > 0
    assert out["device_slots"]["host"] == 0 and out["device_slots"]["device"] > 0


def _engine(cfg, policy, interval=0, zero=None, keys=None, batch=2, accumulation=1):
    from zmpi.comm import Comm
    from zmpi.engine import Engine

    return Engine(GPT(cfg, seed=0), {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero or {},
        "pipeline": {"activation_checkpoint_interval": interval},
        "activation_checkpointing": {"recompute": policy, **(keys or {})}}, Comm())


def test_groups_at_zero3_with_a_wide_prefetch_stay_exact():
    """A group's recompute gathers its units without prefetching forward (the units after it
    ran their backward already): nothing stays gathered after a step, parameters exact."""
    cfg = GPTConfig(vocab_size=11, seq_len=16, n_layer=4, n_head=2, d_model=8)
    idx = np.random.default_rng(1).integers(0, 11, (2, 16))
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 10**6}
    runs = {}
    for interval in (0, 2):
        engine = _engine(cfg, "none", interval, zero)
        losses = [engine.train_step(idx, np.roll(idx, -1, axis=1)) for _ in range(3)]
        gathered = set(engine.strategy._gathered) - set(engine.strategy._persistent)
        runs[interval] = (losses, engine.gather_parameters(), gathered)
        engine.close()
    assert runs[2][0] == runs[0][0] and runs[2][2] == set() == runs[0][2]
    for name, want in runs[0][1].items():
        assert np.array_equal(runs[2][1][name], want), name


def test_a_backward_that_raises_lets_its_kept_inputs_go():
    cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=8)
    model = GPT(cfg, seed=0)
    model.set_recompute("full", 0, InputStore(slots=4))
    idx = np.random.default_rng(1).integers(0, 11, (2, 8))
    broken = model.units[1]
    broken.backward = lambda dy: (_ for _ in ()).throw(RuntimeError("injected"))
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        model.forward_loss(idx, idx)
        with pytest.raises(RuntimeError, match="injected"):
            model.backward_loss()
        assert model.saved_inputs._used == {}  # every slot free again
        del broken.backward
        model.clear_cache()
        model.forward_loss(idx, idx)  # the slots serve the next step
        model.backward_loss()
    assert ledger.current("activation") == ledger.current("saved_input")  # the buffer only


def test_number_checkpoints_is_checked_as_the_engine_is_built():
    """Too few slots for the inputs kept at once, or more than any layout of the model keeps
    (1e12 was a MemoryError at the first step), are refused naming both bounds; the least
    (one per recomputed unit, or group) trains. The 2-stage bounds: recompute_checks.py."""
    cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=8)  # 5 units
    idx = np.random.default_rng(1).integers(0, 11, (4, 8))

    def slots(n):
        return {"contiguous_memory_optimization": True, "number_checkpoints": n}

    key = "activation_checkpointing.number_checkpoints: "
    for n, interval, words in (
            (3, 0, "3 is fewer than the 4 inputs this layout keeps at once (one per "
                   "recomputed unit, or group of units, and micro-batch in flight on a pipeline "
                   "stage): give 4 to 10"),
            (1, 2, "1 is fewer than the 2 inputs this layout keeps at once"),
            (10**12, 0, "1000000000000 is more than the 10 inputs any layout of this model "
                        "keeps at once (one per unit and micro-batch; each slot is a buffer the "
                        "size of the largest): give 4 to 10")):
        with pytest.raises(ConfigError) as error:
            _engine(cfg, "full", interval, keys=slots(n), accumulation=2)
        assert str(error.value).startswith(key + words), error.value
    for n, interval in ((4, 0), (2, 2), (10, 0)):
        engine = _engine(cfg, "full", interval, keys=slots(n), accumulation=2)
        assert np.isfinite(engine.train_step(idx, idx))
        engine.close()


def test_forwards_without_backward_keep_no_inputs():
    """eval_loss and generate keep no input for a backward that will not come: the slots'
    buffer neither grows for a larger evaluation batch nor leaves the ledger."""
    cfg = GPTConfig(vocab_size=11, seq_len=8, n_layer=3, n_head=2, d_model=8)
    keys = {"contiguous_memory_optimization": True, "number_checkpoints": 4}
    engine = _engine(cfg, "full", keys=keys)
    idx = np.random.default_rng(1).integers(0, 11, (2, 8))
    engine.train_step(idx, idx)
    kept = engine.memory.current("saved_input")
    assert kept == 4 * 2 * 8 * 8 * 4  # 4 slots of one block's input
    engine.eval_loss(np.tile(idx, (16, 1)), np.tile(idx, (16, 1)))
    engine.model.generate(idx[:, :4], 2)
    engine.train_step(idx, idx)
    assert engine.memory.current("saved_input") == kept
    engine.close()


def test_partitioned_inputs_of_any_integer_dtype():
    """Kept inputs travel as bytes: token ids in uint16 (nanoGPT's files) come back whole."""
    from zmpi.comm import Comm

    store = InputStore(partition=Comm())
    for dtype in (np.uint16, np.int16, np.int64, np.float32):
        x = np.arange(15, dtype=dtype).reshape(3, 5)
        assert np.array_equal(store.restore(store.keep(x)), x) and \
            store.restore(store.keep(x)).dtype == dtype

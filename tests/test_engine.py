"""Engine behaviour in one process (a size-1 Comm, no mpiexec): errors, registry, API."""
import numpy as np
import pytest

from zmpi.config import ConfigError
from zmpi.engine import Engine, PhaseProfile
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.mlp import MLPModel
from zmpi.zero import available_strategies, get_strategy, register
from zmpi.zero.stage1 import Stage1

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=1, n_head=2, d_model=8)


def batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 16, (rows, 8)), rng.integers(0, 16, (rows, 8))


def test_unknown_strategy_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown partition strategy 'stage9'.*stage0.*stage3"):
        Engine(GPT(CFG), {"zero_optimization": {"strategy": "stage9"}})


def test_invalid_config_names_the_key():
    with pytest.raises(ConfigError, match="zero_optimization.stage"):
        Engine(GPT(CFG), {"zero_optimization": {"stage": 7}})
    with pytest.raises(ConfigError, match="stagee"):
        Engine(GPT(CFG), {"zero_optimization": {"stagee": 1}})


def test_batch_not_matching_config_is_an_error():
    engine = Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2,
                               "gradient_accumulation_steps": 2})
    with pytest.raises(ValueError, match=r"got 3 input.*= 4 rows per rank"):
        engine.train_step(*batch(3))
    assert np.isfinite(engine.train_step(*batch(4)))


def test_train_batch_size_must_match_world():
    with pytest.raises(ConfigError, match="train_batch_size"):
        Engine(GPT(CFG), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})


def test_half_precision_model_is_rejected():
    with pytest.raises(ValueError, match="build the model in float32"):
        Engine(GPT(CFG, dtype=np.float16), {})


def test_non_finite_fp32_gradient_raises_instead_of_training_on_nan():
    engine = Engine(MLPModel(seed=0), {"train_micro_batch_size_per_gpu": 4})
    x = np.full((4, 16), np.nan, np.float32)
    with pytest.raises(FloatingPointError, match="non-finite gradients"):
        engine.train_step(x, np.zeros(4, np.int64))


def test_registered_strategy_is_picked_by_name():
    @register("test_stage1_copy")
    class Stage1Copy(Stage1):
        """A new strategy is one class; this one reuses stage 1's policy unchanged."""

    assert "test_stage1_copy" in available_strategies()
    assert get_strategy("test_stage1_copy") is Stage1Copy
    with pytest.raises(ValueError, match="already registered"):
        register("test_stage1_copy")(Stage1Copy)
    results = []
    for name in ("stage1", "test_stage1_copy"):
        engine = Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 4,
                                   "zero_optimization": {"strategy": name}})
        assert engine.strategy.name == name
        for step in range(3):
            engine.train_step(*batch(4, step))
        results.append(engine.gather_parameters())
    for name in results[0]:
        np.testing.assert_array_equal(results[0][name], results[1][name])


def test_parameters_are_views_into_engine_buffers():
    model = GPT(CFG)
    engine = Engine(model, {"zero_optimization": {"stage": 0}})
    wte = model.units[0].wte
    assert np.shares_memory(wte.data, engine.strategy.params_full)
    assert np.shares_memory(wte.grad, engine.strategy.grads_full)


def test_stage3_releases_parameters_between_passes():
    model = GPT(CFG)
    engine = Engine(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    engine.train_step(*batch(2))
    assert all(p.data is None for p in model.parameters())
    assert engine.memory.current("param") == engine.strategy.params_shard.nbytes
    assert np.isfinite(engine.eval_loss(*batch(2)))
    assert all(p.data is None for p in model.parameters())


def test_eval_loss_matches_plain_model():
    x, y = batch(4)
    want = GPT(CFG).loss(x, y)
    for stage in range(4):
        engine = Engine(GPT(CFG), {"zero_optimization": {"stage": stage}})
        assert engine.eval_loss(x, y) == pytest.approx(want, rel=1e-6)


def test_engine_recovers_after_a_caught_non_finite_step():
    for stage in range(4):
        engine = Engine(MLPModel(seed=0), {"train_micro_batch_size_per_gpu": 4,
                                           "zero_optimization": {"stage": stage}})
        x, y = np.ones((4, 16), np.float32), np.zeros(4, np.int64)
        engine.train_step(x, y)
        held = engine.memory.current()
        with pytest.raises(FloatingPointError):
            engine.train_step(np.full_like(x, np.nan), y)
        assert np.isfinite(engine.train_step(x, y)) and engine.global_steps == 2
        assert engine.memory.current() == held, f"stage {stage} leaked a buffer"


def test_sharded_states_are_released_right_after_setup():
    model = GPT(CFG)
    Engine(model, {"zero_optimization": {"stage": 3}})
    assert all(p.data is None and p.grad is None for p in model.parameters())
    model = GPT(CFG)
    Engine(model, {"zero_optimization": {"stage": 2}})
    assert all(p.data is not None and p.grad is None for p in model.parameters())


def test_nan_initial_model_is_a_clear_error():
    model = GPT(CFG)
    model.units[0].wte.data[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        Engine(model, {})


@pytest.mark.parametrize("zero, key", [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device"),
    ({"strategy": "stage1", "offload_param": {"device": "cpu"}}, "offload_param.device"),
])
def test_offload_with_a_strategy_that_cannot_is_a_config_error(zero, key):
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}: .* needs .*stage"):
        Engine(GPT(CFG), {"zero_optimization": zero})


def test_deepspeed_adam_means_decoupled_decay_unless_adam_w_mode_false():
    assert Engine(GPT(CFG), {"optimizer": {"type": "Adam"}}).optimizer.decoupled
    engine = Engine(GPT(CFG), {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}})
    assert not engine.optimizer.decoupled


@pytest.mark.parametrize("zero,message", [
    ({"stage": 3, "shard_group_size": 1}, "'stage3' does not split the ranks into groups"),
    ({"strategy": "hybrid", "shard_group_size": 2}, "2 does not divide the 1 rank "),
    ({"strategy": "hybrid", "shard_group_size": 0}, "must be >= 1"),
])
def test_shard_group_size_errors(zero, message):
    with pytest.raises(ConfigError, match=message) as e:
        Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero})
    assert e.value.key == "zero_optimization.shard_group_size"


def test_hybrid_on_one_rank_is_one_group_of_one():
    engine = Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2,
                               "zero_optimization": {"strategy": "hybrid"}})
    engine.train_step(*batch(2))
    assert engine.describe()["shard_group_size"] == 1
    assert set(engine.traffic()) == {"shard", "replica"}


def test_stage3_max_live_parameters_is_checked():
    zero = {"stage": 3, "stage3_max_live_parameters": 100}
    with pytest.raises(ConfigError, match=r"stage3_max_live_parameters: zmpi keeps up to \d+ "
                                          r"parameter elements gathered at once"):
        Engine(GPT(CFG), {"zero_optimization": zero})
    Engine(GPT(CFG), {"zero_optimization": {**zero, "stage3_max_live_parameters": 10**9}})


def test_keys_accepted_without_effect_are_listed_once():
    with pytest.warns(UserWarning, match=r"^zmpi config: wall_clock_breakdown: accepted without "
                                         r"effect .*; zero_optimization.sub_group_size"):
        Engine(GPT(CFG), {"wall_clock_breakdown": True,
                          "zero_optimization": {"stage": 3, "sub_group_size": 1e9}})


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_error_mid_step_leaves_the_next_step_clean(stage):
    """An exception in backward (say an OutOfMemory the caller catches) must not leave
    gradients or gathered units behind: the next step equals a fresh engine's."""
    def engine():
        return Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2,
                                 "zero_optimization": {"stage": stage}})

    broken, fresh = engine(), engine()
    original = broken.strategy.after_backward
    calls = []

    def fail_second(u):
        calls.append(u)
        original(u)
        if len(calls) == 2:
            raise MemoryError("injected")

    broken.strategy.after_backward = fail_second
    with pytest.raises(MemoryError, match="injected"):
        broken.train_step(*batch(2))
    broken.strategy.after_backward = original
    assert not broken.strategy._gathered and not broken.strategy._unit_grads
    broken.train_step(*batch(2, seed=1))
    fresh.train_step(*batch(2, seed=1))
    a, b = broken.gather_parameters(), fresh.gather_parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_critical_path_separates_exposed_communication_from_imbalance():
    def rank(r, busy, waited, steps=2):  # seconds per step
        s = {"forward": 0.4 * busy * steps, "backward": 0.6 * busy * steps,
             "step": waited * steps, "optimizer": 0.0, "waited": waited * steps}
        return r, steps, s, []

    # rank 1 computes 0.15 s longer: rank 0's extra wait is for rank 1, not for the network
    rows = [rank(0, 1.0, 0.20), rank(1, 1.15, 0.05), rank(2, 1.05, 0.12)]
    r, exposed, imbalance = PhaseProfile._critical(rows)
    assert r == 1 and exposed == pytest.approx(0.05) and imbalance == pytest.approx(0.15)


def test_phase_profile_leaves_out_the_first_step(monkeypatch):
    """Step 1 (compiling, first touch) takes 5 s of forward; steps 2-3 take 1 s forward and
    0.5 s step each: the profile reports 2 steps of those, and step 1 alone when it is all."""
    import zmpi.comm

    ticks = iter([0, 5, 5.5, 10, 11, 11.5, 20, 21, 21.5])
    monkeypatch.setattr("zmpi.engine.profile.time.perf_counter", lambda: next(ticks))
    monkeypatch.setattr(zmpi.comm, "waited_seconds", lambda: 0.0)
    profile = PhaseProfile()
    for step in range(3):
        clock = profile.clock()
        clock.lap("forward")
        clock.lap("step")
        steps, seconds, _ = profile.counted()
        if step == 0:
            assert steps == 1 and seconds["forward"] == 5 and seconds["step"] == 0.5
    assert steps == 2 and seconds["forward"] == 2 and seconds["step"] == 1


def test_the_unit_table_marks_recompute_not_timed():
    """A unit whose recompute was timed shows its milliseconds; one without (no recompute, or
    selective, which runs inside the attention's backward) shows "-", not a 0.0 that reads
    as free."""
    from types import SimpleNamespace

    profile = PhaseProfile(["Embedding", "Block"], recompute_seconds={1: 0.002})
    profile.step_ends()
    comm = SimpleNamespace(rank=0, allgather_object=lambda mine: [mine])
    embedding, block = profile.table(comm).splitlines()[-2:]
    assert embedding.split()[1:] == ["Embedding", "0.0", "0.0", "0.0", "-"]
    assert block.split()[1:] == ["Block", "0.0", "0.0", "0.0", "2.0"]


def test_a_finished_engine_leaves_no_buffers_behind():
    """Dropping an engine frees its ledger and every buffer at once, without waiting for the
    garbage collector: nothing global (the staging pool accounts its buffers in the newest
    ledger) and no cycle (the model reaches its engine's hooks through a weak proxy) keeps
    them alive."""
    import gc
    import weakref

    gc.disable()
    try:
        for stage in range(4):
            engine = Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2,
                                       "zero_optimization": {"stage": stage}})
            engine.train_step(*batch(2))
            ledger, master = weakref.ref(engine.memory), weakref.ref(engine.strategy.master)
            model = engine.model
            del engine
            assert ledger() is None and master() is None, stage
            with pytest.raises(RuntimeError, match="the Engine this model was given to is gone"):
                model.loss(*batch(2))
    finally:
        gc.enable()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("fp16", [False, True])
def test_host_adam_writes_the_parameters_as_it_updates_the_master(stage, fp16, monkeypatch):
    """On host buffers the strategy hands its parameter buffer to Adam (publish_targets),
    which casts each chunk into it while the chunk is in cache: the same bits as the copy
    after the step, and that copy is skipped (only packed buckets are still copied)."""
    from zmpi import backend

    def engine():
        e = Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": fp16},
                              "zero_optimization": {"stage": stage}})
        e.strategy.solo_numel = 1  # every unit allgathered alone, in place (stages 1-2)
        return e

    fused, copied = engine(), engine()
    copied.strategy.publish_targets = lambda: None
    params = fused.strategy.params_full if stage < 3 else fused.strategy.params_shard
    assert fused.strategy.publish_targets() is not None
    fused.strategy._take_written()
    real, into_params = backend.copy_, []
    monkeypatch.setattr(backend, "copy_", lambda dst, src: (
        into_params.append(np.shares_memory(dst, params)), real(dst, src))[1])
    for step in range(3):
        for e in (fused, copied):
            e.train_step(*batch(2, step))
        assert not any(into_params)
        np.testing.assert_array_equal(params, copied.strategy.params_full if stage < 3
                                      else copied.strategy.params_shard)
    a, b = fused.gather_parameters(), copied.gather_parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                  {"stage": 1, "offload_optimizer": {"device": "cpu"}}])
def test_first_reduction_of_a_step_writes_the_shard_instead_of_adding(zero):
    """zero_grads leaves the reduced gradient shard as it is (stale): the first reduction of
    each unit in a step writes its part, later micro-steps add. Poisoned with NaN after
    zero_grads, it gives the bits of a shard zeroed at every step."""
    def engine():
        return Engine(GPT(CFG), {"train_micro_batch_size_per_gpu": 2,
                                 "gradient_accumulation_steps": 2, "zero_optimization": zero})

    poisoned, zeroed = engine(), engine()
    for e, fill in ((poisoned, np.nan), (zeroed, 0.0)):
        def zero_grads(s=e.strategy, original=e.strategy.zero_grads, fill=fill):
            original()
            s.grads_shard.fill(fill)
            if fill == 0:
                s._stale.clear()  # the old way: a zeroed shard, every reduction adds
        e.strategy.zero_grads = zero_grads
    into_shard, comm = [], poisoned.strategy.comm
    reduce_scatter = comm.ireduce_scatter
    comm.ireduce_scatter = lambda full, part: (into_shard.append(
        np.shares_memory(part, poisoned.strategy.grads_shard)), reduce_scatter(full, part))[1]
    for step in range(3):
        assert poisoned.train_step(*batch(4, step)) == zeroed.train_step(*batch(4, step))
        assert poisoned.strategy._stale == set(range(len(poisoned.strategy.units)))
    if zero["stage"] > 1 and "offload_optimizer" not in zero:  # written in place, then added
        units = len(poisoned.strategy.units)
        assert into_shard == ([True] * units + [False] * units) * 3
    a, b = poisoned.gather_parameters(), zeroed.gather_parameters()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    poisoned.strategy.wait_pending()  # parts no reduction wrote this step: zeroed
    assert not poisoned.strategy._stale and not poisoned.strategy.grads_shard.any()

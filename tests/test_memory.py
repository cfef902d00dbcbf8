"""MemoryLedger accounting with exact byte counts, and the ZeRO paper's formulas (Fig. 1)."""

import json

import numpy as np
import pytest
from mpi_util import RANKS_DIR, run_mpi

from zmpi.memory import (
    ACTIVATION,
    CATEGORIES,
    DEVICES,
    GROUPS,
    MODEL_STATE,
    MemoryLedger,
    comm_volume_elements,
    model_state_breakdown,
    model_state_bytes,
)


def test_constants():
    assert MODEL_STATE == CATEGORIES[:5] and DEVICES == ("device", "host")
    assert set(CATEGORIES) - set(MODEL_STATE) == {*ACTIVATION, "comm_buffer", "checkpoint"}
    assert GROUPS == {"activation": ACTIVATION, "model_state": MODEL_STATE}


def test_groups_stand_for_their_categories():
    L = MemoryLedger()
    kept = L.allocate(10, np.uint8, "saved_input", device="host")
    L.allocate(20, np.uint8, "layer_cache")
    L.allocate(40, np.uint8, "recompute")
    L.allocate(80, np.uint8, "param")
    assert L.current("activation") == 70 and L.current("activation", "device") == 60
    assert L.current("model_state") == 80 == L.current(MODEL_STATE)
    assert L.current(("activation", "param")) == 150
    L.release(kept)
    assert L.peak("activation") == 70 and L.current("activation") == 60
    with pytest.raises(ValueError, match="unknown category 'activations'"):
        L.current("activations")
    with pytest.raises(ValueError, match="unknown category 'activation'"):
        L.allocate(1, np.uint8, "activation")  # a group: register what kind of activation
    assert L.snapshot()["current"]["device"]["activation"] == 60


def test_register_release_current_peak_sequence():
    L = MemoryLedger()
    p = L.register(np.zeros(100, np.float16), "param", name="w")      # 200 B
    assert L.current() == 200 and L.peak() == 200
    g = L.allocate((10, 10), np.float32, "grad")                       # 400 B
    assert g.shape == (10, 10) and g.dtype == np.float32 and not g.any()
    m = L.allocate(50, np.float32, "master", device="host")            # 200 B host
    a = L.allocate((1000,), np.float32, "layer_cache")                 # 4000 B
    assert L.current("param") == 200 and L.current("grad") == 400
    assert L.current(device="device") == 4600 and L.current(device="host") == 200
    assert L.current() == 4800 and L.current(("param", "grad")) == 600
    assert L.model_state_bytes() == 800 and L.model_state_bytes("device") == 600
    L.release(a)
    L.release(g)
    assert L.current() == 400 and L.current("grad") == 0
    assert L.peak() == 4800 and L.peak(device="device") == 4600 and L.peak("grad") == 400
    assert L.peak(MODEL_STATE) == 800 and L.peak(MODEL_STATE, "device") == 600
    assert L.peak("activation", "host") == 0
    # A filtered peak is the peak of that filter's total, not a sum of per-category peaks.
    a2 = L.allocate(500, np.float32, "layer_cache")                    # 2000 B
    g2 = L.allocate(500, np.float32, "grad")                           # 2000 B
    L.release(a2)
    assert L.peak(("grad", "activation")) == 4400                      # 400 + 4000 at the start
    assert L.current(("grad", "activation")) == 2000
    L.release(g2)
    L.reset_peaks()
    assert L.peak() == L.current() == 400 and L.peak("activation") == 0
    L.release(p)
    L.release(m)
    assert L.current() == 0 and L.peak() == 400 and L.buffers() == []


def test_category_tuple_order_irrelevant():
    L = MemoryLedger()
    L.allocate(8, np.uint8, "adam_m")
    L.allocate(8, np.uint8, "adam_v", device="host")
    assert L.current(("adam_v", "adam_m")) == L.current(["adam_m", "adam_v"]) == 16
    assert L.peak(tuple(reversed(MODEL_STATE))) == 16


def test_double_register_and_unknown_release():
    L = MemoryLedger()
    x = L.register(np.zeros(4), "param", name="x")
    with pytest.raises(ValueError, match="already registered as 'x'"):
        L.register(x, "grad")
    with pytest.raises(KeyError, match="not registered"):
        L.release(np.zeros(4))
    L.release(x)
    with pytest.raises(KeyError):
        L.release(x)
    L.register(x, "grad")  # re-registering after release is fine
    assert L.current("grad") == 32


def test_bad_category_and_device():
    L = MemoryLedger()
    with pytest.raises(ValueError, match=r"unknown category 'weights'; valid: param, grad, master"):
        L.register(np.zeros(1), "weights")
    with pytest.raises(ValueError, match=r"unknown device 'gpu'; valid: device, host"):
        L.allocate(1, np.float32, "param", device="gpu")
    with pytest.raises(ValueError, match="unknown category"):
        L.current("weights")
    with pytest.raises(ValueError, match="unknown device"):
        L.peak(device="cpu")
    assert L.current() == 0 and L.buffers() == []


def test_allocate_host_is_numpy():
    class FakeXp:  # stands in for cupy: must not be used for host buffers
        @staticmethod
        def zeros(shape, dtype):
            raise AssertionError("host allocation used xp")
    L = MemoryLedger()
    h = L.allocate((2, 3), np.float32, "master", device="host", xp=FakeXp)
    assert isinstance(h, np.ndarray) and L.current("master", "host") == 24
    with pytest.raises(AssertionError):
        L.allocate((2, 3), np.float32, "master", xp=FakeXp)


def test_buffers_report_snapshot():
    L = MemoryLedger()
    L.allocate((2, 2 * 2**20), np.float16, "param", name="unit0.params")      # 8 MiB
    L.allocate(2**20, np.float32, "adam_m", device="host", name="unit0.m")    # 4 MiB
    assert L.buffers() == [
        ("unit0.params", "param", "device", (2, 2 * 2**20), "float16", 8 * 2**20),
        ("unit0.m", "adam_m", "host", (2**20,), "float32", 4 * 2**20)]
    rep = L.report()
    lines = rep.splitlines()
    assert len({len(line) for line in lines[2:]}) == 1  # aligned rows
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert rows["param"] == ["8.00", "8.00", "0.00", "0.00"]
    assert rows["adam_m"] == ["0.00", "0.00", "4.00", "4.00"]
    assert rows["total"] == ["8.00", "8.00", "4.00", "4.00"]
    assert "model state" in rep and "MiB" in rep
    snap = json.loads(json.dumps(L.snapshot()))
    assert snap["current"]["device"]["param"] == 8 * 2**20
    assert snap["peak"]["host"]["model_state"] == 4 * 2**20
    assert snap["current"]["host"]["total"] == 4 * 2**20
    assert snap["buffers"][1] == {"name": "unit0.m", "category": "adam_m", "device": "host",
                                  "shape": [2**20], "dtype": "float32", "nbytes": 4 * 2**20}


# -- formulas ---------------------------------------------------------------------------------

PSI, N = 7.5e9, 64


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_paper_table(stage, gb):
    """ZeRO (SC'20) Fig. 1: Psi = 7.5e9, N = 64, K = 12, GB = 1e9 bytes."""
    assert round(model_state_bytes(PSI, N, stage) / 1e9, 1) == gb


def test_formulas_exact():
    assert model_state_bytes(PSI, N, 0) == 16 * PSI
    assert model_state_bytes(PSI, N, 1) == 4 * PSI + 12 * PSI / N
    assert model_state_bytes(PSI, N, 2) == 2 * PSI + 14 * PSI / N
    assert model_state_bytes(PSI, N, 3) == 16 * PSI / N
    assert model_state_bytes(1000, 1, 3) == model_state_bytes(1000, 1, 0) == 16000
    # fp32 training with Adam: 4 + 4 + 8 bytes per parameter
    assert model_state_bytes(100, 4, 0, param_bytes=4, grad_bytes=4, optimizer_bytes=8) == 1600


def test_breakdown():
    b = model_state_breakdown(PSI, N, 2)
    assert set(b) == set(MODEL_STATE)
    assert b["param"] == 2 * PSI and b["grad"] == 2 * PSI / N
    assert b["master"] == b["adam_m"] == b["adam_v"] == 4 * PSI / N
    for stage in range(4):
        assert sum(model_state_breakdown(PSI, N, stage).values()) == pytest.approx(
            model_state_bytes(PSI, N, stage), rel=1e-15)
    assert model_state_breakdown(64, 8, 1) == {"param": 128, "grad": 128, "master": 32,
                                               "adam_m": 32, "adam_v": 32}
    assert model_state_breakdown(64, 8, 3, master_bytes=0)["master"] == 0


def test_comm_volume():
    assert comm_volume_elements(PSI, N, 0) == 2 * PSI * 63 / 64
    assert comm_volume_elements(PSI, N, 1) == comm_volume_elements(PSI, N, 2)
    assert comm_volume_elements(PSI, N, 3) == 1.5 * comm_volume_elements(PSI, N, 2)
    assert comm_volume_elements(1000, 1, 3) == 0


@pytest.mark.parametrize("fn", [model_state_bytes, model_state_breakdown, comm_volume_elements])
def test_invalid_arguments(fn):
    for stage in (4, -1, True, "1"):
        with pytest.raises(ValueError, match="unknown ZeRO stage .*; valid: 0, 1, 2, 3"):
            fn(100, 2, stage)
    with pytest.raises(ValueError, match="world_size"):
        fn(100, 0, 1)
    with pytest.raises(ValueError, match="num_params"):
        fn(-1, 2, 1)


def test_device_pool_reading_is_reported():
    reading = {"used": 3 * 2**20, "held": 5 * 2**20}
    ledger = MemoryLedger(device_pool=lambda: reading)
    assert ledger.device_pool_bytes() == reading
    assert "3.00 used, 5.00 held" in ledger.report()
    assert ledger.snapshot()["device_pool"] == reading
    assert MemoryLedger().device_pool_bytes() == {"used": 0, "held": 0}


def test_budget_raises_before_allocating_and_names_the_buffer():
    from zmpi.memory import OutOfMemory

    ledger = MemoryLedger(budget={"device": 3 * 2**20})
    a = ledger.allocate((2**20,), "float16", "param", name="params")
    with pytest.raises(OutOfMemory, match=r"device memory budget of 3.0 MiB exceeded: master "
                                          r"\(master, 4.0 MiB\) on top of 2.0 MiB held "
                                          r"\(param 2.0; MiB\)"):
        ledger.allocate((2**20,), "float32", "master", name="master")
    assert ledger.current() == 2 * 2**20  # nothing was registered
    ledger.allocate((2**19,), "float16", "grad", device="host")  # no host budget
    ledger.release(a)
    ledger.allocate((2**19,), "float32", "master", name="master")  # 2 MiB: fits now


def test_an_allocator_refusal_is_out_of_memory_naming_the_buffer():
    """A MemoryError from the array module (CuPy's OutOfMemoryError on a GPU is one) comes
    out as the ledger's OutOfMemory, with what this rank holds, and registers nothing."""
    from zmpi.memory import OutOfMemory

    class FullDevice:  # an array module whose allocator is out of memory
        @staticmethod
        def zeros(shape, dtype):
            raise MemoryError("Out of memory allocating 4,194,304 bytes")

    ledger = MemoryLedger()
    ledger.allocate((2**20,), "float16", "param", name="params")
    with pytest.raises(OutOfMemory, match=r"device allocation failed: master \(master, 4.0 MiB\) "
                                          r"on top of 2.0 MiB held \(param 2.0; MiB\): Out of "
                                          r"memory allocating 4,194,304 bytes"):
        ledger.allocate((2**20,), "float32", "master", name="master", xp=FullDevice)
    assert ledger.current() == 2 * 2**20


def test_engine_over_budget_fails_cleanly_and_a_smaller_model_fits():
    from zmpi.engine import Engine
    from zmpi.memory import OutOfMemory
    from zmpi.models.gpt import GPT, GPTConfig

    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
           "memory_budget": {"device": 200_000}}
    with pytest.raises(OutOfMemory, match="device memory budget"):
        Engine(GPT(GPTConfig(16, 8, 4, 2, 32)), cfg)
    small = Engine(GPT(GPTConfig(16, 8, 1, 2, 8)), cfg)
    small.train_step(np.zeros((2, 8), int), np.zeros((2, 8), int))


def test_activations_are_counted_while_they_live_once_per_buffer():
    """The layers' saved activations are in the ledger during a step (category activation,
    each buffer once, however many caches hold views of it) and gone after backward."""
    from zmpi.engine import Engine
    from zmpi.models.gpt import GPT, GPTConfig
    from zmpi.nn.module import activations_counted_in

    engine = Engine(GPT(GPTConfig(16, 8, 2, 2, 16)), {"train_micro_batch_size_per_gpu": 4})
    x = np.zeros((4, 8), int)
    with activations_counted_in(engine.memory):
        engine.model.forward_loss(x, x)
        held = engine.memory.current("activation")
        caches = [m._cache for m in engine.model.modules() if m._cache is not None]
        engine.model.clear_cache()
    assert held > 0 and engine.memory.current("activation") == 0
    assert len(caches) > 5  # many layers hold views of the same buffers: counted once each
    engine.train_step(x, x)
    assert engine.memory.peak("activation") >= held and engine.memory.current("activation") == 0


@pytest.mark.mpi
def test_communication_buffers_do_not_grow_with_the_model():
    """ZeRO-R's constant-size buffers (CB): at 2, 4 and 8 layers of one width the buckets and
    reduce-scatter parts (comm_buffer) and the unit gradients in flight (stages 2-3) peak at
    the same bytes, with and without overlap_comm (the collectives in flight hold at most
    Strategy.in_flight_limit, two buckets, beyond the newest one's buffers); only stage 1's
    reduced gradient shard, one rank's 1/N of the gradients during the step, grows."""
    runs = run_mpi(RANKS_DIR / "constant_buffer_checks.py", 2, timeout=240)[0]
    for stage in range(4):
        for overlap in (0, 1):
            by_layers = [runs[f"L{layers}_stage{stage}_overlap{overlap}"] for layers in (2, 4, 8)]
            assert by_layers[0]["params"] < by_layers[1]["params"] < by_layers[2]["params"]
            beyond_shard = {r["comm_buffer"] - (r["shard"] if stage == 1 else 0)
                            for r in by_layers}
            in_flight = {r["grad_peak"] - r["grad_now"] for r in by_layers}
            assert len(beyond_shard) == 1 and len(in_flight) == 1, (stage, overlap, by_layers)
            if stage < 2:  # (stages 2-3: a constant; 0 where the host Adam writes the
                assert beyond_shard == {0}  # owned slices and the allgather runs in place)
            assert in_flight == ({0} if stage < 2 else in_flight - {0})

"""Rank side of tests/test_onebit.py: 1-bit Adam at one world size, in one launch.

    mpiexec -n N python tests/ranks/onebit_checks.py OUT_DIR

- allreduce: the compressed allreduce of float32 buffers of uneven lengths (1003 and 5
  elements: chunks that are partly or wholly padding), several calls in a row so that the
  errors carry over, against onebit_reference.CompressedAverage: the result and both errors
  bit for bit; the bytes Comm counted per call; the error buffers in the ledger.
- optimizer: OneBitAdam on flat float32 arrays across freeze_step (elements that never get a
  gradient included; chunked), against onebit_reference.OneBitAdam bit for bit, and the
  parameters it publishes.
- engine (NumPy): an fp64 GPT with gradient accumulation and clipping against the reference
  fed with each rank's gradient from a single-process model; the traffic of every step.
- overflow (NumPy): fp16, an inf planted in the last rank's own gradient after the warm-up:
  every rank skips, nothing of the optimizer moves; the traffic of every step.
- checkpoint (NumPy): a load after the warm-up resets the errors and nothing else.
On the CuPy stand-in (ZMPI_BACKEND=cupy) only the first two run, on device arrays.
"""
import hashlib
import sys

import numpy as np
from _report import report
from onebit_reference import CompressedAverage, OneBitAdam, padded
from zero_checks import GLOBAL_BATCH, GPT_CONFIG, gpt_data

from zmpi import backend
from zmpi.comm import Comm
from zmpi.comm.compressed import CompressedAllreduce
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import ARRAY_OPS, MemoryLedger
from zmpi.models.gpt import GPT
from zmpi.optim import onebit
from zmpi.zero.flat import ModelLayout, UnitLayout

F32 = np.float32


def host(a):
    return backend.to_host(a)


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(host(a)).tobytes())
    return h.hexdigest()


def sent(comm) -> int:
    return sum(comm.counters[op].sent for op in ARRAY_OPS)


def calls(comm) -> dict:
    return {op: c.calls for op, c in comm.counters.items() if c.calls}


def allreduce(comm):
    n_ranks, xp, out = comm.size, backend.xp, []
    for numel in (1003, 5):
        ledger = MemoryLedger()
        average = CompressedAllreduce(comm, numel, F32, ledger, xp)
        ref = CompressedAverage(n_ranks, numel)
        for call in range(3 if numel > 10 else 2):
            inputs = [(np.random.default_rng(100 * call + i).standard_normal(numel) * (1 + i))
                      .astype(F32) for i in range(n_ranks)]
            for a in inputs:  # exact zeros and negative zeros count as positive signs
                a[:2], a[2:4] = 0.0, -0.0
            buf = xp.asarray(inputs[comm.rank].copy())  # the average writes into it
            comm.reset_counters()
            average(buf)
            want = ref(inputs)
            out.append({"numel": numel, "call": call, "padded": average.padded,
                        "result_equal": bool(np.array_equal(host(buf), want)),
                        "max_diff": float(np.abs(host(buf) - want).max()),
                        "worker_error_equal": bool(np.array_equal(
                            host(average.worker_error), ref.worker_error[comm.rank])),
                        "server_error_equal": bool(np.array_equal(
                            host(average.server_error), ref.server_error[comm.rank])),
                        "sent": sent(comm), "declared": average.sent_bytes(),
                        "calls": calls(comm),
                        "comm_buffer": ledger.current("comm_buffer")})
        average.reset()
        out[-1]["comm_buffer_after_reset"] = ledger.current("comm_buffer")
    return out


def optimizer(comm):
    """7 steps, freeze_step 3: float32 flat arrays; elements 10..19 never get a gradient,
    20..24 one below eps."""
    n_ranks, xp, numel, out = comm.size, backend.xp, 1003, []
    hyper = dict(lr=1e-2, weight_decay=0.1)
    p0 = np.random.default_rng(7).standard_normal(numel).astype(F32)
    ref = OneBitAdam(p0, n_ranks, freeze_step=3, **hyper)
    average = CompressedAllreduce(comm, numel, F32, MemoryLedger(), xp)
    chunks = dict(chunk=100, threads=2) if xp is np else {}
    opt = onebit.OneBitAdam(freeze_step=3, average=average, **hyper, **chunks)
    param, m, v = xp.asarray(p0), xp.zeros(numel, F32), xp.zeros(numel, F32)
    for t in range(7):
        local = [np.random.default_rng(1000 * t + i).standard_normal(numel).astype(F32) * (i + 1)
                 for i in range(n_ranks)]
        for g in local:
            g[10:20] = 0.0  # never a gradient (v == 0) ...
            g[20:25] *= 1e-12  # ... or only rounding noise (sqrt(v) <= eps): masked too
        warm = opt.reduces_gradients
        published = np.zeros(numel, np.float16) if xp is np else None
        publish = [(0, published)] if published is not None else None
        if warm:
            summed = local[0].copy()
            for g in local[1:]:
                summed += g
            opt.step_(param, xp.asarray(summed), m, v, grad_scale=0.5 / n_ranks,
                      publish=publish)
            ref.step(summed, 0.5 / n_ranks)
        else:
            opt.step_(param, xp.asarray(local[comm.rank]), m, v, grad_scale=0.5,
                      publish=publish)
            ref.step(local, [0.5] * n_ranks)
        out.append({"step": t + 1, "warm": warm, "step_count": opt.step_count,
                    "param_equal": bool(np.array_equal(host(param), ref.p)),
                    "m_equal": bool(np.array_equal(host(m), ref.m)),
                    "v_equal": bool(np.array_equal(host(v), ref.v)),
                    "max_diff": float(np.abs(host(param) - ref.p).max()),
                    "published_equal": None if published is None else bool(
                        np.array_equal(published, host(param).astype(np.float16)))})
    return out


def flat_layout(model, n_ranks):
    """The engine's flat layout of `model`, rebuilt: (layout, [{model-wide name: param}])."""
    names = {id(p): name for name, p in model.named_parameters()}
    unit_params = [{names[id(p)]: p for _, p in unit.named_parameters()} for unit in model.units]
    layout = ModelLayout([UnitLayout.build({n: p.data.shape for n, p in ps.items()}, n_ranks)
                          for ps in unit_params])
    return layout, unit_params


def model_grads(model, layout, unit_params, flat_params, x, y):
    """The flat gradient of the mean loss over rows x, y at flat_params (float64)."""
    for u, ps in enumerate(unit_params):
        views = layout.units[u].views(flat_params[layout.full_slice(u)])
        for name, p in ps.items():
            p.data[...] = views[name]
    model.zero_grad()
    model.loss(x, y)
    model.backward_loss()
    flat = np.zeros(layout.full_numel)
    for u, ps in enumerate(unit_params):
        views = layout.units[u].views(flat[layout.full_slice(u)])
        for name, p in ps.items():
            views[name][...] = p.grad
    return flat


def onebit_config(n_ranks, dtype, accumulation=1, clip=0.0, freeze_step=3, **fp16):
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // n_ranks,
           "gradient_accumulation_steps": accumulation, "gradient_clipping": clip,
           "optimizer": {"type": "OneBitAdam", "params": {
               "lr": 1e-2, "weight_decay": 0.1, "freeze_step": freeze_step,
               "bias_correction": False, "comm_backend_name": "mpi"}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 2000}}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **fp16}
    return cfg


def engine(comm):
    """fp64 GPT, accumulation 2, clipping 0.05 (active at every step), freeze_step 3, 7 steps,
    against the reference: the warm-up on the mean of every rank's gradient, clipped by its
    norm; then each rank's gradient clipped by its own norm (DeepSpeed's local clipping)."""
    n_ranks, clip, out = comm.size, 0.05, []
    eng = Engine(GPT(GPT_CONFIG, seed=0, dtype=np.float64),
                 onebit_config(n_ranks, "fp64", accumulation=2, clip=clip), comm)
    model = GPT(GPT_CONFIG, seed=0, dtype=np.float64)
    layout, unit_params = flat_layout(model, n_ranks)
    p0 = host(eng.strategy.master).copy()
    ref = OneBitAdam(p0, n_ranks, lr=1e-2, freeze_step=3, weight_decay=0.1)
    sources = [SyntheticSource(GPT_CONFIG.vocab_size, GPT_CONFIG.seq_len, GLOBAL_BATCH * 2, i,
                               n_ranks, seed=1) for i in range(n_ranks)]
    data = gpt_data(comm, 2)

    def clipped(g):
        return min(1.0, clip / (np.sqrt(float(g @ g)) + 1e-6))

    for t in range(7):
        declared = eng.expected_traffic()["world"]
        eng.reset_counters()
        eng.train_step(*data.sample(t))
        grads = [model_grads(model, layout, unit_params, ref.p, *s.sample(t)) for s in sources]
        if ref.warm():
            mean = sum(grads) / n_ranks
            ref.step(mean, clipped(mean))
        else:
            ref.step(grads, [clipped(g) for g in grads])
        got = host(eng.strategy.master)
        out.append({"step": t + 1, "rel_err": float(np.abs(got - ref.p).max()
                                                     / np.abs(ref.p - p0).max()),
                    "sent": sent(eng.comm), "declared": declared, "calls": calls(eng.comm),
                    "comm_buffer": eng.memory.current("comm_buffer")})
    return {"steps": out, "full_numel": eng.layout.full_numel,
            "padded": padded(eng.layout.full_numel, n_ranks)}


def overflow(comm):
    """fp16, freeze_step 2, an inf in the last rank's own gradient at step 4: every rank
    skips it (the overflow check precedes the momentum update)."""
    eng = Engine(GPT(GPT_CONFIG, seed=0), onebit_config(comm.size, "fp16", freeze_step=2,
                                                       initial_scale_power=8), comm)
    strategy, reduce, step, out = eng.strategy, eng.strategy.before_step, [0], []

    def before_step():
        reduce()
        if step[0] == 3 and comm.rank == comm.size - 1:
            strategy.optimizer_grads()[0] = np.inf

    strategy.before_step = before_step
    data = gpt_data(comm, 1)
    for step[0] in range(6):
        declared = eng.expected_traffic()["world"]
        eng.reset_counters()
        eng.train_step(*data.sample(step[0]))
        average = eng.optimizer.average
        out.append({"step": step[0], "step_count": eng.optimizer.step_count,
                    "scale": eng.scaler.scale, "skipped": eng.scaler.skipped_steps,
                    "state": digest(strategy.master, strategy.adam_m, strategy.adam_v,
                                    strategy.params_full),
                    "errors": None if average.worker_error is None else digest(
                        average.worker_error, average.server_error),
                    "sent": sent(eng.comm), "declared": declared, "calls": calls(eng.comm)})
    return {"steps": out, "full_numel": eng.layout.full_numel,
            "declared_warm": strategy.expected_traffic()["world"]}


def checkpoint(comm, out_dir):
    """Save after step 4 (freeze_step 2); a fresh engine that loads it and one that instead
    resets its errors at that point then train 2 more steps: the same bits."""
    def build():
        return Engine(GPT(GPT_CONFIG, seed=0), onebit_config(comm.size, "fp32",
                                                            freeze_step=2), comm)

    data = gpt_data(comm, 1)
    reset, saved = build(), build()
    for t in range(4):
        reset.train_step(*data.sample(t))
        saved.train_step(*data.sample(t))
    saved.save_checkpoint(f"{out_dir}/ckpt")
    loaded = build()
    loaded.load_checkpoint(f"{out_dir}/ckpt")
    errors_after_load = loaded.optimizer.average.worker_error
    reset.optimizer.average.reset()
    for t in range(4, 6):
        for e in (reset, saved, loaded):
            e.train_step(*data.sample(t))
    return {"errors_after_load": None if errors_after_load is None else "kept",
            "step_count_loaded": loaded.optimizer.step_count,
            "loaded_equals_reset": digest(loaded.strategy.master, loaded.strategy.adam_m)
            == digest(reset.strategy.master, reset.strategy.adam_m),
            "loaded_equals_uninterrupted": digest(loaded.strategy.master)
            == digest(saved.strategy.master)}


def main(out_dir):
    comm = Comm()
    result = {"backend": backend.name, "allreduce": allreduce(comm),
              "optimizer": optimizer(comm)}
    if not backend.is_gpu:
        result.update(engine=engine(comm), overflow=overflow(comm),
                      checkpoint=checkpoint(comm, out_dir))
    report(result)


if __name__ == "__main__":
    main(sys.argv[1])

"""Rank side of tests/test_zero.py: every check of every partition strategy for one world size,
in one launch.

    mpiexec -n N python tests/ranks/zero_checks.py OUT_DIR [package.module:Class ...]

The strategies are every registered one (each with its `suite_configs(N)`) plus those named
on the command line. Parity runs write rank 0's gathered parameters to
OUT_DIR/<strategy>__<variant>.npz (the test compares them with the single-process reference);
everything else goes into the rank's one JSON report.
"""
import hashlib
import sys

import numpy as np
from _report import report

from zmpi import backend
from zmpi.comm import _PROGRESS, Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import MODEL_STATE
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.mlp import MLPModel
from zmpi.zero import available_strategies, get_strategy

GPT_CONFIG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
GLOBAL_BATCH = 12  # rows per micro-step over all ranks: splits over 1, 2, 3 and 4 ranks
STEPS = 5
VARIANTS = {  # name: (precision, gradient_accumulation_steps, gradient_clipping, overlap_comm)
    "fp64": ("fp64", 1, 0.0, False),  # a float64 model: fp64 storage and master, for exactness
    "fp64_accum_clip": ("fp64", 2, 0.05, False),
    "fp64_overlap": ("fp64", 2, 0.05, True),  # non-blocking collectives; stage 3 w/o prefetch
    "fp32": ("fp32", 1, 0.0, False),
    "fp32_accum_clip": ("fp32", 2, 0.05, False),
    "fp16": ("fp16", 1, 0.0, False),
    "bf16": ("bf16", 1, 0.0, False),
}


def strategies(n, paths=()):
    """(label, zero_optimization extras) of every strategy under test: each registered one
    (after loading `paths`) with each of its suite configs, e.g. "hybrid,shard_group_size=2"."""
    for path in paths:
        get_strategy(path)  # registers it under its own name
    for name in available_strategies():
        for extra in get_strategy(name).suite_configs(n):
            label = name + "".join(f",{k}={v}" for k, v in extra.items())
            yield label, {"strategy": name, **extra}


def config(stage, dtype="fp32", accumulation=1, clip=0.0, overlap=False, n=1, **fp16):
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // n,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                              "overlap_comm": overlap, "prefetch": not overlap},
    }
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **fp16}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def gpt_data(comm, accumulation):
    return SyntheticSource(GPT_CONFIG.vocab_size, GPT_CONFIG.seq_len,
                           GLOBAL_BATCH * accumulation, comm.rank, comm.size, seed=1)


def engine_for(model, zero, cfg, comm):
    del cfg["zero_optimization"]["stage"]  # the strategy is named
    cfg["zero_optimization"].update(zero)
    return Engine(model, cfg, comm)


def parity(comm, out_dir, cases):
    results = []
    for label, zero in cases:
        for variant, (dtype, accumulation, clip, overlap) in VARIANTS.items():
            if dtype == "bf16" and backend.is_gpu and backend.cupy_bfloat16_refusal():
                continue  # a CuPy before 14 has no bfloat16
            model = GPT(GPT_CONFIG, seed=0, dtype=np.float64 if dtype == "fp64" else np.float32)
            engine = engine_for(model, zero, config(0, dtype, accumulation, clip, overlap,
                                                    comm.size), comm)
            data = gpt_data(comm, accumulation)
            pokes = _PROGRESS.pokes
            losses = [engine.train_step(*data.sample(step)) for step in range(STEPS)]
            pokes = _PROGRESS.pokes - pokes  # the engine's MPI probes between units
            params = engine.gather_parameters()
            resident = engine.strategy.params_full
            if comm.rank == 0:
                np.savez(f"{out_dir}/{label}__{variant}.npz", **params)
            results.append({"strategy": label, "variant": variant, "losses": losses,
                    "gathered": digest(params[k] for k in sorted(params)),
                    "resident": None if resident is None else digest([resident]),
                    "pokes": pokes, "progress_thread": _PROGRESS._thread is not None})
    return results


def memory_and_traffic(comm, cases):
    """One fp16 step of each model with each strategy: what the ledger and the counters saw,
    and what the strategy declares."""
    results = []
    models = {"gpt": lambda: GPT(GPT_CONFIG, seed=0), "mlp": lambda: MLPModel(seed=0)}
    for model_name, build in models.items():
        for label, zero in cases:
            engine = engine_for(build(), zero, config(0, "fp16", n=comm.size), comm)
            if model_name == "gpt":
                batch = gpt_data(comm, 1).sample(0)
            else:
                rng = np.random.default_rng(comm.rank)
                batch = (rng.standard_normal((GLOBAL_BATCH // comm.size, 16)).astype(np.float32),
                         rng.integers(0, 8, GLOBAL_BATCH // comm.size))
            engine.memory.reset_peaks()
            engine.train_step(*batch)
            layout, strategy = engine.layout, engine.strategy
            results.append({"model": model_name, "strategy": label,
                    "num_params": layout.num_params, "full_numel": layout.full_numel,
                    "unit_padded": [u.padded_numel for u in layout.units],
                    "unit_numel": [u.numel for u in layout.units],
                    "shared": [list(s) for s in strategy._shared],
                    "model_state_bytes": engine.memory.model_state_bytes(),
                    "held": {d: {c: engine.memory.current(c, d) for c in MODEL_STATE}
                             for d in ("device", "host")},
                    "declared_memory": strategy.expected_model_state(),
                    "counters": engine.traffic(),
                    "declared_traffic": strategy.expected_traffic()})
    return results


LOSS_CASES = {  # name: (strategy, gradient_accumulation_steps)
    "mse_stage3": ("stage3", 1),  # an MLP regressor with MSELoss
    "ignore_index_stage2": ("stage2", 2),  # GPT, cross-entropy ignoring -100 targets
}


def regression_batch(step, rows=slice(None)):
    """A regression problem: x (GLOBAL_BATCH, 16), y (GLOBAL_BATCH, 2) = a smooth function of x
    plus noise; rows selects this rank's part."""
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((GLOBAL_BATCH, 16))
    y = np.stack([np.sin(x[:, 0]) + x[:, 1] * x[:, 2], np.tanh(x[:, 3:6].sum(1))], 1)
    return x[rows], y[rows] + 0.1 * rng.standard_normal(y.shape)[rows]


def ignore_targets(targets, first_row):
    """Targets with the first (global row index % 5) positions of each row set to -100, so the
    number of counted tokens differs between ranks and micro-batches."""
    targets = targets.copy()
    for i in range(len(targets)):
        targets[i, : (first_row + i) % 5] = -100
    return targets


def losses(comm, out_dir):
    """Pluggable losses trained across ranks: rank 0 saves the parameters for the test's
    single-process reference."""
    from zmpi.models.mlp import MLPModel
    from zmpi.nn import CrossEntropyLoss, MSELoss

    results = {}
    for name, (strategy, accumulation) in LOSS_CASES.items():
        cfg = config(0, "fp64", accumulation, n=comm.size)
        if name.startswith("mse"):
            model = MLPModel((16, 32, 2), dtype=np.float64, loss=MSELoss())
            rows = GLOBAL_BATCH // comm.size
            batches = [regression_batch(s, slice(comm.rank * rows, (comm.rank + 1) * rows))
                       for s in range(STEPS)]
        else:
            model = GPT(GPT_CONFIG, seed=0, dtype=np.float64)
            model.loss_fn = CrossEntropyLoss(ignore_index=-100)
            data = gpt_data(comm, accumulation)
            batches = [(x, ignore_targets(y, comm.rank * len(y)))
                       for x, y in map(data.sample, range(STEPS))]
        engine = engine_for(model, {"strategy": strategy}, cfg, comm)
        results[name] = [engine.train_step(x, y) for x, y in batches]
        params = engine.gather_parameters()
        if comm.rank == 0:
            np.savez(f"{out_dir}/loss_{name}.npz", **params)
    return results


def loss_scaler(comm):
    """fp16, window 2, hysteresis 1, scale 2^8; an inf planted in rank N-1's gradient at step 2
    must skip the step on every rank and halve the scale."""
    results = []
    for stage in (0, 3):
        engine = Engine(GPT(GPT_CONFIG, seed=0),
                        config(stage, "fp16", n=comm.size, initial_scale_power=8,
                               loss_scale_window=2, hysteresis=1), comm)
        data, scales, skipped_change = gpt_data(comm, 1), [], None
        strategy = engine.strategy
        reduce = strategy.before_step
        for step in range(6):
            poison = step == 2 and comm.rank == comm.size - 1
            strategy.before_step = lambda r=reduce, s=strategy, p=poison: (
                r(), p and s.optimizer_grads().__setitem__(0, np.inf))
            before = engine.gather_parameters() if step == 2 else None
            engine.train_step(*data.sample(step))
            if before is not None:
                after = engine.gather_parameters()
                skipped_change = max(float(np.abs(after[k] - before[k]).max()) for k in before)
            scales.append(engine.scaler.scale)
        results.append({"stage": stage, "scales": scales,
                "skipped": engine.scaler.skipped_steps, "global_steps": engine.global_steps,
                "skipped_change": skipped_change})
    return results


if __name__ == "__main__":
    comm = Comm()
    cases = list(strategies(comm.size, sys.argv[2:]))
    report({"parity": parity(comm, sys.argv[1], cases),
            "memory_traffic": memory_and_traffic(comm, cases),
            "losses": losses(comm, sys.argv[1]),
            "loss_scaler": loss_scaler(comm)})

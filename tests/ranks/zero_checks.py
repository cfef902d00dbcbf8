"""Rank side of tests/test_zero.py: every check of every partition strategy for one world size,
in one launch.

    mpiexec -n N python tests/ranks/zero_checks.py OUT_DIR [--only NAME ...] [SPEC ...]

The strategies are every registered one (each with its `suite_configs(N)`) plus those the
SPECs load: "package.module:Class", or a strategy file "path/to/file.py" whose `@register`
strategies join (tests/conftest.py's --strategy-module). With --only, just the strategies
named (and the strategy-independent checks, losses and the loss scaler, are left out).
Parity runs write rank 0's gathered parameters to
OUT_DIR/<strategy>__<variant>.npz (the test compares them with the single-process reference);
everything else goes into the rank's one JSON report.
"""
import argparse
import hashlib
import math

import numpy as np
from _report import report

from zmpi import backend
from zmpi.comm import _PROGRESS, Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.engine.moe import make_expert_parallel
from zmpi.memory import MODEL_STATE
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.llama import Llama, LlamaConfig
from zmpi.models.mlp import MLPModel
from zmpi.zero import available_strategies, get_strategy, load_strategy_file

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


def strategies(n, paths=(), only=()):
    """(label, zero_optimization extras) of every strategy under test: each registered one
    (after loading `paths`: "module:Class" or a file "x.py"), or only those named in `only`,
    with each of its suite configs, e.g. "hybrid,shard_group_size=2". ValueError for a name
    in `only` that is not available."""
    for path in paths:
        if path.endswith(".py"):
            load_strategy_file(path)
        else:
            get_strategy(path)  # registers it under its own name
    unknown = sorted(set(only) - set(available_strategies()))
    if unknown:
        raise ValueError(f"no partition strategy {', '.join(map(repr, unknown))}; available: "
                         f"{', '.join(available_strategies())} (a strategy file: "
                         "--strategy-module FILE.py)")
    for name in sorted(only) or available_strategies():
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


MOE = {"num_experts": [4, 2], "layers": [0, 1], "k": 2, "capacity_factor": 0.5,
       "min_capacity": 0, "noisy_gate_policy": "RSample", "z_loss_coef": 1e-3}  # drops tokens
MOE_CASES = {  # name: (ZeRO stage, accumulation, clipping, recompute, the GPT's moe section)
    "stage0": (0, 2, 0.05, "none", MOE),
    "stage1": (1, 1, 0.0, "none", {"num_experts": 4, "noisy_gate_policy": "Jitter",
                                   "moe_layer_interval": 2, "capacity_factor": 0.75}),
    "stage2": (2, 2, 0.05, "none", {"num_experts": 3, "k": 2, "use_residual": True,
                                    "num_shared_experts": 1, "capacity_factor": 0.5}),
    "stage3": (3, 2, 0.05, "full", MOE),  # the recomputed forward routes the same
}


def moe_routing_record(engine):
    """Wraps engine.moe.losses (called once per micro-batch forward) to keep every MoE layer's
    choices and drops; returns the list it appends [(experts, kept) per layer] to."""
    seen, losses = [], engine.moe.losses

    def recording():
        seen.append([(layer.routing.experts.copy(), layer.routing.kept.copy())
                     for layer in engine.moe.layers])
        return losses()

    engine.moe.losses = recording
    return seen


def moe_ep(section, n: int) -> int:
    """The expert-parallel degree a MoE case runs at on n ranks: the largest that divides n
    and every layer's expert count ((dp, ep) = (2, 2), (3, 3), (4, 2), (4, 4), (3, 1) ...)."""
    experts = section["num_experts"]
    return math.gcd(n, *(experts if isinstance(experts, list) else [experts]))


def moe(comm, out_dir):
    """A GPT with MoE blocks (MOE_CASES) trained in fp64 under ZeRO 0-3, with expert
    parallelism at `moe_ep`: rank 0 saves the parameters and every step's routing of every
    global row, gathered in global order (OUT_DIR/moe_<case>.npz: the parameters,
    route<step>_<layer>_{experts,kept}); the test compares them with one process. Returns
    {case: {"losses", "ep", and at ep > 1 what the ledger holds against what the two
    strategies declare, the expert strategy's layout, the all-to-all counters and the
    losses of the runs resumed from its checkpoint (`moe_resumes`)}}."""
    results = {}
    for name, (stage, accumulation, clip, recompute, section) in MOE_CASES.items():
        ep = moe_ep(section, comm.size)

        def build(ep, group=comm, dtype="fp64", stage=stage, accumulation=accumulation,
                  clip=clip, recompute=recompute, section=section):
            cfg = config(stage, dtype, accumulation, clip, n=group.size)
            moe = {**section, "ep_size": ep}
            cfg.update(moe=moe, activation_checkpointing={"recompute": recompute})
            model = GPT(GPT_CONFIG, seed=0, dtype=np.dtype(dtype.replace("fp", "float")),
                        moe=moe)
            return Engine(model, cfg, group), gpt_data(group, accumulation)

        engine, data = build(ep)
        seen, saved = moe_routing_record(engine), {}
        results[name] = {"losses": [], "ep": ep}
        for step in range(STEPS):
            results[name]["losses"].append(engine.train_step(*data.sample(step)))
            if step + 1 == RESUME_AT and ep > 1:
                engine.save_checkpoint(f"{out_dir}/moe_{name}", tag="saved")
            mine = [[np.concatenate(a) for a in zip(*(micro[layer] for micro in seen),
                                                    strict=True)]
                    for layer in range(len(engine.moe.layers))]  # this rank's rows in order
            seen.clear()
            for layer, parts in enumerate(zip(*comm.allgather_object(mine), strict=True)):
                for what, arrays in zip(("experts", "kept"), zip(*parts, strict=True),
                                        strict=True):
                    saved[f"route{step}_{layer}_{what}"] = np.concatenate(arrays)
        params = engine.gather_parameters()
        if comm.rank == 0:
            np.savez(f"{out_dir}/moe_{name}.npz", **params, **saved)
        if engine.experts is not None:
            results[name].update(expert_checks(engine, comm, data.sample(STEPS)))
        engine.close()
        if ep > 1:
            results[name]["resumed"] = moe_resumes(comm, build, section, ep,
                                                   f"{out_dir}/moe_{name}")
    return results


RESUME_AT = 2  # the step after which a MoE case at ep > 1 saves a checkpoint


def moe_resumes(comm, build, section, ep: int, directory) -> dict:
    """The losses of steps RESUME_AT.. of runs resumed from the checkpoint saved at ep in
    `directory` (tag "saved"), keyed by the layouts they went through: "ep E>ep" for each
    other ep E the experts and world allow (resumed at ep E for one step, saved again and
    resumed at the saving ep for the rest: each direction of the reshape), and "dp D ep E"
    on the first half of the ranks (D = half the world, E = moe_ep there; None on the other
    ranks), and "fp32 ep E": the loss of step RESUME_AT at the saving ep in fp32 (the
    parameters then are the master weights cast, the experts' too). `build(ep, group,
    dtype)` -> (engine, data) of the case."""
    engine, data = build(ep, dtype="fp32")
    engine.load_checkpoint(directory, tag="saved")
    out = {f"fp32 ep {ep}": [engine.train_step(*data.sample(RESUME_AT))]}
    engine.close()
    for other in (e for e in range(1, comm.size + 1) if moe_ep(section, e) == e != ep
                  and comm.size % e == 0):
        losses = []
        for at, tag in ((other, "saved"), (ep, f"ep{other}")):
            engine, data = build(at)
            engine.load_checkpoint(directory, tag=tag)
            last = STEPS if at == ep else RESUME_AT + 1
            losses += [engine.train_step(*data.sample(step))
                       for step in range(engine.global_steps, last)]
            if at == other:
                engine.save_checkpoint(directory, tag=f"ep{other}")
            engine.close()
        out[f"ep {other}>{ep}"] = losses
    if comm.size % 2 == 0:
        half = comm.split(int(comm.rank >= comm.size // 2))
        losses = None
        if comm.rank < comm.size // 2:
            engine, data = build(moe_ep(section, half.size), half)
            engine.load_checkpoint(directory, tag="saved")
            losses = [engine.train_step(*data.sample(step)) for step in range(RESUME_AT, STEPS)]
            engine.close()
        half.free()
        out[f"dp {comm.size // 2} ep {moe_ep(section, comm.size // 2)}"] = losses
    return out


LLAMA_CONFIG = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=24,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=8)  # GQA, untied head; GPT_CONFIG's data
LLAMA_CASES = {  # name: (ZeRO stage, accumulation, clipping, offload_optimizer)
    "stage0": (0, 2, 0.05, False), "stage1": (1, 1, 0.0, False),
    "stage2_offload": (2, 2, 0.05, True), "stage3": (3, 1, 0.05, False)}


def llama(comm, out_dir):
    """A Llama (LLAMA_CONFIG) trained in fp64 under each of LLAMA_CASES on this world: rank 0
    saves the parameters (OUT_DIR/llama_<case>.npz); returns {case: the losses}; the test
    compares both with one process."""
    results = {}
    for name, (stage, accumulation, clip, offload) in LLAMA_CASES.items():
        cfg = config(stage, "fp64", accumulation, clip, n=comm.size)
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine = Engine(Llama(LLAMA_CONFIG, seed=0, dtype=np.float64), cfg, comm)
        data = gpt_data(comm, accumulation)
        results[name] = [engine.train_step(*data.sample(step)) for step in range(STEPS)]
        params = engine.gather_parameters()
        if comm.rank == 0:
            np.savez(f"{out_dir}/llama_{name}.npz", **params)
        engine.close()
    return results


def expert_checks(engine, comm, batch) -> dict:
    """At ep > 1, after training: what the ledger holds against what the engine's and the
    experts' strategies declare, the expert strategy's layout, the ops counted per mesh
    dimension; what is refused (a model made expert parallel twice); and the error of a step
    (`batch`) whose expert gradients hold a NaN on the last rank only."""
    experts = engine.experts.strategy
    out = {"held": engine.memory.model_state_bytes(),
           "declared": [s.expected_model_state() for s in engine.strategies],
           "experts": {"shard_numel": experts.layout.shard_numel, "edp": experts.world_size,
                       "full_numel": experts.layout.full_numel,
                       "num_params": experts.layout.num_params},
           "dims": {dim: sorted(op for op, c in ops.items() if c["calls"])
                    for dim, ops in engine.traffic_by_dimension().items()},
           "refused": []}
    try:
        make_expert_parallel(engine.moe, engine.mesh.experts)
    except ValueError as e:  # one line, alike on every rank
        out["refused"].append(str(e))
    reduce = experts.before_step
    experts.before_step = lambda: (reduce(), comm.rank == comm.size - 1 and
                                   experts.optimizer_grads().__setitem__(0, np.nan))
    try:
        engine.train_step(*batch)
    except FloatingPointError as e:
        out["nan"] = str(e)
    return out


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
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("specs", nargs="*")
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args()
    comm = Comm()
    cases = list(strategies(comm.size, args.specs, args.only))
    results = {"parity": parity(comm, args.out_dir, cases),
               "memory_traffic": memory_and_traffic(comm, cases)}
    if not args.only:
        results.update(losses=losses(comm, args.out_dir), loss_scaler=loss_scaler(comm),
                       moe=moe(comm, args.out_dir), llama=llama(comm, args.out_dir))
    report(results)

"""Rank side of tests/test_zeropp.py: Comm's all-to-all and every check of ZeRO++ (qwZ, qgZ,
hpZ) for one world size, in one launch.

    mpiexec -n N python tests/ranks/zeropp_checks.py OUT_DIR [standin]

Reports per rank: all-to-all results and counters; one fp16 step per mode with its measured
traffic (per communicator and op, and during backward alone), what it declares, and the
model-state bytes held; short trainings on Tiny Shakespeare (losses, digests of the trained
model); the overflow check and the config errors. With `standin` (run under the CuPy
stand-in) only the training path on device buffers runs, and writes OUT_DIR/<mode>.npz.
"""
import hashlib
import sys

import numpy as np
from _report import report
from zero_checks import GPT_CONFIG, config, gpt_data

from zmpi import backend
from zmpi.comm import CollectiveMismatch, Comm
from zmpi.config import ConfigError
from zmpi.data import BatchSampler, CharTokenizer, load_text
from zmpi.engine import Engine
from zmpi.memory import ARRAY_OPS, MODEL_STATE
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.zero.quantize import dequantize, quantize
from zmpi.zero.zeropp import GRAD_BLOCK, WEIGHT_BLOCK

QW = {"zero_quantized_weights": True}
QG = {"zero_quantized_gradients": True}
HPZ = {"zero_hpz_partition_size": 2}
MODES = {"stage3": {}, "qwZ": QW, "qgZ": QG, "hpZ": HPZ, "all": {**QW, **QG, **HPZ}}
TRAIN_STEPS = 40
# the vocabulary padded as on a GPU (128), so that NumPy and the CuPy stand-in (a GPU to zmpi)
# build the same model and the stand-in run can be compared with NumPy bit for bit
SHAKESPEARE = GPTConfig(vocab_size=65, seq_len=32, n_layer=2, n_head=2, d_model=32,
                        vocab_multiple=128)


def alltoall(comm):
    """Block j of rank r's send is 10 r + j (k elements each): rank r receives 10 j + r from
    every rank j, in every dtype Comm takes, blocking and not; then a send of the wrong size,
    and, with the debug check on, a rank that sends more than the others."""
    n, k, out = comm.size, 3, {}
    comm.reset_counters()
    for name in ("uint8", "float32", "float16", "bfloat16", "int64"):
        dtype = backend.BFLOAT16 if name == "bfloat16" else np.dtype(name)
        send = np.repeat(10 * comm.rank + np.arange(n), k).astype(dtype)
        got = comm.alltoall(send, np.zeros(n * k, dtype))
        again = comm.ialltoall(send, np.zeros(n * k, dtype)).wait()
        out[name] = [got.astype(np.float64).tolist(), again.astype(np.float64).tolist()]
    out["counters"] = comm.counters_snapshot()["alltoall"]
    try:
        comm.alltoall(np.zeros(n + 1, np.float32), np.zeros(n + 1, np.float32))
    except ValueError as e:
        out["size_error"] = str(e)
    checked = comm.split(0)  # the debug check: rank 0 sends more than the others
    checked.enable_collective_checks()
    size = 2 * n if comm.rank == 0 else n
    try:
        checked.alltoall(np.zeros(size, np.float32), np.zeros(size, np.float32))
    except CollectiveMismatch as e:
        out["mismatch"] = str(e).splitlines()[0]
    checked.free()
    return out


def engine_for(zero, cfg, comm, model=None):
    cfg["zero_optimization"].update(zero)
    return Engine(model or GPT(GPT_CONFIG, seed=0), cfg, comm)


def sent(counters) -> dict:
    return {op: c["sent"] for op, c in counters.items() if op in ARRAY_OPS and c["calls"]}


def traffic(comm):
    """One fp16 step of the test GPT per mode (and all three with overlapping communication):
    bytes sent per communicator and op, the world's allgathers during backward alone, and the
    model-state bytes held, with what the strategy declares."""
    results = {}
    for name, zero in {**MODES, "all_overlap": {**QW, **QG, **HPZ, "overlap_comm": True}}.items():
        if comm.size % 2 and "zero_hpz_partition_size" in zero:
            continue
        engine = engine_for(zero, config(3, "fp16", n=comm.size), comm)
        strategy, marks = engine.strategy, {}
        before_backward, before_step = strategy.before_backward, strategy.before_step

        def mark(key, hook, strategy=strategy, marks=marks):
            def wrapped(*args):
                marks.setdefault(key, strategy.comm.counters["allgather"].calls)
                return hook(*args)
            return wrapped

        strategy.before_backward = mark("backward", before_backward)
        strategy.before_step = mark("step", before_step)
        engine.train_step(*gpt_data(comm, 1).sample(0))
        results[name] = {
            "strategy": strategy.name, "sent": {k: sent(c) for k, c in engine.traffic().items()},
            "declared": strategy.expected_traffic(),
            "world_allgathers_in_backward": marks["step"] - marks["backward"],
            "held": {d: {c: engine.memory.current(c, d) for c in MODEL_STATE}
                     for d in ("device", "host")},
            "declared_memory": strategy.expected_model_state(),
            "units": [{"padded": u.padded_numel, "numel": u.numel,
                       "offsets": [slot.offset for slot in u.slots]}
                      for u in engine.layout.units],
            "reads": [len([v for v in range(len(engine.layout.units)) if w in strategy.needs(v)])
                      for w in range(len(engine.layout.units))]}
        engine.close()
    return results


def cuts_of(unit):
    """Where each tensor (or the padding) of `unit` starts in any rank's shard."""
    n = unit.shard_numel
    starts = {slot.offset for slot in unit.slots} | {unit.numel}
    return sorted({0} | {b % n for b in starts if b < unit.padded_numel})


def round_trip(x, bits, block, cuts):
    """Rows of x as the other side of the wire sees them (float32)."""
    return dequantize(quantize(x, bits, block, cuts), x.shape[1], bits, block, cuts)


def collectives(comm):
    """The quantized collectives of one unit against a NumPy reference of the algorithm,
    written here rank by rank (the quantizer is the shared building block): qwZ's gathered
    parameters are every rank's shard rounded through int8; qgZ's reduced shard is, in one
    hop, the float32 sum over ranks of each rank's chunk rounded through int4, and in two
    hops (pairs of ranks), the sum over the pairs of the pair's partial sums rounded again.
    Every rank's gradient is drawn from a heavy-tailed distribution, seeded by its rank."""
    out, n = {}, comm.size
    for name, zero in (("qwZ", QW), ("qgZ", QG), ("all", {**QW, **QG, **HPZ})):
        if n % 2 and "zero_hpz_partition_size" in zero:
            continue
        engine = engine_for(zero, config(3, "fp16", n=n), comm)
        strategy, u = engine.strategy, 1
        unit, cuts = engine.layout.units[u], cuts_of(engine.layout.units[u])
        m = unit.shard_numel
        exact = np.zeros(unit.padded_numel, np.float16)
        comm.allgather(strategy.params_shard[engine.layout.shard_slice(u)], exact)
        strategy.gather(u)
        if strategy.qwz:
            want = round_trip(exact.reshape(n, m), 8, WEIGHT_BLOCK, cuts).astype(np.float16).ravel()
            out[f"{name}_gather"] = bool(np.array_equal(strategy._gathered[u][0], want))
        strategy.release(u)
        if not strategy.qgz:
            engine.close()
            continue
        fulls = [(np.random.default_rng(r).standard_normal(unit.padded_numel)
                  * np.exp(2 * np.random.default_rng(50 + r).standard_normal(unit.padded_numel)))
                 .astype(np.float16) for r in range(n)]
        part = np.zeros(m, np.float16)
        strategy.ireduce_scatter(range(u, u + 1), fulls[comm.rank], part).wait()
        chunks = [f.reshape(n, m) for f in fulls]  # chunks[r][j]: rank r's chunk for rank j
        if strategy.inter is None:
            want = np.concatenate([round_trip(chunks[r][comm.rank][None], 4, GRAD_BLOCK, cuts)
                                   for r in range(n)]).sum(axis=0)
        else:  # pairs: rank 2g + l sums pair g's chunks for every rank 2h + l, then rank j
            sums = [[np.concatenate([round_trip(chunks[2 * g + k][j:j + 1], 4, GRAD_BLOCK, cuts)
                                     for k in range(2)]).sum(axis=0) for j in range(n)]
                    for g in range(n // 2)]  # sums[g][j]: pair g's partial for rank j
            want = np.concatenate([round_trip(sums[g][comm.rank][None], 4, GRAD_BLOCK, cuts)
                                   for g in range(n // 2)]).sum(axis=0)
        out[f"{name}_reduce"] = bool(np.array_equal(part, want.astype(np.float16)))
        exact_sum = np.sum([c[comm.rank] for c in chunks], axis=0, dtype=np.float64)
        out[f"{name}_reduce_error"] = float(np.linalg.norm(part - exact_sum)
                                            / np.linalg.norm(exact_sum))
        engine.close()
    return out


def digest(params) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(np.ascontiguousarray(params[k]).tobytes())
    return h.hexdigest()


def shakespeare(comm, accumulation=1):
    text = load_text()
    tokens = np.asarray(CharTokenizer(text).encode(text))
    return BatchSampler(tokens, SHAKESPEARE.seq_len, 16 * accumulation, comm.rank, comm.size,
                        seed=0)


def train(comm, zero, dtype="fp16", steps=TRAIN_STEPS, top=None, **extra):
    """`steps` steps of a small GPT on Tiny Shakespeare (16 rows of 32 tokens, lr 3e-3; `top`:
    top-level config keys, `extra`: more zero_optimization keys): (losses, parameters)."""
    cfg = config(3, dtype, n=comm.size)
    cfg["train_micro_batch_size_per_gpu"] = 16 // comm.size
    cfg["optimizer"]["params"] = {"lr": 3e-3}
    cfg.update(top or {})
    engine = engine_for({**zero, **extra}, cfg, comm, GPT(SHAKESPEARE, seed=0))
    accumulation = cfg.get("gradient_accumulation_steps", 1)
    data = shakespeare(comm, accumulation)
    losses = [engine.train_step(*data.sample(step)) for step in range(steps)]
    params = engine.gather_parameters()
    engine.close()
    return losses, params


ALL = {**QW, **QG, **HPZ}
RECOMPUTE = {"top": {"activation_checkpointing": {"recompute": "full"}}}
ACCUMULATE = {"top": {"gradient_accumulation_steps": 2}}
SHORT = {  # 6 fp16 steps each: (mode, extra keys); tests/test_zeropp.py pairs them
    "stage3_recompute": ({}, RECOMPUTE), "hpZ_recompute": (HPZ, RECOMPUTE),
    "all": (ALL, {}), "all_overlap": (ALL, {"overlap_comm": True}),
    "all_accumulate": (ALL, ACCUMULATE),
    "all_accumulate_overlap": (ALL, {**ACCUMULATE, "overlap_comm": True}),
    "qwZ": (QW, {}), "qwZ_offload_param": (QW, {"offload_param": {"device": "cpu"}}),
    "qgZ": (QG, {}), "qgZ_offload_optimizer": (QG, {"offload_optimizer": {"device": "cpu"}}),
}


def training(comm):
    """Each mode for TRAIN_STEPS steps (fp16 and fp32), and SHORT's runs."""
    out = {}
    for dtype in ("fp16", "fp32"):
        for name, zero in MODES.items():
            if comm.size % 2 == 0 or "zero_hpz_partition_size" not in zero:
                losses, params = train(comm, zero, dtype)
                out[f"{name}_{dtype}"] = {"losses": losses, "digest": digest(params)}
    for name, (zero, extra) in SHORT.items():
        if comm.size % 2 == 0 or "zero_hpz_partition_size" not in zero:
            losses, params = train(comm, zero, "fp16", 6, **extra)
            out[f"{name}_short"] = {"losses": losses, "digest": digest(params)}
    return out


def overflow(comm):
    """fp16, qgZ (two hops where the ranks make more than one group): an inf planted in one
    rank's gradient of one unit at step 2 must reach every rank through the quantized
    all-to-all, so every rank skips that step and halves the loss scale."""
    zero = {**QG, **(HPZ if comm.size % 2 == 0 else {})}
    engine = engine_for(zero, config(3, "fp16", n=comm.size, initial_scale_power=8,
                                     loss_scale_window=1000, hysteresis=1), comm)
    strategy, data, scales, changed = engine.strategy, gpt_data(comm, 1), [], None
    reduce = strategy.reduce_scatter_unit_grads
    for step in range(4):
        poison = step == 2 and comm.rank == comm.size - 1
        strategy.reduce_scatter_unit_grads = lambda u, r=reduce, p=poison: (
            p and u == 1 and strategy._unit_grads[u].__setitem__(0, np.inf), r(u))
        before = engine.gather_parameters() if step == 2 else None
        engine.train_step(*data.sample(step))
        if before is not None:
            after = engine.gather_parameters()
            changed = max(float(np.abs(after[k] - before[k]).max()) for k in before)
        scales.append(engine.scaler.scale)
    result = {"scales": scales, "skipped": engine.scaler.skipped_steps, "changed": changed}
    engine.close()
    return result


def config_errors(comm):
    """What each bad combination raises (every rank raises the same, nothing hangs)."""
    cases = {
        "hpz_not_dividing": {"zero_hpz_partition_size": 3 if comm.size % 3 else 5},
        "hpz_offload_param": {**HPZ, "offload_param": {"device": "cpu"}},
        "hybrid_with_qwz": {"strategy": "hybrid", **QW},
        "stage3_named_with_qgz": {"strategy": "stage3", **QG},
    }
    out = {}
    for name, zero in cases.items():
        cfg = config(3, "fp32", n=comm.size)
        if "strategy" in zero:
            del cfg["zero_optimization"]["stage"]
        try:
            engine_for(zero, cfg, comm).close()
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    return out


def standin(comm, out_dir):
    """The training path on device buffers: each quantized mode, 3 fp32 steps."""
    for name in ("qwZ", "qgZ", "all"):
        zero = MODES[name] if comm.size % 2 == 0 else {**QW, **QG}
        losses, params = train(comm, zero, "fp32", steps=3)
        if comm.rank == 0:
            np.savez(f"{out_dir}/{name}.npz", **params)
    return {"backend": backend.name, "staged": comm.staged_bytes,
            "cuda_aware": comm.is_cuda_aware}


if __name__ == "__main__":
    comm = Comm()
    if sys.argv[2:] == ["standin"]:
        report(standin(comm, sys.argv[1]))
    else:
        report({"alltoall": alltoall(comm), "traffic": traffic(comm),
                "collectives": collectives(comm),
                "training": training(comm), "overflow": overflow(comm),
                "config_errors": config_errors(comm)})

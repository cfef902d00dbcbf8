"""Rank side of tests/test_sequence_parallel.py: sequence parallelism (Korthikanti et al. 2022)
at every tp in {2, 4} that divides the world (a smaller tp runs in dp groups).

    mpiexec -n 2 python tests/ranks/sp_checks.py     # (dp, tp) = (1, 2)
    mpiexec -n 4 python tests/ranks/sp_checks.py     # (2, 2) and (1, 4)

Reports, per tp:
  regions    the two operators against their definitions (every rank's shard and partial sum
             is made from a seed, so each rank knows what the others hold), their counters,
             and at tp = 2 a float64 finite-difference check of the sequence-parallel MLP
             (Column -> GELU -> Row with sequence_parallel) against the serial MLP
  runs       a GPT trained 5 steps with sequence parallelism at stages 0-3 (fp64, fp32; fp16
             and bf16 at stages 1 and 3) against the unsplit model in one process (fp16/bf16:
             the same data-parallel run without tensor parallelism) and against the same
             tensor-parallel run without sequence parallelism; the tensor traffic; the replica
             check after training
  memory     what the layers keep for backward after one forward, with and without sequence
             parallelism, by where it is kept (LayerNorms, the embedding, the rest)
  generated  tokens sampled with and without sequence parallelism
  errors     a sequence tp does not divide; a model and config that disagree on it
"""
import sys
from pathlib import Path

import numpy as np
from _report import report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: gradcheck
from gradcheck import directional_check  # noqa: E402
from tensor_checks import Serial, collective_directional_check  # noqa: E402
from tp_checks import errors  # noqa: E402

from zmpi.comm import MPI, Comm  # noqa: E402
from zmpi.data import SyntheticSource  # noqa: E402
from zmpi.engine import Engine  # noqa: E402
from zmpi.memory import MemoryLedger  # noqa: E402
from zmpi.models.gpt import GPT, GPTConfig  # noqa: E402
from zmpi.nn import GELU, LayerNorm, Linear  # noqa: E402
from zmpi.nn.module import activations_counted_in  # noqa: E402
from zmpi.parallel.mesh import Mesh  # noqa: E402
from zmpi.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from zmpi.parallel.tensor.regions import (  # noqa: E402
    GatherFromSequenceRegion,
    ReduceScatterToSequenceRegion,
)

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layer=2, n_head=4, d_model=16)  # 13: padded
BATCH, STEPS = 8, 5
B, S, C = 2, 8, 6  # the operators' tests: (B, S, C), S a multiple of 2 and 4
PRECISIONS = {"fp64": (np.float64, {}, None), "fp32": (np.float32, {}, None),
              "fp16": (np.float32, {"fp16": {"enabled": True}}, (1, 3)),
              "bf16": (np.float32, {"bf16": {"enabled": True}}, (1, 3))}
MEMORY_CFG = GPTConfig(vocab_size=13, seq_len=64, n_layer=2, n_head=4, d_model=64)
MEMORY_BATCH = 4


def max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# ---- (a) the operators ---------------------------------------------------------------------


def full(seed, shape=(B, S, C)):
    return np.random.default_rng(seed).standard_normal(shape)


def shard(a, tp):
    n = a.shape[1] // tp.size
    return a[:, tp.rank * n:(tp.rank + 1) * n]


def operators(tp):
    """Each operator's forward and backward against its definition, and its counters."""
    out = {}
    tp.reset_counters()
    gather = GatherFromSequenceRegion(tp)
    x = full(1)  # the whole sequence; rank r holds its shard
    y = gather.forward(np.ascontiguousarray(shard(x, tp)))
    out["gather_forward"] = max_rel(y, x)
    out["gather_forward_contiguous"] = bool(y.flags.c_contiguous)
    dys = [full(10 + r) for r in range(tp.size)]  # rank r's dy
    dx = gather.backward(dys[tp.rank])
    out["gather_backward"] = max_rel(dx, shard(sum(dys), tp))
    out["gather_counters"] = tp.counters_snapshot()

    tp.reset_counters()
    scatter = ReduceScatterToSequenceRegion(tp)
    parts = [full(20 + r) for r in range(tp.size)]  # rank r's partial sum
    y = scatter.forward(parts[tp.rank])
    out["scatter_forward"] = max_rel(y, shard(sum(parts), tp))
    out["scatter_shape"] = list(y.shape)
    dy = full(30)
    dx = scatter.backward(np.ascontiguousarray(shard(dy, tp)))
    out["scatter_backward"] = max_rel(dx, dy)
    out["scatter_counters"] = tp.counters_snapshot()
    half = np.ones((1, tp.size, 2), np.float16)  # 16-bit activations move in float32
    out["fp16_dtypes"] = [str(GatherFromSequenceRegion(tp).forward(half).dtype),
                          str(ReduceScatterToSequenceRegion(tp).forward(half).dtype)]
    try:
        ReduceScatterToSequenceRegion(tp).forward(np.ones((1, 4 * tp.size + 1, 2)))
        out["refusal"] = None
    except ValueError as e:
        out["refusal"] = str(e)
    return out


class MLP(Serial):
    """Column -> GELU -> Row (sequence parallel) or Linear -> GELU -> Linear (serial); forward
    and backward run `self.layers` as tensor_checks.Serial does."""

    def __init__(self, tp=None, hidden=16):
        rng = np.random.default_rng(5)
        if tp is None:
            self.layers = [Linear(C, hidden, rng=rng, dtype=np.float64), GELU(),
                           Linear(hidden, C, rng=rng, dtype=np.float64, std=0.3)]
        else:
            self.layers = [ColumnParallelLinear(C, hidden, tp, rng=rng, dtype=np.float64,
                                                sequence_parallel=True), GELU(),
                           RowParallelLinear(hidden, C, tp, rng=rng, dtype=np.float64, std=0.3,
                                             sequence_parallel=True)]
        # non-zero biases: the column one's slice, the row one replicated
        self.layers[0].bias.data[...] = np.random.default_rng(7).standard_normal(hidden)[
            self.layers[0].weight.tp_index if tp is not None else slice(None)]
        self.layers[2].bias.data[...] = np.random.default_rng(8).standard_normal(C)


def sequence_parallel_mlp(tp, gradcheck):
    """The sequence-parallel MLP on this rank's shard against the serial MLP on the whole
    sequence; at tp = 2 a collective finite-difference check of L = sum over ranks of
    sum(w_r * y_r) in x's shard, each rank's weight slices and the replicated row bias."""
    x, w = full(40), full(41)
    serial, par = MLP(), MLP(tp)
    y, dx = serial.forward(x), serial.backward(w)
    xr = np.ascontiguousarray(shard(x, tp))
    yr = par.forward(xr)
    dxr = par.backward(np.ascontiguousarray(shard(w, tp)))
    fc, proj = par.layers[0], par.layers[2]
    out = {"y": max_rel(yr, shard(y, tp)), "dx": max_rel(dxr, shard(dx, tp)),
           "fc.weight.grad": max_rel(fc.weight.grad,
                                     serial.layers[0].weight.grad[:, fc.weight.tp_index]),
           "proj.weight.grad": max_rel(proj.weight.grad,
                                       serial.layers[2].weight.grad[proj.weight.tp_index]),
           "proj.bias.grad": max_rel(proj.bias.grad, serial.layers[2].bias.grad)}
    if not gradcheck:
        return out
    grads = {"fc.weight": fc.weight.grad.copy(), "fc.bias": fc.bias.grad.copy(),
             "proj.weight": proj.weight.grad.copy()}
    wr = np.ascontiguousarray(shard(w, tp))

    def f():  # the same on every rank
        return tp.allreduce_scalar(float((par.forward(xr) * wr).sum()))

    for name, p in (("x", xr), ("fc.weight", fc.weight.data), ("fc.bias", fc.bias.data),
                    ("proj.weight", proj.weight.data)):  # each rank its own slice and directions
        collective_directional_check(f, p, dxr if name == "x" else grads[name], tp)
    # the replicated bias: every rank perturbs its copy along the same direction; its gradient
    # is whole on every rank (from the gathered dy)
    directional_check(f, proj.bias.data, proj.bias.grad.copy(), np.random.default_rng(9),
                      n_dirs=3, name="proj.bias")
    out["gradcheck"] = ["x", "fc.weight", "fc.bias", "proj.weight", "proj.bias"]
    return out


# ---- (b, c) training -----------------------------------------------------------------------


def config(stage, dp, tp, clip, sp, **mixed):
    return {**mixed, "train_micro_batch_size_per_gpu": BATCH // dp, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}}


def trained(model, cfg, comm, data, mesh=None):
    """{initial and final parameters, losses, tensor traffic, the elements of this rank's
    sequence-parallel gradient ranges and their sum over its data-parallel group}."""
    engine = Engine(model, cfg, comm, mesh=mesh)
    out = {"init": engine.gather_parameters()}
    engine.reset_counters()
    out["losses"] = [engine.train_step(*data(step)) for step in range(STEPS)]
    out["traffic"] = engine.traffic_by_dimension()["tp"]
    engine.check_replicas()  # under tp: the replicated parameters identical on the tensor ranks
    out["elements"] = sum(s.stop - s.start for s in engine.tp_sequence)
    out["elements_all"] = int(engine.mesh.dp_comm.allreduce_scalar(out["elements"]))
    out["params"] = engine.gather_parameters()
    engine.close()
    return out


def training(comm, tp):
    alone = Comm(MPI.COMM_SELF)
    dp = comm.size // tp
    runs = {}
    for precision, (dtype, mixed, only) in PRECISIONS.items():
        for stage in (s for s in range(4) if only is None or s in only):
            clip = 0.05 if stage % 2 else 0.0  # stages 1, 3: the norm across the tensor ranks
            mesh = Mesh(comm, tp=tp)
            rows = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, dp, seed=1)
            group, data = (alone, rows.global_sample) if not mixed else (mesh.dp_comm,
                                                                         rows.sample)
            serial = trained(GPT(CFG, seed=0, dtype=dtype),
                             config(stage, group.size, 1, clip, False, **mixed), group, data)
            plain = trained(GPT(CFG, seed=0, dtype=dtype, tp=mesh.tp_comm),
                            config(stage, dp, tp, clip, False, **mixed), comm, rows.sample,
                            mesh)
            mesh = Mesh(comm, tp=tp)  # (closing an engine frees its mesh)
            sp = trained(GPT(CFG, seed=0, dtype=dtype, tp=mesh.tp_comm, sequence_parallel=True),
                         config(stage, dp, tp, clip, True, **mixed), comm, rows.sample, mesh)
            init, want, got = serial["init"], serial["params"], sp["params"]
            worst, model_move = errors(got, want, init)
            worst_tp, model_move_tp = errors(got, plain["params"], init)
            runs[f"tp{tp}_stage{stage}_{precision}"] = {
                "dp": dp, "tp": tp, "tensor_move": worst, "model_move": model_move,
                "tensor_move_vs_tp": worst_tp, "model_move_vs_tp": model_move_tp,
                "loss_diff": float(np.max(np.abs(np.subtract(sp["losses"], serial["losses"])))),
                "loss_diff_vs_tp": float(np.max(np.abs(np.subtract(sp["losses"],
                                                                   plain["losses"])))),
                "traffic": sp["traffic"], "traffic_without": plain["traffic"],
                "sequence_elements": sp["elements"], "sequence_elements_all": sp["elements_all"],
                "without_elements": plain["elements"],
                "itemsize": 8 if precision == "fp64" else 4,
                "storage_itemsize": {"fp64": 8, "fp32": 4}.get(precision, 2),
                "shapes_match": all(got[n].shape == want[n].shape for n in want)}
    return runs


# ---- (d) activation memory -----------------------------------------------------------------


def kept_for_backward(model):
    """Bytes of the arrays the model's modules keep for backward, each buffer once (by the
    array owning its memory), by where: the LayerNorms, the embedding, the rest."""
    seen, out = set(), {"layernorm": 0, "embedding": 0, "rest": 0}

    def arrays(cache):
        for item in cache if isinstance(cache, tuple) else (cache,):
            if isinstance(item, tuple):
                yield from arrays(item)
            elif isinstance(item, np.ndarray):
                while isinstance(item.base, np.ndarray):
                    item = item.base
                yield item

    embedding = model.units[0]
    for unit in model.units:
        for m in unit.modules():
            where = "layernorm" if isinstance(m, LayerNorm) else \
                "embedding" if unit is embedding else "rest"
            for a in arrays(m._cache or ()):
                if id(a) not in seen:
                    seen.add(id(a))
                    out[where] += a.nbytes
    for a in arrays(model.loss_fn._cache or ()):
        if id(a) not in seen:
            seen.add(id(a))
            out["rest"] += a.nbytes
    out["total"] = sum(out.values())
    return out


def memory(tp):
    """After one forward (fp32), with and without sequence parallelism: `kept_for_backward`,
    and what the engine's MemoryLedger counts as "activation" (the same caches, summed)."""
    idx = np.random.default_rng(3).integers(0, 13, (MEMORY_BATCH, MEMORY_CFG.seq_len))
    out = {}
    for sp in (False, True):
        model = GPT(MEMORY_CFG, seed=0, tp=tp, sequence_parallel=sp)
        ledger = MemoryLedger()
        with activations_counted_in(ledger):
            model.loss(idx, idx)
            kept = kept_for_backward(model)
            kept["ledger"] = ledger.current("activation")
            model.backward_loss()
        out["with" if sp else "without"] = kept
    return out


def generation(tp):
    """Sampled tokens with and without sequence parallelism: a 3-token prompt (padded to a
    multiple of tp), 7 new tokens, so the window reaches seq_len and slides."""
    prompt = np.random.default_rng(4).integers(0, 13, (2, 3))
    return [GPT(CFG, seed=0, dtype=np.float64, tp=tp, sequence_parallel=sp).generate(
        prompt, 7, rng=5).tolist() for sp in (False, True)]


# ---- (e) refusals --------------------------------------------------------------------------


def refusals(comm, tp):
    out = {}
    mesh = Mesh(comm, tp=tp)
    odd = np.zeros((2, tp + 1), np.int64)  # a length tp does not divide (<= seq_len 8)
    model = GPT(CFG, tp=mesh.tp_comm, sequence_parallel=True)
    for where, call in (("loss", lambda: model.loss(odd, odd)),
                        ("check_batch", lambda: model.check_batch(odd, odd))):
        try:
            call()
            out[where] = None
        except ValueError as e:
            out[where] = str(e)
    for sp_model, sp_config in ((False, True), (True, False)):
        try:
            Engine(GPT(CFG, tp=mesh.tp_comm, sequence_parallel=sp_model),
                   config(0, comm.size // tp, tp, 0.0, sp_config), comm, mesh=mesh)
            out[f"model_{sp_model}"] = None
        except ValueError as e:
            out[f"model_{sp_model}"] = str(e)
    engine = Engine(model, config(0, comm.size // tp, tp, 0.0, True), comm, mesh=mesh)
    rows = BATCH // (comm.size // tp)
    try:
        engine.train_step(np.zeros((rows, tp + 1), np.int64), np.zeros((rows, tp + 1), np.int64))
        out["train_step"] = None
    except ValueError as e:
        out["train_step"] = str(e)
    engine.train_step(np.zeros((rows, 8), np.int64), np.zeros((rows, 8), np.int64))  # then fine
    engine.close()
    return out


def main():
    comm = Comm()
    out = {"size": comm.size, "tp": {}}
    for tp in (t for t in (2, 4) if comm.size % t == 0):
        mesh = Mesh(comm, tp=tp)
        got = {"operators": operators(mesh.tp_comm),
               "mlp": sequence_parallel_mlp(mesh.tp_comm, gradcheck=tp == 2),
               "memory": memory(mesh.tp_comm), "generated": generation(mesh.tp_comm)}
        mesh.free()
        got["runs"] = training(comm, tp)
        got["errors"] = refusals(comm, tp)
        out["tp"][str(tp)] = got
    report(out)


if __name__ == "__main__":
    main()

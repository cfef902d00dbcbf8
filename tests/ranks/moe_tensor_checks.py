"""Rank side of tests/test_moe_tensor.py: MoE blocks split over the tensor group
(zmpi.parallel.expert.tensor), in one launch per world size.

    mpiexec -n N python tests/ranks/moe_tensor_checks.py OUT_DIR

"layer": the MoE layer alone at tp = N (N = 2 only), float64, against the whole layer on the
same tokens: output, input gradient, every gradient (the slices gathered), the tensor group's
allreduces. "train": for each case of CASES whose layout fits N ranks, a GPT with MoE blocks
trained STEPS steps by the engine at (dp, ep, tp) (SEQUENCE_PARALLEL: with sequence
parallelism); rank 0 writes the gathered parameters and
reports the losses and each step's dropped assignments per layer (summed over dp) and the
"tp" traffic; the test compares them with one process. At ep 2 x tp 2 one case saves after
step RESUME_AT and is resumed at (ep 1, tp 1) on rank 0 alone and at (ep 2, tp 1) on ranks 0-1.
"""
import sys

import numpy as np
from _report import report

from zmpi.comm import MPI, Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.nn.moe import MoE
from zmpi.parallel.expert import tensor_parallel_moe

GPT_CONFIG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=8)
GLOBAL_BATCH, STEPS, RESUME_AT = 4, 4, 2
TOP1 = {"num_experts": 4, "k": 1, "capacity_factor": 0.5, "min_capacity": 0,
        "aux_loss_coef": 0.01}  # drops tokens
TOP2 = {"num_experts": 4, "k": 2, "capacity_factor": 0.5, "min_capacity": 0,
        "aux_loss_coef": 0.01, "z_loss_coef": 1e-3, "noisy_gate_policy": "RSample"}
RESIDUAL = {"num_experts": 2, "k": 2, "capacity_factor": 0.5, "min_capacity": 0,
            "use_residual": True, "num_shared_experts": 1, "moe_layer_interval": 2}
# name: (layouts (dp, ep, tp), ZeRO stage, precision, accumulation, clipping, recompute, moe)
CASES = {
    "top1_stage0": ([(1, 1, 2), (2, 1, 2), (2, 2, 2)], 0, "fp64", 2, 0.05, "none", TOP1),
    "top2_stage3": ([(1, 1, 2), (2, 1, 2), (2, 2, 2)], 3, "fp64", 2, 0.05, "full", TOP2),
    "top2_stage1": ([(2, 2, 2)], 1, "fp64", 1, 0.0, "none", TOP2),
    "residual_stage2": ([(2, 1, 2), (2, 2, 2)], 2, "fp64", 1, 0.05, "none", RESIDUAL),
    "top1_bf16": ([(2, 2, 2)], 0, "bf16", 1, 0.0, "none", TOP1),
    "top2_sequence_parallel": ([(1, 1, 2), (2, 2, 2)], 3, "fp64", 2, 0.05, "none", TOP2),
}
SEQUENCE_PARALLEL = {"top2_sequence_parallel"}  # with tensor_parallel.sequence_parallel
SAVES = ("top2_stage3", (2, 2, 2))  # saved here and resumed at (ep 1, tp 1) and (ep 2, tp 1)


def config(stage, precision, accumulation, clip, recompute, moe, dp, tp, sp=False):
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
           "gradient_accumulation_steps": accumulation, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
           "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp}, "moe": moe,
           "activation_checkpointing": {"recompute": recompute}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(comm, case, dp, ep, tp):
    """(engine, data) of `case` at (dp, ep, tp) on `comm` (dp x tp ranks)."""
    from zmpi.parallel.mesh import Mesh

    _, stage, precision, accumulation, clip, recompute, section = CASES[case]
    moe = {**section, "ep_size": ep}
    mesh = Mesh(comm, tp=tp, ep=ep)
    dtype = np.float64 if precision == "fp64" else np.float32
    sp = case in SEQUENCE_PARALLEL and tp > 1
    model = GPT(GPT_CONFIG, seed=0, dtype=dtype, tp=mesh.tp_comm, sequence_parallel=sp, moe=moe)
    engine = Engine(model, config(stage, precision, accumulation, clip, recompute, moe, dp, tp,
                                  sp), comm, mesh=mesh)
    data = SyntheticSource(GPT_CONFIG.vocab_size, GPT_CONFIG.seq_len,
                           GLOBAL_BATCH * accumulation, mesh.dp_rank, dp, seed=1)
    return engine, data


def dropped_recorder(engine):
    """Wrap engine.moe.losses (once per micro-batch forward) to count each layer's dropped
    assignments; returns the list of per-forward [dropped per layer]."""
    seen, losses = [], engine.moe.losses

    def recording():
        seen.append([int((~layer.routing.kept).sum()) for layer in engine.moe.layers])
        return losses()

    engine.moe.losses = recording
    return seen


def train(comm, out_dir, case, layout, steps=range(STEPS), engine=None, data=None):
    """Train `case` at `layout`; (engine, report of this rank)."""
    dp, ep, tp = layout
    if engine is None:
        engine, data = build(comm, case, dp, ep, tp)
    seen = dropped_recorder(engine)
    losses, dropped = [], []
    for step in steps:
        losses.append(engine.train_step(*data.sample(step)))
        mine = np.sum(seen, axis=0).tolist() if engine.mesh.tp_rank == 0 else None
        dropped.append(np.sum([d for d in comm.allgather_object(mine) if d is not None],
                              axis=0).tolist())  # over the data ranks (one per tensor group)
        seen.clear()
        if (case, layout) == SAVES and step + 1 == RESUME_AT:
            engine.save_checkpoint(f"{out_dir}/{case}", tag="saved")
    return engine, {"losses": losses, "dropped": dropped}


def run_case(comm, out_dir, case, layout):
    engine, got = train(comm, out_dir, case, layout)
    got["tp"] = {op: c["bytes"] for op, c in engine.traffic_by_dimension()["tp"].items()}
    # this rank's parameters, and its expert strategy's (every ep rank's, at ep above 1)
    got["num_params"] = [engine.num_params, engine.experts.num_params if engine.experts else 0]
    params = engine.gather_parameters()
    if comm.rank == 0:
        np.savez(f"{out_dir}/{case}__{'_'.join(map(str, layout))}.npz", **params)
    engine.close()
    return got


def resume(comm, out_dir, case, layout):
    """Losses of steps RESUME_AT.. resumed from SAVES's checkpoint at `layout` on its first
    dp x tp ranks (None on the others); rank 0 writes the parameters loaded
    (OUT_DIR/loaded_<layout>.npz)."""
    dp, ep, tp = layout
    part = comm.split(0 if comm.rank < dp * tp else 1)
    out = None
    if comm.rank < dp * tp:
        group = part if part.size > 1 else Comm(MPI.COMM_SELF)
        engine, data = build(group, case, dp, ep, tp)
        engine.load_checkpoint(f"{out_dir}/{case}", tag="saved")
        loaded = engine.gather_parameters()
        if comm.rank == 0:
            np.savez(f"{out_dir}/loaded_{'_'.join(map(str, layout))}.npz", **loaded)
        engine, got = train(group, out_dir, case, layout, range(RESUME_AT, STEPS), engine, data)
        engine.close()
        out = got["losses"]
    part.free()
    return out


def layer_check(comm):
    """The MoE layer alone at tp = comm.size, float64, against the whole layer (module doc)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8, 6))  # the same tokens on every tensor rank
    dy = rng.standard_normal((2, 8, 6))
    out = {}
    for name, opts in {"top1": {"k": 1}, "top2_residual_shared": {
            "k": 2, "use_residual": True, "num_shared_experts": 1}}.items():
        layers = [MoE(6, 4, hidden=10, min_capacity=0, capacity_factor=0.75, seed=1, rng=2,
                      dtype=np.float64, z_loss_coef=0.01, **opts) for _ in range(2)]
        whole, split = layers[0], tensor_parallel_moe(layers[1], comm)
        for layer in layers:
            layer.set_routing((0,), 0)
            layer.aux_loss_scale = 0.5
        counter = comm.counters["allreduce"]
        calls, nbytes = counter.calls, counter.bytes
        y, yw = split.forward(x), whole.forward(x)
        dx, dxw = split.backward(dy), whole.backward(dy)
        calls, nbytes = counter.calls - calls, counter.bytes - nbytes
        errors = {"y": float(np.abs(y - yw).max()), "dx": float(np.abs(dx - dxw).max()),
                  "aux": float(abs(split.aux_loss - whole.aux_loss))}
        mine = dict(split.named_parameters())
        for pname, p in whole.named_parameters():
            q = mine[pname]
            axis = getattr(q, "tp_split", None)
            g = q.grad if axis is None else np.concatenate(comm.allgather_object(q.grad),
                                                            axis=axis)
            errors[pname] = float(np.abs(g - p.grad).max())
        parts = 1 + ("use_residual" in opts) + ("num_shared_experts" in opts)
        rows = int(split.routing.kept.sum()) + (parts - 1) * x[..., 0].size  # each part's
        out[name] = {"errors": errors, "allreduces": calls, "bytes": nbytes, "parts": parts,
                     "rows": rows,
                     "dropped": int((~split.routing.kept).sum()),
                     "same_routing": bool(np.array_equal(split.routing.kept, whole.routing.kept))}
    return out


def main():
    out_dir = sys.argv[1]
    comm = Comm()
    result = {"rank": comm.rank, "train": {}, "resumed": {}}
    if comm.size == 2:
        result["layer"] = layer_check(comm)
    for case, (layouts, *_rest) in CASES.items():
        for layout in layouts:
            if layout[0] * layout[2] == comm.size:
                result["train"][f"{case} {layout}"] = run_case(comm, out_dir, case, layout)
    if comm.size == 4:
        for layout in ((1, 1, 1), (2, 2, 1)):
            result["resumed"][str(layout)] = resume(comm, out_dir, *SAVES[:1], layout)
    report(result)


if __name__ == "__main__":
    main()

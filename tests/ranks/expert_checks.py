"""Rank side of tests/test_expert_parallel.py: the MoE layer made expert parallel
(zmpi.parallel.expert) against one process running the whole batch with the plain layer.

    mpiexec -n 2 python tests/ranks/expert_checks.py   # ep 1 and 2
    mpiexec -n 4 python tests/ranks/expert_checks.py   # ep 1, 2 (two groups: dp 2 x ep 2), 4

Every rank holds SEQ sequences of the batch (data parallel over the world; ep carves it) and
builds the same float64 reference in full. For each ep dividing the world and each routing
variant it reports, gathered from every rank: the largest relative error of the output, the
input gradient and every parameter's gradient (the experts' put together from their ep slices
and summed over the expert-data-parallel ranks, the dense ones summed over all ranks, as data
parallelism would) and of the auxiliary and z losses; whether every layout kept and chose
exactly the reference's (token, choice) assignments; the expert-parallel Comm's traffic
forward and backward. Then the layouts that cannot be built, one error each, alike on every
rank.
"""
import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.nn.moe import MoE
from zmpi.parallel.expert import expert_groups, expert_parallel

C, E, H, S, SEQ = 6, 8, 5, 8, 2  # d_model, experts, hidden, tokens a sequence, sequences a rank
KEY = (5, 1)  # the routing key: (step, micro-batch)
VARIANTS = {  # MoE options beyond the common ones (`build`)
    "top1": {"k": 1, "use_rts": False},
    "top1_residual_jitter": {"k": 1, "capacity_factor": 1.5, "use_residual": True,
                             "noisy_gate_policy": "Jitter"},
    "top2_rts_sampling_zloss": {"k": 2, "z_loss_coef": 0.1},  # RTS, 2nd-expert sampling: on
    "top2_shared_rsample": {"k": 2, "capacity_factor": 1.25, "num_shared_experts": 1,
                            "noisy_gate_policy": "RSample"},
    "top1_dropless": {"k": 1, "drop_tokens": False},
    "top2_dropless_residual_shared": {"k": 2, "drop_tokens": False, "use_residual": True,
                                      "num_shared_experts": 2},
}


def build(options):
    """The float64 layer every rank and layout builds alike (its parameters drawn again, biases
    included, so that none is trivial)."""
    moe = MoE(C, E, hidden=H, rng=1, dtype=np.float64, std=0.5, seed=11, min_capacity=0,
              aux_loss_coef=0.05, **options)
    rng = np.random.default_rng(3)
    for p in moe.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    return moe


def relative(got, want):
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check(world, ep, options):
    """One layout and variant: what this rank reports about it."""
    n, rank = world.size, world.rank
    rng = np.random.default_rng(7)
    X, DY = rng.standard_normal((2, n * SEQ, S, C))
    ref = build(options)
    ref.set_routing(KEY, 0)
    Y = ref.forward(X)
    DX = ref.backward(DY)

    groups = expert_groups(world, ep, [E])
    moe = expert_parallel(build(options), groups)
    mine = slice(rank * SEQ, (rank + 1) * SEQ)
    moe.set_routing(KEY, rank * SEQ)  # a group is a sequence: this rank's first group's index
    moe.aux_loss_scale = 1.0 / n  # the losses are means over the groups: each rank's share
    counters = groups.ep_comm
    counters.reset_counters()
    y = moe.forward(X[mine])
    forward = counters.counters_snapshot()
    counters.reset_counters()
    dx = moe.backward(DY[mine])
    backward = counters.counters_snapshot()
    local = {name: p for name, p in moe.named_parameters()}
    r = moe.routing
    everyone = world.allgather_object({
        "y": y, "dx": dx, "kept": r.kept, "experts": r.experts, "capacity": r.capacity,
        "aux": float(moe.aux_loss), "z": float(moe.z_loss),
        "grads": {name: p.grad for name, p in local.items()},
        "index": {name: p.ep_index for name, p in local.items() if hasattr(p, "ep_index")}})

    errors = {"y": relative(np.concatenate([m["y"] for m in everyone]), Y),
              "dx": relative(np.concatenate([m["dx"] for m in everyone]), DX),
              "aux": relative(np.array(sum(m["aux"] for m in everyone) / n), ref.aux_loss),
              "z": relative(np.array(sum(m["z"] for m in everyone) / n), ref.z_loss)
              if options.get("z_loss_coef") else 0.0}
    for name, p in ref.named_parameters():
        whole = np.zeros(p.shape)
        for m in everyone:
            if name in m["index"]:  # an expert slice: its place among the experts
                whole[m["index"][name]] += m["grads"][name]
            else:
                whole += m["grads"][name]
        errors[name] = relative(whole, p.grad)
    kept = np.concatenate([m["kept"] for m in everyone])
    chosen = np.concatenate([m["experts"] for m in everyone])
    return {"errors": errors,
            "same_routing": bool((kept == ref.routing.kept.reshape(kept.shape)).all()
                                 and (chosen == ref.routing.experts).all()),
            "dropped": int((~ref.routing.kept).sum()),
            "capacities": [m["capacity"] for m in everyone],
            "local_shapes": {name: list(p.shape) for name, p in local.items()},
            "ep_index": {name: p.ep_index.tolist() for name, p in local.items()
                         if hasattr(p, "ep_index")},
            "groups": {"ep": groups.ep, "ep_rank": groups.ep_rank, "edp": groups.edp,
                       "edp_rank": groups.edp_rank},
            "forward": forward, "backward": backward}


def bad_layouts(world):
    """The message of each layout that cannot be built (or None if it was built)."""
    said = {}
    for name, ep, experts in (("ep_not_dividing_dp", 3, [E]), ("ep_above_dp", 2 * world.size, []),
                              ("experts_not_divisible", world.size, [E, world.size + 1]),
                              ("ep_zero", 0, []), ("ep_float", 2.0, [])):
        try:
            expert_groups(world, ep, experts).free()
            said[name] = None
        except ValueError as e:
            said[name] = str(e)
    return said


def main():
    world = Comm()
    results = {}
    for ep in (1, 2, 4):
        if world.size % ep == 0:
            results[ep] = {name: check(world, ep, options) for name, options in VARIANTS.items()}
    report({"size": world.size, "results": results, "bad_layouts": bad_layouts(world)})


if __name__ == "__main__":
    main()

"""`zmpi estimate`: model-state memory and traffic per rank from the ZeRO formulas
(zmpi.memory.estimate_rows), for a parameter count or a GPT shape; with --tp, over the
data-parallel ranks of each tensor rank's share, plus Megatron's tensor-parallel traffic (with
--sequence-parallel, Korthikanti et al.'s reduce-scatters and allgathers)."""
from __future__ import annotations

import json

from zmpi.memory import estimate_rows
from zmpi.models.gpt import gpt_num_params


def estimate(args) -> None:
    """Print the ZeRO paper's per-rank model-state memory and traffic for each stage (or
    --stage); with offload flags, device and host memory (ZeRO-Offload); --json for a
    machine-readable answer."""
    if (args.params is None) == (args.n_layer is None):
        raise SystemExit("zmpi estimate: give --params, or a GPT shape (--n-layer, --d-model, "
                         "--vocab-size, --seq-len)")
    tp = args.tp
    if tp < 1 or args.world_size % tp:
        raise SystemExit(f"zmpi estimate: --tp {tp} does not divide --world-size "
                         f"{args.world_size} into data-parallel replicas")
    if args.micro_batch is not None and (args.n_layer is None or args.micro_batch < 1):
        raise SystemExit("zmpi estimate: --micro-batch needs a GPT shape and is >= 1")
    psi = args.params / tp if args.params is not None else gpt_num_params(
        args.n_layer, args.d_model, args.vocab_size, args.seq_len, tp)
    dp = args.world_size // tp
    pb = args.param_bytes or (4 if args.precision == "fp32" else 2)
    k = args.optimizer_bytes or 12
    stages = range(4) if args.stage is None else [args.stage]
    rows = estimate_rows(psi, dp, stages, pb, k, args.offload_optimizer, args.offload_param)
    if args.sequence_parallel and (tp == 1 or args.micro_batch is None):
        raise SystemExit("zmpi estimate: --sequence-parallel needs --tp above 1 and "
                         "--micro-batch")
    tensor = tensor_traffic(args) if tp > 1 and args.micro_batch else None
    ops = tensor_ops(args) if tensor is not None else None
    if args.json:
        print(json.dumps({"params": psi, "world_size": args.world_size, "tp": tp, "dp": dp,
                          "param_bytes": pb, "optimizer_bytes": k,
                          "offload_optimizer": args.offload_optimizer,
                          "offload_param": args.offload_param, "stages": rows,
                          "tensor_traffic_elements": tensor, "tensor_traffic_ops": ops},
                         indent=2))
        return
    offload = args.offload_optimizer or args.offload_param
    print(f"Psi = {psi:.4g} parameters" + (f" per tensor rank (tp = {tp})" if tp > 1 else "")
          + f", N = {dp} {'data-parallel ' if tp > 1 else ''}ranks, {pb}-byte params and "
          f"grads, K = {k}" + (f"; offload: optimizer {'on' if args.offload_optimizer else 'off'}"
                               f", params {'on' if args.offload_param else 'off'}"
                               if offload else ""))
    if tensor is not None and not args.sequence_parallel:
        print(f"tensor-parallel traffic per step and micro-batch: {tensor:.4g} elements "
              f"allreduced ((4 L + 2) B T C + 3 B T), each rank sending 2 (T-1)/T of them")
    elif tensor is not None:
        print(f"tensor-parallel traffic per step and micro-batch, sequence parallel: "
              f"{ops['reduce_scatter']:.4g} elements reduce-scattered and as many allgathered "
              f"((4 L + 2) B T C each, every rank sending (T-1)/T of them), "
              f"{ops['allreduce']:.4g} allreduced (3 B T, the cross-entropy)")
    if not offload:
        print(f"{'stage':>5} {'GB per rank':>12} {'traffic per step (elements)':>28}")
        for r in rows:
            print(f"{r['stage']:>5} {r['device_gb']:>12.1f} {r['traffic_elements']:>28.3g}")
        return
    print(f"{'stage':>5} {'device GB':>10} {'host GB':>9} {'traffic per step (elements)':>28}")
    for r in rows:
        if "error" in r:
            print(f"{r['stage']:>5} {'-':>10} {'-':>9} {'':>28}  ({r['error']})")
        else:
            print(f"{r['stage']:>5} {r['device_gb']:>10.1f} {r['host_gb']:>9.1f} "
                  f"{r['traffic_elements']:>28.3g}")


def tensor_traffic(args) -> int:
    """Elements allreduced over the tensor-parallel group per micro-step (forward and backward)
    by zmpi's GPT: 4 of B T C per block (f and g of attention and MLP), 1 each for the
    vocabulary-parallel embedding and the LM head's input gradient, and 3 of B T for the
    cross-entropy (max, sum of exponentials, target logit)."""
    positions = args.micro_batch * args.seq_len
    return (4 * args.n_layer + 2) * positions * args.d_model + 3 * positions


def tensor_ops(args) -> dict[str, int]:
    """`tensor_traffic` by collective, {op: elements of the calls' buffers} as the counters
    count them: without sequence parallelism all of it allreduced; with it the blocks',
    embedding's and LM head's (4 L + 2) B T C reduce-scattered and as many allgathered (the
    same bytes sent per rank), the cross-entropy's 3 B T allreduced. (The sequence-parallel
    parameters' gradient sum, once a step, is not activations and not counted here.)"""
    positions = args.micro_batch * args.seq_len
    blocks = (4 * args.n_layer + 2) * positions * args.d_model
    if not args.sequence_parallel:
        return {"allreduce": blocks + 3 * positions}
    return {"allreduce": 3 * positions, "reduce_scatter": blocks, "allgather": blocks}

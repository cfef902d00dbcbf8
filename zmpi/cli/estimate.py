"""`zmpi estimate`: model-state memory and traffic per rank from the ZeRO formulas
(zmpi.memory.estimate_rows), for a parameter count or a GPT shape."""
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
    psi = args.params if args.params is not None else gpt_num_params(
        args.n_layer, args.d_model, args.vocab_size, args.seq_len)
    pb = args.param_bytes or (4 if args.precision == "fp32" else 2)
    k = args.optimizer_bytes or 12
    stages = range(4) if args.stage is None else [args.stage]
    rows = estimate_rows(psi, args.world_size, stages, pb, k, args.offload_optimizer,
                         args.offload_param)
    if args.json:
        print(json.dumps({"params": psi, "world_size": args.world_size, "param_bytes": pb,
                          "optimizer_bytes": k, "offload_optimizer": args.offload_optimizer,
                          "offload_param": args.offload_param, "stages": rows}, indent=2))
        return
    offload = args.offload_optimizer or args.offload_param
    print(f"Psi = {psi:.4g} parameters, N = {args.world_size} ranks, {pb}-byte params and "
          f"grads, K = {k}" + (f"; offload: optimizer {'on' if args.offload_optimizer else 'off'}"
                               f", params {'on' if args.offload_param else 'off'}"
                               if offload else ""))
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

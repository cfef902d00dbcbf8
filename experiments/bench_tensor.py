"""Tensor parallelism against data parallelism on the same ranks: every (dp, tp) layout, and
sequence parallelism at each tp > 1.

    mpiexec -n 4 python experiments/bench_tensor.py --out results/tensor_n4   # make bench-tensor

Trains one GPT (Tiny Shakespeare, fp32, ZeRO stage 1 over the data-parallel group, the same
global batch and seed) under every layout dp x tp of the world (4 ranks: (4,1), (2,2), (1,4)),
each tp > 1 also with sequence parallelism (Korthikanti et al.: the same bytes sent, as
reduce-scatters and allgathers; LayerNorm activations 1/tp). Reports per layout the median
step time and tokens/s, the bytes each rank sent per step in
each mesh dimension (the counters, `engine.traffic_by_dimension()`), next to the formulas
(data parallel: ZeRO's 2 Psi_r (dp-1)/dp for stage 1 over each rank's share Psi_r; tensor
parallel: Megatron's 2 (tp-1)/tp allreduce volume of (4 L + 2) B T C + 3 B T elements), each
rank's parameters, model-state bytes and activation peak (the ledger), and the loss after the
last step (the
same model, so the same loss up to rounding). On this machine the ranks share 2 cores: the
timings compare layouts, not hardware; the traffic and memory are exact.
"""
import argparse
import statistics
import sys
import time

from results import write_results
from zmpi.cli.estimate import tensor_traffic
from zmpi.comm import Comm
from zmpi.data import BatchSampler, CharTokenizer, load_text, train_val_split
from zmpi.engine import Engine
from zmpi.memory import ARRAY_OPS
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_num_params
from zmpi.parallel.mesh import Mesh

MIB = 2**20


def layouts(n):
    return [(n // tp, tp) for tp in range(1, n + 1) if n % tp == 0]


def sent(counts) -> int:
    return sum(c["sent"] for op, c in counts.items() if op in ARRAY_OPS)


def run(comm, dp, tp, sp, args, tokens, vocab_size):
    mesh = Mesh(comm, tp=tp)
    cfg = GPTConfig(vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    config = {"train_micro_batch_size_per_gpu": args.batch // dp, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
              "zero_optimization": {"stage": 1}}
    engine = Engine(GPT(cfg, seed=0, tp=mesh.tp_comm, sequence_parallel=sp), config, comm,
                    mesh=mesh)
    data = BatchSampler(tokens, args.seq_len, args.batch, mesh.dp_rank, dp, seed=0)
    times, loss = [], None
    engine.train_step(*data.sample(0))  # warm-up: first touch of every buffer
    engine.reset_counters()
    engine.memory.reset_peaks()
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss = engine.train_step(*data.sample(step))
        times.append(time.perf_counter() - start)
    by_dim = engine.traffic_by_dimension()
    memory = engine.memory.model_state_bytes("device")
    activations = engine.memory.peak("activation")
    # sequence parallelism also sums its replicated parameters' gradients over tp, once a step
    summed = sum(r.stop - r.start for r in engine.tp_sequence)
    engine.close()
    step_s = statistics.median(times)
    positions = args.batch // dp * args.seq_len
    ns = argparse.Namespace(micro_batch=args.batch // dp, seq_len=args.seq_len,
                            n_layer=args.n_layer, d_model=args.d_model)
    return {"dp": dp, "tp": tp, "sp": sp, "params_per_rank": engine.num_params,
            "params_formula": gpt_num_params(args.n_layer, args.d_model, vocab_size,
                                             args.seq_len, tp),
            "step_ms": 1e3 * step_s, "tokens_per_s": positions * dp / step_s,
            "dp_sent_mib": sent(by_dim["dp"]) / args.steps / MIB,
            "dp_formula_mib": 2 * engine.layout.full_numel * 4 * (dp - 1) / dp / MIB,
            "tp_sent_mib": sent(by_dim["tp"]) / args.steps / MIB,
            "tp_formula_mib": 2 * (tp - 1) / tp * (tensor_traffic(ns) + summed) * 4 / MIB,
            "model_state_mib": memory / MIB, "activation_peak_mib": activations / MIB,
            "loss": loss}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="results/tensor")
    args = parser.parse_args()
    comm = Comm()
    text = load_text()
    tok = CharTokenizer(text)
    tokens, _ = train_val_split(tok.encode(text))
    rows = []
    for dp, tp in layouts(comm.size):
        if args.n_head % tp or args.batch % dp:
            continue
        for sp in (False, True) if tp > 1 and args.seq_len % tp == 0 else (False,):
            rows.append(run(comm, dp, tp, sp, args, tokens, tok.vocab_size))
            if comm.rank != 0:
                continue
            r = rows[-1]
            print(f"dp {dp} x tp {tp}{' sp' if sp else ''}: {r['tokens_per_s']:,.0f} tokens/s, dp "
                  f"{r['dp_sent_mib']:.2f} MiB/step, tp {r['tp_sent_mib']:.2f} MiB/step",
                  flush=True)
    if comm.rank != 0:
        return
    lines = [f"GPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, "
             f"sequence {args.seq_len}, global batch {args.batch}, fp32, ZeRO stage 1 over dp; "
             f"{comm.size} ranks on this machine; median of {args.steps} steps after a "
             "warm-up; MiB each rank sends per step (ring model, counted) next to the "
             "formula.", "",
             "| dp x tp | params per rank (formula) | model states MiB | activations MiB | "
             "step ms | tokens/s | dp MiB/step (formula) | tp MiB/step (formula) | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dp']} x {r['tp']}{' SP' if r['sp'] else ''} | "
                     f"{r['params_per_rank']:,} ({r['params_formula']:,}) | "
                     f"{r['model_state_mib']:.1f} | {r['activation_peak_mib']:.1f} | "
                     f"{r['step_ms']:.0f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['dp_sent_mib']:.2f} ({r['dp_formula_mib']:.2f}) | "
                     f"{r['tp_sent_mib']:.2f} ({r['tp_formula_mib']:.2f}) | {r['loss']:.4f} |")
    write_results(args.out, rows, lines, comm, argv=sys.argv, args=vars(args))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

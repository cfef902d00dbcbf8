"""Pipeline parallelism measured: the bubble of GPipe and 1F1B against (p - 1) / (m + p - 1),
and every (dp, pp, tp) layout of the ranks on one GPT.

    mpiexec -n 4 python experiments/bench_pipeline.py --out results/pipeline_n4  # bench-pipeline

Bubble: a model of 2 units per stage that sleep (forward F ms, backward 2F ms per micro-batch:
compute that does not share the cores), cut into p = world-size stages and trained with each
schedule for m = 4, 8, 16 micro-batches. Each stage's runner records when its ops ran; the idle
fraction of a step is 1 - (busy time of all stages) / (p x the step's span), the median over
the steps. A timeline of the measured ops (p stages, m = 8) is drawn for each schedule.

Layouts: one GPT (Tiny Shakespeare, fp32, ZeRO stage 1 over dp, the same global batch, 4
micro-batches, the same seed) under every dp x pp x tp of the world: median step time,
tokens/s, the bytes each rank sent per step in each mesh dimension, the largest model-state
and activation peak of any rank (the ledger), and the loss (the same model: equal up to
rounding). On this machine the ranks share 2 cores: the timings compare layouts, not hardware.
"""
import argparse
import statistics
import sys
import time

import numpy as np

from results import write_results
from zmpi.comm import Comm
from zmpi.data import BatchSampler, CharTokenizer, load_text, train_val_split
from zmpi.engine import Engine
from zmpi.memory import ARRAY_OPS
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.nn import Module, Parameter, UnitModel, accumulate_grad_
from zmpi.nn.losses import MSELoss
from zmpi.parallel.mesh import Mesh
from zmpi.parallel.pipeline.schedule import SCHEDULES, bubble_formula

MIB = 2**20


class SleepUnit(Module):
    """y = w x, taking `seconds` in forward and twice that in backward (asleep: the ranks do
    not compete for the cores)."""

    def __init__(self, seconds):
        self.w = Parameter(np.ones(1, np.float32))
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        self._save(x)
        return x * self.w.data

    def backward(self, dy):
        x = self._pop()
        time.sleep(2 * self.seconds)
        accumulate_grad_(self.w, np.array([(dy * x).sum()], np.float32))
        return dy * self.w.data


def measure_bubble(comm, schedule, m, unit_s, steps):
    """(median idle fraction, the last step's spans per stage, relative to its start)."""
    model = UnitModel([SleepUnit(unit_s) for _ in range(2 * comm.size)], loss=MSELoss())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
              "pipeline": {"stages": comm.size, "schedule": schedule, "partition": "uniform"},
              "zero_optimization": {"stage": 0}}
    engine = Engine(model, config, comm)
    x = np.ones((m, 4), np.float32)
    bubbles, spans = [], None
    for _ in range(steps):
        engine.train_step(x, np.zeros_like(x))
        spans = comm.allgather_object(engine.pipeline.runner.spans)
        start = min(s[2] for ops in spans for s in ops)
        span = max(s[3] for ops in spans for s in ops) - start
        busy = sum(s[3] - s[2] for ops in spans for s in ops)
        bubbles.append(1 - busy / (len(spans) * span))
        spans = [[(op, i, a - start, b - start) for op, i, a, b in ops] for ops in spans]
    engine.close()
    return statistics.median(bubbles), spans


def layouts(n):
    return [(n // (pp * tp), pp, tp) for pp in range(1, n + 1) for tp in range(1, n + 1)
            if n % (pp * tp) == 0]


def sent(counts) -> int:
    return sum(c["sent"] for op, c in counts.items() if op in ARRAY_OPS + ("send",))


def run_layout(comm, dp, pp, tp, args, tokens, vocab_size):
    mesh = Mesh(comm, tp=tp, pp=pp)
    cfg = GPTConfig(vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    micro = args.batch // (dp * args.micro_batches)
    config = {"train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": args.micro_batches, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "tensor_parallel": {"autotp_size": tp}, "pipeline": {"stages": pp},
              "zero_optimization": {"stage": 1}}
    engine = Engine(GPT(cfg, seed=0, tp=mesh.tp_comm), config, comm, mesh=mesh)
    data = BatchSampler(tokens, args.seq_len, args.batch, mesh.dp_rank, dp, seed=0)
    engine.train_step(*data.sample(0))  # warm-up: first touch of every buffer
    engine.reset_counters()
    engine.memory.reset_peaks()
    times, loss = [], None
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss = engine.train_step(*data.sample(step))
        times.append(time.perf_counter() - start)
    by_dim = engine.traffic_by_dimension()
    states = comm.allreduce_scalar(engine.memory.model_state_bytes("device"), "max")
    activations = comm.allreduce_scalar(engine.memory.peak("activation"), "max")
    per_dim = {d: comm.allreduce_scalar(sent(by_dim[d]) / args.steps, "max") for d in by_dim}
    engine.close()
    step_s = statistics.median(times)
    return {"dp": dp, "pp": pp, "tp": tp, "step_ms": 1e3 * step_s,
            "tokens_per_s": args.batch * args.seq_len / step_s,
            **{f"{d}_sent_mib": per_dim[d] / MIB for d in ("dp", "pp", "tp")},
            "model_state_mib": states / MIB, "activation_peak_mib": activations / MIB,
            "loss": loss}


def draw_timelines(path, timelines, m):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(7.5, 1.2 + 1.0 * len(timelines[0][1])),
                             sharex=True)
    for ax, (schedule, spans) in zip(axes, timelines, strict=True):
        for s, ops in enumerate(spans):
            for op, i, a, b in ops:
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (s - 0.4, 0.8),
                               color="C0" if op == "F" else "C1", edgecolor="white")
                ax.text((a + b) / 2 * 1e3, s, str(i), ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_yticks(range(len(spans)), [f"stage {s}" for s in range(len(spans))])
        ax.invert_yaxis()
        ax.set_title(f"{schedule}: p = {len(spans)}, m = {m} (measured; forward blue, "
                     "backward orange)", fontsize=9)
    axes[-1].set_xlabel("ms since the step began")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unit-ms", type=float, default=10.0,
                        help="forward time of a sleeping unit (backward: twice it)")
    parser.add_argument("--bubble-steps", type=int, default=3)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="results/pipeline")
    parser.add_argument("--figures", default="results/figures")
    args = parser.parse_args()
    comm = Comm()
    p = comm.size
    bubble_rows, timelines = [], []
    for schedule in SCHEDULES:
        for m in (4, 8, 16):
            measured, spans = measure_bubble(comm, schedule, m, args.unit_ms / 1e3,
                                             args.bubble_steps)
            bubble_rows.append({"schedule": schedule, "p": p, "m": m, "measured": measured,
                                "formula": bubble_formula(p, m)})
            if m == 8:
                timelines.append((schedule, spans))
            if comm.rank == 0:
                print(f"{schedule} p {p} m {m}: bubble {measured:.3f} (formula "
                      f"{bubble_formula(p, m):.3f})", flush=True)

    text = load_text()
    tok = CharTokenizer(text)
    tokens, _ = train_val_split(tok.encode(text))
    rows = []
    for dp, pp, tp in layouts(p):
        if args.n_head % tp or args.batch % (dp * args.micro_batches) or \
                pp > args.n_layer + 2:
            continue
        rows.append(run_layout(comm, dp, pp, tp, args, tokens, tok.vocab_size))
        if comm.rank == 0:
            r = rows[-1]
            print(f"dp {dp} x pp {pp} x tp {tp}: {r['tokens_per_s']:,.0f} tokens/s", flush=True)
    if comm.rank != 0:
        return
    from pathlib import Path

    figures = Path(args.figures)
    draw_timelines(figures / "pipeline_timeline.png", timelines, 8)
    bubble_md = [f"Sleeping units: forward {args.unit_ms:g} ms, backward {2 * args.unit_ms:g} ms "
                 f"per stage and micro-batch; p = {p} stages; median of {args.bubble_steps} "
                 "steps.", "", "| schedule | m | measured bubble | (p - 1) / (m + p - 1) | "
                 "measured / formula |", "|---|---|---|---|---|"]
    for r in bubble_rows:
        bubble_md.append(f"| {r['schedule']} | {r['m']} | {r['measured']:.3f} | "
                         f"{r['formula']:.3f} | {r['measured'] / r['formula']:.2f} |")
    write_results(args.out, bubble_rows, bubble_md, comm, name="bubble", argv=sys.argv,
                  args=vars(args))
    lines = [f"GPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, "
             f"sequence {args.seq_len}, global batch {args.batch} in {args.micro_batches} "
             f"micro-batches, fp32, ZeRO stage 1 over dp, 1F1B; {p} ranks on this machine; "
             f"median of {args.steps} steps after a warm-up; MiB the busiest rank sends per "
             "step in each dimension (counted), the largest model states and activation peak "
             "of any rank (the ledger).", "",
             "| dp x pp x tp | step ms | tokens/s | dp MiB/step | pp MiB/step | tp MiB/step | "
             "model states MiB | activations MiB | loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dp']} x {r['pp']} x {r['tp']} | {r['step_ms']:.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['dp_sent_mib']:.2f} | "
                     f"{r['pp_sent_mib']:.2f} | {r['tp_sent_mib']:.2f} | "
                     f"{r['model_state_mib']:.1f} | {r['activation_peak_mib']:.1f} | "
                     f"{r['loss']:.4f} |")
    write_results(args.out, rows, lines, comm, argv=sys.argv, args=vars(args))
    print("\n".join(bubble_md + [""] + lines))


if __name__ == "__main__":
    main()

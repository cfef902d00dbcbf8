"""Activation recompute measured: what each option costs in step time, what it saves in
activations, and the longest sequence (and largest micro batch) it lets one training step fit
into a device-memory budget.

    python experiments/bench_recompute.py --out results/recompute_n1   # make bench-recompute
    mpiexec -n 2 python experiments/bench_recompute.py --out results/recompute_n2

Cost: one GPT (Tiny Shakespeare, fp32, ZeRO stage 1 over the ranks, the same seed and batches)
trained under each option (`activation_checkpointing.recompute` none | selective | full, and any
further option in OPTIONS or --options) with the options' steps interleaved, each round in a
rotated order, so that machine noise hits all alike; warm-up steps excluded, median step time.
Per option: the step time and its overhead over "none" (of the medians, and paired: the
median over rounds of each step against the same round's step of "none"), the time spent
recomputing (measured directly: the units' forwards run again in backward, the attention
probabilities recomputed in backward), the device activation peak per rank (the ledger,
`engine.memory.peak("activation", "device")`; host bytes beside it) and its saving, and the
largest difference of the final parameters from "none" (recompute's contract: the same
gradients, bit for bit, so 0.0) and whether every loss was the same.

Longest sequence: for each option, the largest sequence length T (a multiple of
--granularity: doubling, then bisection) for which a narrow GPT trains one step within
--budget-mib of device memory per rank (`memory_budget.device`: every buffer the ledger counts,
model states, communication buffers and activations), and the largest micro batch at a fixed
T. Data parallel over all ranks at ZeRO stage 0, so every rank holds the same bytes and meets
the budget at the same allocation.

An option the config refuses (a key this zmpi does not build) is reported as not available and
skipped, so the list can name options before they exist. On this machine the timings compare
options on 2 shared cores, not hardware; the memory is exact.
"""
import argparse
import functools
import json
import statistics
import sys
import time

import numpy as np

from results import write_results
from zmpi.comm import Comm
from zmpi.config import Config
from zmpi.data import BatchSampler, CharTokenizer, SyntheticSource, load_text, train_val_split
from zmpi.engine import Engine
from zmpi.memory import OutOfMemory
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

MIB = 2**20

# Each option: a name, the config fragment it adds (merged into the benchmark's config), and
# optionally the least tensor / pipeline degree it needs ("needs": {"tp": 2}). The first is the
# baseline every other is compared with. A value "recomputed_units" stands for the number of
# units full recompute keeps an input for (the GPT's n_layer + 1: every unit but the LM head).
# Options this zmpi's config refuses are skipped with a line, so the list may name options
# before they are built.
OPTIONS = [
    {"name": "none", "config": {"activation_checkpointing": {"recompute": "none"}}},
    {"name": "selective", "config": {"activation_checkpointing": {"recompute": "selective"}}},
    {"name": "full", "config": {"activation_checkpointing": {"recompute": "full"}}},
    # DeepSpeed's keys on the inputs full recompute keeps, and recompute in groups of units
    {"name": "full, cpu_checkpointing",
     "config": {"activation_checkpointing": {"recompute": "full", "cpu_checkpointing": True}}},
    {"name": "full, contiguous_memory_optimization",
     "config": {"activation_checkpointing": {"recompute": "full",
                                             "contiguous_memory_optimization": True,
                                             "number_checkpoints": "recomputed_units"}}},
    {"name": "full, partition_activations", "needs": {"tp": 2},
     "config": {"activation_checkpointing": {"recompute": "full",
                                             "partition_activations": True}}},
    {"name": "activation_checkpoint_interval 2",
     "config": {"pipeline": {"activation_checkpoint_interval": 2}}},
]


def merged(base: dict, fragment: dict) -> dict:
    """`base` with `fragment`'s keys put in, sections merged key by key."""
    out = dict(base)
    for k, v in fragment.items():
        out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def resolved(fragment: dict, n_layer: int) -> dict:
    """The fragment with the placeholder "recomputed_units" replaced by n_layer + 1."""
    return {k: resolved(v, n_layer) if isinstance(v, dict)
            else (n_layer + 1 if v == "recomputed_units" else v) for k, v in fragment.items()}


def refusal(config: dict) -> str | None:
    """Why this zmpi's config refuses `config` (None: accepted). Every rank decides alike."""
    try:
        Config.from_dict(config)
    except ValueError as e:  # ConfigError
        return str(e)
    return None


class RecomputeClock:
    """Seconds spent recomputing, measured around the work itself: a unit's forward run outside
    the model's forward (full recompute runs it again in backward), and the attention
    probabilities computed inside attention_backward (selective recompute). Timings only: the
    arrays and the order of operations are untouched. `active` is the dict the running step
    adds to (None: nothing is timed)."""

    def __init__(self):
        self.active = None
        self._patch_attention()

    def _patch_attention(self):
        import zmpi.nn.attention as A

        blocks = getattr(A, "_attention_blocks", None)
        if blocks is None or getattr(blocks, "_timed", False):
            return
        clock = self

        def timed_blocks(q, k, block):
            gen = blocks(q, k, block)
            # called from attention_backward: probabilities the forward did not keep
            if clock.active is None or sys._getframe(1).f_code.co_name != "attention_backward":
                return gen
            return clock._timed(gen, clock.active)

        timed_blocks._timed = True
        A._attention_blocks = timed_blocks

    @staticmethod
    def _timed(gen, acc):
        while True:
            start = time.perf_counter()
            try:
                item = next(gen)
            except StopIteration:
                acc["attention_s"] += time.perf_counter() - start
                return
            acc["attention_s"] += time.perf_counter() - start
            yield item

    def instrument(self, model) -> dict:
        """Time `model`'s units' forwards that run outside its forward; returns the dict that
        this model's steps add to (set it as `active` around them)."""
        acc = {"units_s": 0.0, "attention_s": 0.0, "in_forward": False}
        forward = model.forward

        def model_forward(*a, **kw):
            acc["in_forward"] = True
            try:
                return forward(*a, **kw)
            finally:
                acc["in_forward"] = False

        model.forward = model_forward
        for unit in model.units:
            unit.forward = self._unit_forward(unit.forward, acc)
        return acc

    @staticmethod
    def _unit_forward(forward, acc):
        def timed(*a, **kw):
            if acc["in_forward"]:
                return forward(*a, **kw)
            start = time.perf_counter()
            try:
                return forward(*a, **kw)
            finally:
                acc["units_s"] += time.perf_counter() - start
        return timed


def cost(comm, options, args, tokens, vocab_size, clock):
    """One row per option: median step time, recompute time, activation peak, parameters and
    losses against the first option's."""
    cfg = GPTConfig(vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    runs = []
    for opt in options:
        mesh = Mesh(comm, tp=args.tp, pp=args.pp)
        config = merged(base_config(args, mesh.dp), resolved(opt["config"], args.n_layer))
        engine = Engine(GPT(cfg, seed=0, tp=mesh.tp_comm), config, comm, mesh=mesh)
        acc = clock.instrument(engine.model)
        data = BatchSampler(tokens, args.seq_len, args.batch, mesh.dp_rank, mesh.dp, seed=0)
        runs.append({"opt": opt, "engine": engine, "acc": acc, "data": data, "times": [],
                     "recompute": [], "losses": []})
    rounds = args.warmup + args.steps
    for step in range(rounds):
        if step == args.warmup:
            for r in runs:
                r["engine"].memory.reset_peaks()
        shift = step % len(runs)
        for r in runs[shift:] + runs[:shift]:  # a rotated order each round
            acc = r["acc"]
            before = acc["units_s"] + acc["attention_s"]
            clock.active = acc
            comm.barrier()  # every rank starts the step together
            start = time.perf_counter()
            loss = r["engine"].train_step(*r["data"].sample(step))
            elapsed = time.perf_counter() - start
            clock.active = None
            r["losses"].append(loss)
            if step >= args.warmup:
                r["times"].append(elapsed)
                r["recompute"].append(acc["units_s"] + acc["attention_s"] - before)
    base_params = None
    rows = []
    for r in runs:
        engine = r["engine"]
        params = engine.gather_parameters()
        peak = comm.allreduce_scalar(engine.memory.peak("activation", "device"), "max")
        host = comm.allreduce_scalar(engine.memory.peak("activation", "host"), "max")
        step_s = comm.allreduce_scalar(statistics.median(r["times"]), "max")
        recompute_s = comm.allreduce_scalar(statistics.median(r["recompute"]), "max")
        engine.close()
        if base_params is None:
            base_params, base_losses, base_peak, base_step = params, r["losses"], peak, step_s
            base_times = r["times"]
        # each round's step against the baseline's step of the same round, the median of those
        # ratios: steady under load that drifts over the run (what hits a round hits both)
        paired = comm.allreduce_scalar(statistics.median(
            t / b - 1 for t, b in zip(r["times"], base_times, strict=True)), "max")
        fastest = comm.allreduce_scalar(min(r["times"]) / min(base_times) - 1, "max")
        diff = max(float(np.abs(params[n] - w).max()) for n, w in base_params.items())
        rows.append({"option": r["opt"]["name"], "step_ms": 1e3 * step_s,
                     "overhead": (step_s - base_step) / base_step, "overhead_paired": paired,
                     "overhead_fastest": fastest,  # of the fastest steps
                     "recompute_ms": 1e3 * recompute_s,
                     "recompute_share": recompute_s / step_s,
                     "activation_peak_mib": peak / MIB, "activation_host_mib": host / MIB,
                     "activation_saving": (base_peak - peak) / base_peak,
                     "max_param_diff": diff, "params_identical": diff == 0.0,
                     "losses_identical": r["losses"] == base_losses,
                     "final_loss": r["losses"][-1], "step_times_ms":
                     [1e3 * t for t in r["times"]], "config": r["opt"]["config"]})
    return rows


def base_config(args, dp: int) -> dict:
    """The cost runs' config, before an option's fragment."""
    return {"train_micro_batch_size_per_gpu": args.batch // dp, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "tensor_parallel": {"autotp_size": args.tp}, "pipeline": {"stages": args.pp},
            "zero_optimization": {"stage": args.stage}}


# ---- the longest sequence and the largest micro batch under a budget -------------------------
def trains(comm, fragment, seq_len, micro_batch, args, budget) -> bool:
    """Whether a narrow GPT of `seq_len` trains one step of `micro_batch` sequences per rank
    within `budget` bytes of device memory per rank."""
    cfg = GPTConfig(args.search_vocab, seq_len, args.search_n_layer, args.search_n_head,
                    args.search_d_model)
    config = merged({"train_micro_batch_size_per_gpu": micro_batch,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                     "zero_optimization": {"stage": 0}, "memory_budget": {"device": budget}},
                    fragment)
    data = SyntheticSource(args.search_vocab, seq_len, micro_batch * comm.size, comm.rank,
                           comm.size)
    return one_step_fits(lambda: Engine(GPT(cfg, seed=0), config, comm), data.sample(0))


def one_step_fits(build, batch) -> bool:
    """Whether the engine build() makes trains one step of `batch` (inputs, targets) within
    its memory budget (False on OutOfMemory, while it is built or while it steps); the engine
    is closed either way."""
    engine = None
    try:
        engine = build()
        engine.train_step(*batch)
        return True
    except OutOfMemory:
        return False
    finally:
        if engine is not None:
            engine.close()


def largest(fits, step: int, ceiling: int) -> tuple[int, int]:
    """(the largest multiple of `step` up to `ceiling` for which fits(x), probes made): doubling
    from `step`, then bisection. 0 if not even `step` fits; fits is taken to be monotone."""
    probes = 0
    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not
    x = step
    while x <= ceiling:
        probes += 1
        if not fits(x):
            hi = x
            break
        lo, x = x, 2 * x
    if hi is None:  # every doubling fitted: try the ceiling itself
        top = ceiling // step * step
        if top > lo:
            probes += 1
            if fits(top):
                return top, probes
            hi = top
        else:
            return lo, probes
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        probes += 1
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def longest(comm, options, args, budget):
    rows = []
    for opt in options:
        fits = functools.partial(trains, comm, resolved(opt["config"], args.search_n_layer),
                                 args=args, budget=budget)
        start = time.perf_counter()
        seq, p1 = largest(lambda t: fits(seq_len=t, micro_batch=1),  # noqa: B023 (called here)
                          args.granularity, args.max_seq_len)
        batch, p2 = largest(lambda b: fits(seq_len=args.search_seq_len, micro_batch=b),  # noqa: B023
                            1, args.max_batch)
        rows.append({"option": opt["name"], "longest_seq_len": seq,
                     "seq_at_ceiling": seq >= args.max_seq_len // args.granularity
                     * args.granularity,
                     "largest_micro_batch": batch, "batch_at_ceiling": batch >= args.max_batch,
                     "probes": p1 + p2, "seconds": time.perf_counter() - start})
        if comm.rank == 0:
            print(f"{opt['name']}: longest T {seq}, largest micro batch {batch} at T "
                  f"{args.search_seq_len} ({p1 + p2} probes, {rows[-1]['seconds']:.1f} s)",
                  flush=True)
    base = rows[0]
    for r in rows:
        for key, ratio in (("longest_seq_len", "seq_vs_none"),
                           ("largest_micro_batch", "batch_vs_none")):
            r[ratio] = r[key] / base[key] if base[key] else None  # None: none fits nothing
    return rows


def times(ratio) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def available(comm, options, args, mesh_sizes, base) -> tuple[list, list]:
    """(the options this zmpi and mesh can run, [(name, why not)] for the others)."""
    ok, skipped = [], []
    for opt in options:
        short = [f"{d} >= {n}" for d, n in opt.get("needs", {}).items()
                 if mesh_sizes.get(d, 1) < n]
        if short:
            skipped.append((opt["name"], f"needs {', '.join(short)}"))
            continue
        why = refusal(merged(base, resolved(opt["config"], args.n_layer)))
        if why is None:
            ok.append(opt)
        else:
            skipped.append((opt["name"], f"not available: {why}"))
    return ok, skipped


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="global batch (sequences)")
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage of the cost runs")
    parser.add_argument("--tp", type=int, default=1, help="tensor degree of the cost runs")
    parser.add_argument("--pp", type=int, default=1, help="pipeline degree of the cost runs")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per option")
    parser.add_argument("--budget-mib", type=float, default=128.0,
                        help="device memory per rank of the longest-sequence search")
    parser.add_argument("--search-n-layer", type=int, default=8)
    parser.add_argument("--search-d-model", type=int, default=64)
    parser.add_argument("--search-n-head", type=int, default=4)
    parser.add_argument("--search-vocab", type=int, default=64)
    parser.add_argument("--search-seq-len", type=int, default=256,
                        help="the sequence length of the micro-batch search")
    parser.add_argument("--granularity", type=int, default=64, help="of the sequence search")
    parser.add_argument("--max-seq-len", type=int, default=16384)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--no-search", action="store_true", help="the cost table only")
    parser.add_argument("--options", default=None,
                        help="JSON list (or @file) of options replacing OPTIONS: "
                             '[{"name": ..., "config": {...}, "needs": {"tp": 2}}]; the first '
                             "is the baseline")
    parser.add_argument("--out", default="results/recompute")
    args = parser.parse_args()
    comm = Comm()
    options = OPTIONS
    if args.options:
        text = open(args.options[1:]).read() if args.options.startswith("@") else args.options
        options = json.loads(text)
    text = load_text()
    tok = CharTokenizer(text)
    tokens, _ = train_val_split(tok.encode(text))

    dp = comm.size // (args.tp * args.pp)
    runnable, skipped = available(comm, options, args, {"tp": args.tp, "pp": args.pp},
                                  base_config(args, dp))
    if comm.rank == 0:
        for name, why in skipped:
            print(f"{name}: skipped ({why})", flush=True)
    clock = RecomputeClock()
    rows = cost(comm, runnable, args, tokens, tok.vocab_size, clock)
    if comm.rank == 0:
        for r in rows:
            print(f"{r['option']}: {r['step_ms']:.0f} ms/step ({100 * r['overhead']:+.1f} %), "
                  f"recompute {r['recompute_ms']:.0f} ms, activations "
                  f"{r['activation_peak_mib']:.1f} MiB ({-100 * r['activation_saving']:+.0f} %), "
                  f"max |param - none| {r['max_param_diff']:g}", flush=True)

    search_rows, search_skipped = [], []
    if not args.no_search:  # data parallel only: every rank meets the budget alike
        budget = int(args.budget_mib * MIB)
        search_base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}
        searchable, search_skipped = available(comm, options, args, {}, search_base)
        search_rows = longest(comm, searchable, args, budget)
    if comm.rank != 0:
        return

    meta = {"argv": sys.argv, "args": vars(args), "skipped": skipped,
            "search_skipped": search_skipped}
    md, smd = cost_table(rows, skipped, args, comm.size, dp), []
    if search_rows:
        smd = longest_table(search_rows, args, comm.size)
        write_results(args.out, search_rows, smd, comm, name="longest", **meta)
    write_results(args.out, rows, md, comm, name="cost", longest=search_rows,
                  budget_mib=args.budget_mib, **meta)
    print("\n".join(md + [""] + smd))


def cost_table(rows, skipped, args, world, dp) -> list[str]:
    md = [f"GPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, sequence "
          f"{args.seq_len}, global batch {args.batch}, fp32, ZeRO stage {args.stage}, {world} "
          f"rank(s) (dp {dp} x tp {args.tp} x pp {args.pp}); every option's steps "
          f"interleaved, median of {args.steps} after {args.warmup} warm-up round(s); "
          "overhead: paired, the median over the rounds of each step against the same "
          "round's step without recompute (steady when the machine's load comes in bursts), "
          "and of the median steps; "
          "recompute: the time measured in the forwards run again and the attention "
          "probabilities recomputed; activations: the ledger's device peak per rank (largest "
          "rank; what is kept in host memory beside it).", "",
          "| option | step ms | overhead vs none: paired (of the medians) | "
          "recompute ms (share of step) | "
          "activation peak MiB | saving vs none | max param diff | losses identical |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        host = r["activation_host_mib"]
        md.append(f"| {r['option']} | {r['step_ms']:.0f} | {100 * r['overhead_paired']:+.1f} % "
                  f"({100 * r['overhead']:+.1f} %) | "
                  f"{r['recompute_ms']:.0f} ({100 * r['recompute_share']:.1f} %) | "
                  f"{r['activation_peak_mib']:.1f}{f' (host {host:.1f})' if host else ''} | "
                  f"{100 * r['activation_saving']:.0f} % | {r['max_param_diff']:g} | "
                  f"{'yes' if r['losses_identical'] else 'no'} |")
    for name, why in skipped:
        md.append(f"| {name} | {why.split(':')[0]} | | | | | | |")
    return md


def longest_table(rows, args, world) -> list[str]:
    md = [f"Longest sequence T (a multiple of {args.granularity}, micro batch 1) and largest "
          f"micro batch (at T = {args.search_seq_len}) for which a GPT of "
          f"{args.search_n_layer} layers, d_model {args.search_d_model}, "
          f"{args.search_n_head} heads, vocabulary {args.search_vocab} trains one step (fp32, "
          f"Adam, ZeRO stage 0, {world} rank(s)) within {args.budget_mib:g} MiB of device "
          "memory per rank (the ledger's count: model states, communication buffers, "
          "activations). '+': the search's ceiling.", "",
          "| option | longest T | vs none | largest micro batch | vs none |",
          "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['option']} | {r['longest_seq_len']:,}"
                  f"{'+' if r['seq_at_ceiling'] else ''} | {times(r['seq_vs_none'])} | "
                  f"{r['largest_micro_batch']}{'+' if r['batch_at_ceiling'] else ''} | "
                  f"{times(r['batch_vs_none'])} |")
    return md


if __name__ == "__main__":
    main()

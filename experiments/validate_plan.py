"""Validate `zmpi plan`'s model against the engine: for a small GPT, a representative set of
the layouts the planner enumerates is run for a few steps on this machine, and the ledger's
bytes and the measured step time are compared with `zmpi.plan.memory.stage_memory` and
`zmpi.plan.time.step_time` (on this machine measured as a Hardware: `--hardware this`). The
model checked is this machine's CPU: the ranks run on NumPy (`ZMPI_BACKEND=numpy`) also where
CuPy finds a GPU.

    OMP_NUM_THREADS=1 python experiments/validate_plan.py --out results/plan_validation

The driver (this script without --worker) measures the hardware (`measure_this(ranks=2)`;
for the layouts of 2 up to the cores' ranks, again on that many ranks at once, as `mpiexec
-n W zmpi plan --hardware this` measures it: each rank's rates with its peers busy on the
other cores, the slowest rank's), picks the layouts (every dp x pp x tp with product 1, 2,
4; on each mesh the ZeRO stages 0-3, with offload, recompute, sequence parallelism, schedule
and the micro-batch split rotating so that every choice occurs; optionally a few bf16 / fp32
layouts), and launches one mpiexec per world size (`--worker`), which runs the layouts one
after another: Mesh, GPT, Engine with `to_config(job, layout)`, `--steps` steps on random
token batches (the first a warm-up), and per rank the ledger (`engine.memory`): model-state
bytes per device after the first step, each category's and each group's peak over the steps
(peaks reset after the engine is built), the step times (the slowest rank's, after a
barrier) and the Engine's phase profile. Compared per rank with the prediction for its
pipeline stage:

- model states, device and host: predicted exactly (the ledger's bytes after the first step);
- device total: the ledger's device peak vs StageMemory.device (model states + ZeRO's
  transients + activations); the parts beside it (transient: the peak of the device bytes
  other than activations, minus the model states; activation: the activation group's peak);
- the step time: the least step after the warm-up (each step the slowest rank's) vs
  StepTime.total, the model's step on the quiet machine `measure_this` measures (its timings
  are each the least of a few).

The whole run (the hardware measured, then every layout) is repeated `--rounds` times (3): on
a shared machine both the calibration and the steps move with the neighbours' load, by 20-30%
within minutes here, so a layout's step time is judged by its least step of any round
against the median of its rounds' predictions (the quiet ratio: load only adds time to a
step, while a calibration errs either way), and by its median round (the round whose
measured / predicted is the median of its rounds), with every round's ratio beside it. A
round after the first that fails (an mpiexec that dies or times out) ends the run with the
rounds before it, saying so under the table.

Writes OUT/table.md, table.csv (a row per layout: its median round, its worst rank) and
run.json (every round's hardware, every rank's figures; the comparison and the tables are
experiments/plan_tables.py's); prints a summary. Timings on this
machine's 2 shared cores (4 ranks oversubscribe them: the model gives each rank cores / ranks
of the rates); memory is exact.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import asdict
from pathlib import Path

import numpy as np
from plan_tables import (
    compare,
    load_line,
    markdown,
    median_round,
    on_ranks_json,
    rerender,
    steal_line,
)

from zmpi.plan.layout import RECOMPUTES, SCHEDULES, Job, Layout, layouts, stage_offloads, to_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (2, 2, 1), (2, 1, 2),
          (1, 2, 2), (1, 4, 1), (1, 1, 4)]  # (dp, pp, tp), every one with dp pp tp <= 4
MIB = 2**20


def job_for(args, world: int, precision: str) -> Job:
    """The job on `world` ranks of one node (a rank per core, oversubscribed beyond them)."""
    return Job(args.n_layer, args.d_model, args.n_head, args.vocab, args.seq_len,
               args.global_batch, 1, world, precision)


def pick_layouts(args) -> list[tuple[str, Layout]]:
    """(precision, layout) pairs: on every mesh the four ZeRO stages, each with an offload the
    stage allows, a recompute policy, sequence parallelism (tp > 1), a schedule (pp > 1) and a
    micro-batch split (m = 2 or 4) rotating over the meshes so that every choice occurs
    (every pair is one `layouts(job)` gives); then a few in the other precisions."""
    picked = []
    for i, (dp, pp, tp) in enumerate(MESHES):
        if dp * pp * tp not in args.worlds or args.n_head % tp or args.global_batch % (4 * dp):
            continue  # not asked for, or not a layout of this job
        per_rank = args.global_batch // dp
        for k in range(4):
            allowed = stage_offloads(k)
            m = (2, 4)[(k + k // 2 + i) % 2]
            layout = Layout(dp, pp, tp, k, allowed[(i + k) % len(allowed)],
                            RECOMPUTES[(i + k) % 3], tp > 1 and (i + k) % 2 == 0,
                            per_rank // m, m, SCHEDULES[(i + k // 2) % 2] if pp > 1 else "1f1b")
            picked.append((args.precision, layout))
    for precision in args.other_precisions:
        for k, (dp, pp, tp) in enumerate([(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1)]):
            if 2 not in args.worlds or args.n_head % tp:
                continue
            per_rank = args.global_batch // dp
            picked.append((precision, Layout(dp, pp, tp, k, "optimizer" if k == 2 else "none",
                                             "none", False, per_rank // 2, 2, "1f1b")))
    known = {}  # (world, precision): every layout of that job
    for precision, layout in picked:
        world = layout.dp * layout.pp * layout.tp
        if (world, precision) not in known:
            known[world, precision] = set(layouts(job_for(args, world, precision)))
        assert layout in known[world, precision], layout
    return picked


# -- the worker: one mpiexec per world size, the layouts one after another ------------------

def run_layout(comm, job: Job, layout: Layout, steps: int, seed: int) -> dict:
    """This rank's figures for one layout (see the module docstring)."""
    from zmpi.engine import Engine
    from zmpi.memory import CATEGORIES, GROUPS, MODEL_STATE
    from zmpi.models.gpt import GPT, GPTConfig
    from zmpi.parallel.mesh import Mesh

    config = to_config(job, layout)
    mesh = Mesh(comm, tp=layout.tp, pp=layout.pp)
    model = GPT(GPTConfig(job.vocab_size, job.seq_len, job.n_layer, job.n_head, job.d_model),
                seed=seed, tp=mesh.tp_comm, sequence_parallel=layout.sequence_parallel)
    engine = Engine(model, config, comm, mesh=mesh)
    memory = engine.memory
    init_peak = {d: memory.peak(device=d) for d in ("device", "host")}
    memory.reset_peaks()
    rows = layout.micro_batch * layout.micro_batches
    times, losses, after_first = [], [], None
    for step in range(steps):
        rng = np.random.default_rng([seed, step, mesh.dp_rank])  # alike on a replica's ranks
        tokens = rng.integers(0, job.vocab_size, (rows, job.seq_len + 1))
        # inputs and targets their own arrays, as zmpi.data's samplers give them: the ledger
        # counts an array kept for backward by the buffer owning its memory
        inputs, targets = tokens[:, :-1].copy(), tokens[:, 1:].copy()
        if step == steps - 1:  # count the last step's collectives
            engine.reset_counters()
            skipped = engine.scaler.skipped_steps
        comm.barrier()
        t0 = time.perf_counter()
        losses.append(engine.train_step(inputs, targets))
        times.append(time.perf_counter() - t0)
        if step == 0:
            after_first = {d: {c: memory.current(c, d) for c in MODEL_STATE}
                           for d in ("device", "host")}
    not_activation = tuple(c for c in CATEGORIES if c not in GROUPS["activation"])
    out = {
        "rank": comm.rank, "dp_rank": mesh.dp_rank, "pp_rank": mesh.pp_rank,
        "tp_rank": mesh.tp_rank,
        "model_state": {d: sum(v.values()) for d, v in after_first.items()},
        "model_state_by_category": after_first,
        "model_state_end": {d: memory.current("model_state", d) for d in ("device", "host")},
        "peak": {d: memory.peak(device=d) for d in ("device", "host")},
        "peak_category": {d: {c: memory.peak(c, d) for c in CATEGORIES}
                          for d in ("device", "host")},
        "peak_activation": {d: memory.peak("activation", d) for d in ("device", "host")},
        "peak_not_activation": {d: memory.peak(not_activation, d) for d in ("device", "host")},
        "peak_model_state": {d: memory.peak("model_state", d) for d in ("device", "host")},
        "init_peak": init_peak,
        "times": times, "loss": losses[-1], "skipped_steps": engine.scaler.skipped_steps,
        "phases": _phases_per_step(engine.phases),
        "calls": _calls(engine), "calls_step_skipped": engine.scaler.skipped_steps > skipped,
    }
    engine.close()
    return out


def _calls(engine) -> dict:
    """{"dp"|"pp"|"tp": {op: calls}} since the counters were reset, on the dimensions of
    more than one rank (the Engine's counters; a group of one rank sends nothing)."""
    sizes = {"dp": engine.mesh.dp, "pp": engine.mesh.pp, "tp": engine.mesh.tp}
    return {dim: {op: count["calls"] for op, count in ops.items() if count["calls"]}
            for dim, ops in engine.traffic_by_dimension().items() if sizes[dim] > 1}


def _phases_per_step(profile) -> dict:
    """The Engine's PhaseProfile (forward, backward, step, optimizer, waited), seconds per
    step after the first."""
    steps, seconds, _ = profile.counted()
    return {phase: value / max(steps, 1) for phase, value in seconds.items()}


def worker(args) -> None:
    from zmpi.comm import Comm

    comm = Comm()
    todo = json.loads(Path(args.worker).read_text())
    results = []
    for item in todo:
        job, layout = Job(**item["job"]), Layout(**item["layout"])
        t0 = time.perf_counter()
        try:
            mine = run_layout(comm, job, layout, args.steps, args.seed)
        except ValueError as e:  # a config the engine refuses: alike on every rank
            mine = {"rank": comm.rank, "error": str(e)}
        ranks = comm.allgather_object(mine)
        if comm.rank == 0:
            results.append({**item, "ranks": ranks, "seconds": time.perf_counter() - t0})
            print(f"  {layout.describe()} [{job.precision}]: "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    if comm.rank == 0:
        Path(args.results).write_text(json.dumps(results))


# -- the driver ----------------------------------------------------------------------------

def _run_ranks(args, world: int, *script_args) -> None:
    """This script with `script_args` on `world` ranks (one mpiexec, args.timeout)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    # the model is this machine's CPU (`measure_this`): its ranks run on NumPy even where
    # CuPy and a GPU are found
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", ZMPI_BACKEND="numpy",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(world),
           sys.executable, str(Path(__file__).resolve()), *map(str, script_args)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=args.timeout)


def launch(args, world: int, items: list[dict]) -> list[dict]:
    """Run `items` on `world` ranks (one mpiexec); their results."""
    with tempfile.TemporaryDirectory(prefix="validate-plan-") as tmp:
        todo, done = Path(tmp) / "todo.json", Path(tmp) / "done.json"
        todo.write_text(json.dumps(items))
        _run_ranks(args, world, "--worker", todo, "--results", done, "--steps", args.steps,
                   "--seed", args.seed)
        return json.loads(done.read_text())


def measure_on_ranks(args, world: int):
    """This machine measured on `world` ranks at once, as `mpiexec -n WORLD zmpi plan
    --hardware this` measures it: each rate with the other ranks' load, the slowest rank's."""
    from zmpi.plan.measure import load_hardware

    with tempfile.TemporaryDirectory(prefix="validate-plan-") as tmp:
        out = Path(tmp) / "hardware.json"
        _run_ranks(args, world, "--measure-worker", out)
        return load_hardware(out)


def measure_worker(out) -> None:
    """Under mpiexec: `measure_this`, collective over the ranks; rank 0 writes it to `out`."""
    from zmpi.comm import Comm
    from zmpi.plan.measure import measure_this

    hw = measure_this(progress=print)
    if Comm().rank == 0:
        hw.save(out)


def cpu_times() -> list[int] | None:
    """The machine's CPU time so far by kind (/proc/stat's first line: user, nice, system,
    idle, iowait, irq, softirq, steal, ...), None where there is none (not Linux)."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None


def stolen(before, after) -> float | None:
    """The share of CPU time between two `cpu_times` that the hypervisor gave to other
    guests (steal): what slows a VM's ranks without showing in its own load."""
    if before is None or after is None or len(before) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / sum(spent) if sum(spent) else 0.0


def run_round(args, picked):
    """One round: the hardware (measured, or args.hardware's file), then every picked layout,
    one mpiexec per world size. Measured, a world of 2 up to the cores' ranks is predicted
    with the hardware measured on that many ranks at once (`measure_on_ranks`: rates with
    the cores' shared caches and memory busy, the slowest rank's), the others with the one
    process's (`measure_this(ranks=2)`, which measures ranks beyond the cores itself).
    Returns (hardware, {world: its own hardware}, rows, [{"world", "layouts"}, ...])."""
    from zmpi.plan.hardware import Hardware
    from zmpi.plan.measure import measure_this

    hw = measure_this(ranks=2, progress=print) if args.hardware == "this" else \
        Hardware.from_dict(json.loads(Path(args.hardware).read_text()))
    by_world, rows, raw = {}, [], []
    for world in args.worlds:
        items = [{"job": asdict(job_for(args, world, p)), "layout": layout.to_dict()}
                 for p, layout in picked if layout.dp * layout.pp * layout.tp == world]
        items = items[:args.only] if args.only else items
        if not items:
            continue
        if args.hardware == "this" and 2 <= world <= hw.cores_per_node:
            print(f"world {world}: the hardware on {world} ranks at once", flush=True)
            by_world[world] = measure_on_ranks(args, world)
        print(f"world {world}: {len(items)} layouts", flush=True)
        before = cpu_times()
        done = launch(args, world, items)
        raw.append({"world": world, "layouts": done, "steal": stolen(before, cpu_times())})
        rows.extend(compare(item, by_world.get(world, hw)) for item in done)
    return hw, by_world, rows, raw


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--other-precisions", nargs="*", default=["bf16", "fp32"],
                        help="a few layouts in these precisions too (model states)")
    parser.add_argument("--steps", type=int, default=8, help="per layout, the first a warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--only", type=int, default=None,
                        help="run only the first N picked layouts of each world (a quick look)")
    parser.add_argument("--hardware", default="this",
                        help="'this' (measured now, as `zmpi plan --hardware this`), or a JSON "
                        "file of a Hardware")
    parser.add_argument("--rounds", type=int, default=3,
                        help="whole runs, each measuring the hardware first; a layout's time "
                        "is judged by its least step against its rounds' median prediction, "
                        "and by its median round")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per mpiexec (s)")
    parser.add_argument("--rerender", default=None, metavar="RUN_JSON",
                        help="run nothing: make the tables again from an earlier run's "
                        "run.json with this code's model (the run's own settings apply)")
    parser.add_argument("--out", default="results/plan_validation")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--results", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--measure-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.worker:
        worker(args)
        return
    if args.measure_worker:
        measure_worker(args.measure_worker)
        return
    if args.rerender:
        rerender(args.rerender, args.out)
        return

    sys.path.insert(0, str(HERE))
    from results import write_results

    t0 = time.perf_counter()
    load = {"before": os.getloadavg()}  # the machine is shared: its load beside the timings
    picked = pick_layouts(args)
    hardware, by_world, rounds, raw, failed = [], [], [], [], None
    for k in range(args.rounds):
        print(f"round {k + 1} of {args.rounds}", flush=True)
        try:
            hw, on_ranks, rows, done = run_round(args, picked)
        except (RuntimeError, subprocess.SubprocessError) as error:
            if not rounds:
                raise
            failed = f"Round {k + 1} failed ({error}): the table holds the {len(rounds)} " \
                     "round(s) before it."
            print(failed, file=sys.stderr, flush=True)
            break
        hardware.append(hw)
        by_world.append(on_ranks)
        rounds.append(rows)
        raw.extend({"round": k + 1, **world} for world in done)
    rows = [median_round(list(same)) for same in zip(*rounds, strict=True)]
    load["after"] = os.getloadavg()
    lines = markdown(rows, args, hardware, by_world)
    lines += ["", failed] if failed else []
    lines += ["", load_line(load, os.cpu_count()) + steal_line(raw)]
    print("\n".join(lines))
    write_results(args.out, rows, lines, types.SimpleNamespace(size=max(args.worlds)),
                  argv=sys.argv, args=vars(args), hardware=[hw.to_dict() for hw in hardware],
                  hardware_on_ranks=on_ranks_json(by_world),
                  load=load, ranks=raw, seconds=time.perf_counter() - t0)
    print(f"wrote {args.out}/table.md, table.csv, run.json ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

"""Where a `Hardware` comes from: `load_hardware(spec)` (a preset, a JSON file, or "this"), and
the measurement of this machine (`measure_this`), in a few seconds.

    hw = measure_this(ranks=2, progress=print)
    python -m zmpi.plan.measure            # the whole Hardware as JSON on stdout
    mpiexec -n 2 python -m zmpi.plan.measure --comm   # the allreduce only, JSON on rank 0
    mpiexec -n 4 python -m zmpi.plan.measure --comm --compute-between  # ranks beyond the cores

On a CPU a rank is a device, so every rate is one rank's, on one thread. Every timing is the
least of a few (`fastest_seconds`: the machine at its quietest, where a shared machine's
neighbours have added nothing; the model predicts that step and is compared with the least of
a layout's steps):
- GEMM: float32 matmuls of a GPT layer's shapes, a few calls each; the rate is their FLOPs
  over the sum of their least times. fp32 = fp16 = bf16 = that rate (zmpi computes
  16-bit floats in fp32 on a CPU) and gemm_efficiency = 1 (the rate is what matmuls reach).
  BLAS threads are the caller's environment's to set (OMP_NUM_THREADS=1, as zmpi runs ranks;
  `measured["omp_num_threads"]` records it).
- memory bandwidth: numpy.add of two 64 MiB float32 arrays into a third, 3 x 64 MiB moved.
- host_device: a 64 MiB copy (bytes copied per second) and an 8-byte copy (the latency):
  host and device are the same memory on a CPU.
- allreduce (zmpi.plan.link_rates): float32 allreduces of 8 B and 32 MiB through
  zmpi.comm.Comm over `ranks` ranks (mpiexec beside sys.executable, else on PATH), the
  slowest rank's least. The link is fitted
  to the ring model, in which an allreduce of n bytes over N ranks is 2(N-1) messages carrying
  2(N-1)/N n bytes from each rank: link.seconds(2(N-1)/N n, 2(N-1)) gives both measured times.
  intra_node = inter_node = that link (one node). A float16 allreduce of HALF_BYTES on the
  same ranks gives half_reduction_rate: the time beyond the link's is the MPI summing (N-1)/N
  of its bytes on each rank (MPICH sums float16 in software).
- send progress (`measure_send_progress`, on the same ranks): whether a 1 MiB message reaches
  its receiver while its sender computes for 20 ms. Recorded and said, not modelled: where it
  does not, pipeline messages and bucketed reductions wait for their sender's compute.
- sync skew (`measure_sync_skew`, on the same ranks): what an 8-byte allreduce after a GEMM
  of BETWEEN_SHAPE waits beyond the GEMM alone and the allreduce alone, per call (the ranks'
  arrival skew), the slowest rank's least of five runs of 100 calls.
- oversubscribed link: on a machine of at most MAX_OVERSUBSCRIBED_CORES cores, what the
  same two allreduces add per call to a loop of GEMMs of BETWEEN_SHAPE that 2 x cores ranks
  run at once (`link_rates.measure_crowded_allreduce`: training computes between
  collectives, so a call also waits for peers the OS has descheduled; the loops' mean, the
  median of five, the slowest rank's), fitted with its latency a call's
  (link.seconds(2(N-1)/N n, 1)); and `oversubscribed_efficiency`: the share of its speed
  a rank's training step keeps when those ranks all train at once, a barrier before each
  step (engine_rates.measure_crowd_efficiency).
- host Adam: zmpi.optim.adam.HostAdam stepping an 8 Mi-element fp32 shard on one thread; the
  host add: zmpi.kernels.host.add_ of two 8 Mi-element float16 arrays (offload's accumulation).
- elementwise rate and layer overhead (zmpi.plan.engine_rates): a 2-block GPT of each of
  LAYER_SHAPES (three block sizes) trained by the Engine on this rank alone (fp32, ZeRO-0),
  its blocks' forward and backward seconds from the Engine's profile (the least of 9 steps,
  the shapes stepping in turn); their matmuls' FLOPs at the GEMM rate subtracted, the rest
  (LayerNorm, GELU, softmax, residuals, casts and the engine's per-unit work) fitted by least
  squares as a fixed `layer_overhead` per block and micro-batch plus the block's activation
  bytes at `elementwise_rate`.
- the engine's per-unit and per-parameter work (engine_rates.measure_engine): a 2-block GPT of
  ENGINE_SHAPE, 4 micro-batches a step, on this rank alone at ZeRO-0, -2 and -3 in fp32 and
  at ZeRO-0 in fp16; the steps' excess over fp32 ZeRO-0 gives `stage2_unit_overhead` and
  `stage3_unit_overhead` (per unit and micro-batch) and `half_storage_rate` (parameters per
  second of fp16 storage, per micro-batch).
- memories: the machine's RAM (device and host are one memory); devices_per_node =
  cores_per_node = os.cpu_count().
Under MPI with more than one rank, `measure_this` is collective over COMM_WORLD: every rank
measures at once (so the rates are under the others' load) and gets the slowest rank's rates;
where the ranks outnumber the cores they measure their own rates in turns instead, the
others asleep (measured at once each would be the crowd's rate, and the model charges the
crowding itself), and the oversubscribed link is then measured on COMM_WORLD.
`measured` keeps the raw figures.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np

from zmpi.files import check_input
from zmpi.plan.engine_rates import measure_crowd_efficiency, measure_engine, measure_layer
from zmpi.plan.hardware import PRESETS, Hardware, Link
from zmpi.plan.link_rates import (
    describe_send_progress,
    fit_allreduce_link,
    fit_half_reduction_rate,
    in_turns,
    measure_crowded_allreduce,
    measure_link,
)

GEMM_SHAPES = ((4096, 512, 2048), (1024, 1024, 1024))  # (m, k, n): (m x k) @ (k x n)
STREAM_BYTES = 64 << 20  # each array of the add and the copy
ADAM_NUMEL = 8 << 20
MAX_OVERSUBSCRIBED_CORES = 8  # the oversubscribed link is measured on 2 x cores ranks
LAUNCH_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_SIZE")


def call_seconds(call, repeats: int) -> list[float]:
    """The wall times of `repeats` calls of `call()`, after one untimed call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def fastest_seconds(call, repeats: int) -> float:
    """The least of call_seconds: the machine at its quietest. What a shared machine's
    neighbours do only adds time (Chen and Revels, "Robust benchmarking in noisy
    environments", 2016), so the least is the estimate that does not move with them; the
    step times validate_plan compares the model with are the least of their steps too."""
    return max(min(call_seconds(call, repeats)), 1e-9)


def measure_gemm(repeats: int = 3) -> dict:
    """FLOP/s of float32 matmuls (GEMM_SHAPES) and each shape's FLOPs and best seconds."""
    rng = np.random.default_rng(0)
    shapes = []
    for m, k, n in GEMM_SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        seconds = fastest_seconds(partial(np.matmul, a, b, out=c), repeats)
        shapes.append({"shape": [m, k, n], "flops": 2 * m * k * n, "seconds": seconds})
    rate = sum(s["flops"] for s in shapes) / sum(s["seconds"] for s in shapes)
    return {"flops_per_s": rate, "shapes": shapes}


def measure_memory(repeats: int = 5) -> dict:
    """Bytes/s of an elementwise add (bytes read and written), of a large copy (bytes
    copied), and the seconds of an 8-byte copy."""
    n = STREAM_BYTES // 4
    a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    add = fastest_seconds(lambda: np.add(a, b, out=c), repeats)
    copy = fastest_seconds(lambda: np.copyto(c, a), repeats)
    tiny_src, tiny_dst = np.ones(2, np.float32), np.empty(2, np.float32)
    tiny = fastest_seconds(lambda: np.copyto(tiny_dst, tiny_src), 100)
    return {"add_bytes": 3 * a.nbytes, "add_seconds": add, "copy_bytes": a.nbytes,
            "copy_seconds": copy, "small_copy_bytes": tiny_src.nbytes,
            "small_copy_seconds": tiny}


def measure_adam(repeats: int = 3) -> dict:
    """Parameters per second of one HostAdam step on one thread (fp32 shard and grads), and
    float16 elements per second of the host add that accumulates an offloaded gradient shard
    (`host_kernels.add_`, what ZeRO-2/3 run every micro-step)."""
    from zmpi.kernels import host as host_kernels
    from zmpi.optim.adam import HostAdam

    rng = np.random.default_rng(0)
    param = rng.standard_normal(ADAM_NUMEL, dtype=np.float32)
    grads = rng.standard_normal(ADAM_NUMEL, dtype=np.float32)
    m, v = np.zeros_like(param), np.zeros_like(param)
    opt = HostAdam(lr=1e-3, weight_decay=0.01, threads=1)
    seconds = fastest_seconds(lambda: opt.step_(param, grads, m, v), repeats)
    total, part = (rng.standard_normal(ADAM_NUMEL, dtype=np.float32).astype(np.float16)
                   for _ in range(2))
    add = fastest_seconds(lambda: host_kernels.add_(total, part), repeats)
    return {"params": ADAM_NUMEL, "seconds": seconds, "add_seconds": add,
            "kernel": "numba" if host_kernels.adam is not None else "numpy"}


def _world_size() -> int:
    """COMM_WORLD's size when this process is an MPI rank already (launched as one, or MPI
    imported); 1 otherwise, without initialising MPI."""
    if "mpi4py.MPI" not in sys.modules and not any(v in os.environ for v in LAUNCH_VARIABLES):
        return 1
    from zmpi.comm import MPI

    return MPI.COMM_WORLD.Get_size()


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError(f"measuring the allreduce needs mpiexec: none beside "
                           f"{sys.executable} nor on PATH")
    return found


def launch_allreduce(ranks: int, timeout: float, compute_between: bool = False) -> dict:
    """`measure_allreduce` on `ranks` fresh ranks (`python -m zmpi.plan.measure --comm
    [--compute-between] --out FILE` under mpiexec, one BLAS thread each), killed after
    `timeout` seconds; a RuntimeError with the command and its output if it fails. The
    result comes back in a file, not on stdout: a launcher may put its own bytes on the
    ranks' output (Open MPI forwarded a terminal escape before the JSON, once in three)."""
    root = str(Path(__file__).resolve().parents[2])  # where `zmpi` is importable from
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="zmpi-measure-") as tmp:
        result = Path(tmp) / "allreduce.json"
        cmd = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "zmpi.plan.measure",
               "--comm", *(["--compute-between"] if compute_between else []),
               "--out", str(result)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and its ranks
            out, err = proc.communicate()
            raise RuntimeError(f"`{' '.join(cmd)}` did not finish in {timeout:g} s\n"
                               f"{out[-2000:]}{err[-2000:]}") from None
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit code {proc.returncode}"
                               f"{', no result written' if proc.returncode == 0 else ''})\n"
                               f"{out[-2000:]}{err[-2000:]}")
        return json.loads(result.read_text())


def measure_crowd(comm, cores: int) -> dict:
    """Collective, on ranks that outnumber the `cores`: the crowded allreduce
    (`link_rates.measure_crowded_allreduce`) and the crowd's efficiency
    (`engine_rates.measure_crowd_efficiency`), in one dict."""
    return {**measure_crowded_allreduce(comm), **measure_crowd_efficiency(comm, cores)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _measure_rank(say) -> tuple[dict, dict, dict, dict, dict]:
    """This rank's own rates: (gemm, memory, adam, layer, engine) measurements, each said."""
    gemm = measure_gemm()
    say(f"this: GEMM fp32 {gemm['flops_per_s'] / 1e9:.1f} GFLOP/s per rank "
        f"({', '.join('x'.join(map(str, s['shape'])) for s in gemm['shapes'])}, least of 3)")
    memory = measure_memory()
    say(f"this: memory {memory['add_bytes'] / memory['add_seconds'] / 1e9:.1f} GB/s (add), "
        f"copy {memory['copy_bytes'] / memory['copy_seconds'] / 1e9:.1f} GB/s")
    adam = measure_adam()
    say(f"this: host Adam {adam['params'] / adam['seconds'] / 1e9:.2f} G params/s, float16 "
        f"add {adam['params'] / adam['add_seconds'] / 1e9:.2f} G elements/s ({adam['kernel']}, "
        "one thread)")
    layer = measure_layer(gemm["flops_per_s"])
    say("this: a GPT block forward and backward " + ", ".join(
        f"{x['block_seconds'] * 1e3:.2f} ms (b {x['micro_batch']}, s {x['seq_len']}, d "
        f"{x['d_model']})" for x in layer["shapes"]) + f"; besides its matmuls "
        f"{layer['layer_overhead'] * 1e3:.2f} ms + its activations at "
        f"{layer['elementwise_rate'] / 1e9:.2f} GB/s")
    engine = measure_engine()
    say(f"this: the engine per unit and micro-batch at ZeRO-2 "
        f"{engine['stage2_unit_overhead'] * 1e3:.2f} ms, ZeRO-3 "
        f"{engine['stage3_unit_overhead'] * 1e3:.2f} ms; fp16 storage "
        + (f"{engine['half_storage_rate'] / 1e6:.0f} M params/s" if engine["half_storage_rate"]
           else "no extra cost"))
    return gemm, memory, adam, layer, engine


def measure_this(ranks: int = 2, progress=None, timeout: float = 120.0) -> Hardware:
    """This machine as a Hardware named "this" (see the module docstring for what is
    measured and how). `ranks` (>= 2): how many ranks the allreduce runs on when this process
    is not an MPI rank already; `timeout`: seconds that launch may take; `progress(str)` is
    told each measurement."""
    if ranks < 2:
        raise ValueError(f"measure_this: ranks must be >= 2 (an allreduce), got {ranks}")
    from zmpi import backend

    if backend.is_gpu:  # its layer and engine timings would be the GPU's, its GEMM the CPU's
        raise ValueError("--hardware this measures this machine's CPU ranks (NumPy), but the "
                         "backend here is CuPy: run with ZMPI_BACKEND=numpy, or name a GPU's "
                         "hardware file (a100, h100, h200, v100, or FILE)")
    world = _world_size()
    comm = None
    if world > 1:
        from zmpi.comm import Comm

        comm = Comm()
    quiet = progress is None or (comm is not None and comm.rank != 0)
    say = (lambda message: None) if quiet else progress
    cores = os.cpu_count() or 1
    if comm is not None:  # cores_per_node: the fewest any rank's node has (on every rank)
        cores = int(comm.allreduce_scalar(cores, op="min"))
    # ranks that outnumber the cores measure their own rates in turns, the others asleep:
    # measured at once each rate would be the crowd's, which the model charges itself (the
    # core share and oversubscribed_efficiency)
    crowded_ranks = comm is not None and comm.size > cores
    gemm, memory, adam, layer, engine = in_turns(comm, partial(_measure_rank, say)) \
        if crowded_ranks else _measure_rank(say)
    if comm is not None:
        allreduce = measure_link(comm)
        crowded = measure_crowd(comm, cores) if crowded_ranks else None
    else:
        say(f"this: allreduce on {ranks} ranks (mpiexec) ...")
        allreduce = launch_allreduce(ranks, timeout)
        crowded = None
        if cores <= MAX_OVERSUBSCRIBED_CORES:
            say(f"this: allreduce on {2 * cores} ranks, a GEMM between calls (mpiexec) ...")
            crowded = launch_allreduce(2 * cores, timeout, compute_between=True)
    link = fit_allreduce_link(allreduce)
    half_rate = fit_half_reduction_rate(allreduce, link)
    say(f"this: allreduce link {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.1f} us "
        f"per message ({allreduce['ranks']} ranks); float16 reduced at "
        + (f"{half_rate / 1e6:.0f} MB/s" if half_rate else "no extra cost"))
    say("this: " + describe_send_progress(allreduce["send_progress"]))
    say(f"this: a synchronous call between GEMMs waits {allreduce['sync_skew_seconds'] * 1e6:.0f}"
        " us for its peers beyond the transfer")
    rates = {"gemm": gemm["flops_per_s"], "add": memory["add_bytes"] / memory["add_seconds"],
             "copy": memory["copy_bytes"] / memory["copy_seconds"],
             "adam": adam["params"] / adam["seconds"],
             "host_add": adam["params"] / adam["add_seconds"],
             "elementwise": layer["elementwise_rate"],
             # None (noise hid the cost) as no cost: every rank reduces the same keys
             "half_storage": engine["half_storage_rate"] or math.inf}
    overheads = {"copy_latency": memory["small_copy_seconds"],
                 "layer_overhead": layer["layer_overhead"],
                 "sync_skew": allreduce["sync_skew_seconds"],
                 **{k: engine[k] for k in ("stage2_unit_overhead", "stage3_unit_overhead")}}
    if comm is not None:  # the slowest rank's, so that every rank gets the same Hardware
        rates = {k: comm.allreduce_scalar(r, op="min") for k, r in rates.items()}
        overheads = {k: comm.allreduce_scalar(x, op="max") for k, x in overheads.items()}
    if math.isinf(rates["half_storage"]):
        del rates["half_storage"]  # no rank saw a cost
    oversubscribed = None if crowded is None else fit_allreduce_link(crowded, per_call=True)
    efficiency = 1.0 if crowded is None else min(1.0, crowded["crowd_efficiency"])
    if oversubscribed is not None:
        say(f"this: oversubscribed link {oversubscribed.bandwidth / 1e9:.2f} GB/s, "
            f"{oversubscribed.latency * 1e6:.1f} us per call beyond the GEMMs between calls "
            f"({crowded['ranks']} ranks); a rank computes at {efficiency:.2f} of its share of "
            "the cores")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    now = datetime.now(timezone.utc)
    cpu = _cpu_model()
    return Hardware(
        name="this",
        peak_flops={dtype: rates["gemm"] for dtype in ("fp32", "fp16", "bf16")},
        gemm_efficiency=1.0,
        memory_bandwidth=rates["add"],
        device_memory=float(ram),
        host_memory=float(ram),
        devices_per_node=cores,
        intra_node=link,
        inter_node=link,
        host_device=Link(rates["copy"], overheads["copy_latency"]),
        host_adam_rate=rates["adam"],
        host_add_rate=rates["host_add"],
        cores_per_node=cores,
        elementwise_rate=rates["elementwise"],
        layer_overhead=overheads["layer_overhead"],
        stage2_unit_overhead=overheads["stage2_unit_overhead"],
        stage3_unit_overhead=overheads["stage3_unit_overhead"],
        sync_skew=overheads["sync_skew"],
        half_storage_rate=rates.get("half_storage"),
        half_reduction_rate=half_rate,
        oversubscribed=oversubscribed,
        oversubscribed_efficiency=efficiency,
        source=f"measured by zmpi.plan.measure on {now.date().isoformat()}: {cpu}, "
               f"{cores} CPUs, {ram / 2**30:.1f} GiB RAM; one thread per rank; "
               + (f"each of {world} ranks in turn, the others asleep; their links at once"
                  if crowded_ranks else f"all {world} ranks at once" if comm else "one rank alone"),
        measured={"date": now.isoformat(timespec="seconds"), "cpu": cpu,
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                  "gemm": gemm, "memory": memory, "adam": adam, "layer": layer,
                  "engine": engine,
                  "allreduce": allreduce, "oversubscribed_allreduce": crowded,
                  "rates": rates},
    )



def refit(hw: Hardware) -> Hardware:
    """`hw` with its oversubscribed link fitted again, by this code's fit, from the raw
    allreduce `measure_this` recorded (experiments/validate_plan.py --rerender: an earlier
    run judged by the current model); `hw` itself where it recorded none, or one of the
    older kind that this fit would misread (a call's median time with a GEMM before it, up
    to 1c6e801, marked "compute_between")."""
    crowded = hw.measured.get("oversubscribed_allreduce")
    if not crowded or "compute_between" in crowded:
        return hw
    return dataclasses.replace(hw, oversubscribed=fit_allreduce_link(crowded, per_call=True))


def load_hardware(spec, progress=None) -> Hardware:
    """The Hardware `spec` names: a preset (PRESETS, any case; a copy), "this" (this machine,
    measured by zmpi.plan.measure.measure_this, reporting through `progress(str)`), or the
    path of a JSON file of `Hardware.to_dict()`'s keys (units allowed, see `from_dict`).
    A ValueError says what is wrong: an unknown name, a missing file, bad JSON or fields."""
    name = str(spec)
    if name.lower() in PRESETS:
        return Hardware.from_dict(PRESETS[name.lower()].to_dict())
    if name.lower() == "this":
        return measure_this(progress=progress)
    path = Path(name)
    if os.path.lexists(path) or path.suffix or len(path.parts) > 1:
        check_input(path, "hardware file")  # a directory, a device (/dev/null), missing
    else:
        raise ValueError(f"unknown hardware {name!r}: a preset ({', '.join(PRESETS)}), "
                         f"'this' (measure this machine) or the path of a JSON file")
    from zmpi.config import parse_json

    try:  # parse_json: a repeated key is an error; from_dict refuses all but an object
        return Hardware.from_dict(parse_json(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"hardware file {name}: not readable as JSON: {e}") from None
    except ValueError as e:  # ConfigError too
        raise ValueError(f"hardware file {name}: {e}") from None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comm", action="store_true",
                        help="only the allreduce, on COMM_WORLD (run under mpiexec)")
    parser.add_argument("--compute-between", action="store_true",
                        help="with --comm, on ranks beyond the cores: what the calls add to "
                             "GEMMs every rank runs at once, and the share of its speed a "
                             "rank's training step keeps in that crowd")
    parser.add_argument("--out", default=None,
                        help="with --comm: write the result (JSON) to this file, not stdout")
    parser.add_argument("--ranks", type=int, default=2, help="ranks for the allreduce")
    args = parser.parse_args(argv)
    if args.compute_between and not args.comm:
        parser.error("--compute-between is a mode of --comm")
    if args.out and not args.comm:
        parser.error("--out is a mode of --comm (the hardware goes to stdout)")
    if args.comm:
        from zmpi.comm import Comm

        comm = Comm()
        if comm.size < 2:
            parser.error("--comm measures an allreduce: run it on >= 2 ranks (mpiexec -n 2)")
        result = measure_crowd(comm, os.cpu_count() or 1) if args.compute_between \
            else measure_link(comm)
        if comm.rank == 0:
            if args.out:
                Path(args.out).write_text(json.dumps(result))
            else:
                print(json.dumps(result), flush=True)
        return
    hardware = measure_this(args.ranks, progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(hardware.to_dict(), indent=2))


if __name__ == "__main__":
    main()

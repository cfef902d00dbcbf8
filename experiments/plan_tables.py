"""The tables of experiments/validate_plan.py: a layout's measurements (every rank's ledger
and step times, as its worker reports them) against `zmpi plan`'s predictions (`compare`), a
layout's rounds as one (`median_round`: the median round, and the least step against the
median prediction), the
markdown of a run (`markdown`), and a run's tables made again from its run.json with this
code's model (`rerender`, validate_plan.py --rerender).
"""
from __future__ import annotations

import json
import statistics
import sys
import types
from pathlib import Path

from zmpi.plan.layout import Job, Layout

HERE = Path(__file__).resolve().parent


def ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted else (1.0 if measured == 0 else float("inf"))


def compare(item: dict, hw) -> dict:
    """A row: the layout, its worst rank's memory (predicted / measured) and the step time."""
    from zmpi.plan.collectives import counted_calls, stage_calls
    from zmpi.plan.memory import layout_memory
    from zmpi.plan.time import step_time

    job, layout = Job(**item["job"]), Layout(**item["layout"])
    row = {"layout": layout.describe(), "precision": job.precision, "world": job.world_size,
           **{k: v for k, v in layout.to_dict().items()}}
    if "error" in item["ranks"][0]:
        return {**row, "error": item["ranks"][0]["error"]}
    per_rank, exact = [], True
    stages = layout_memory(job, layout, on_gpu=False)
    for r in item["ranks"]:
        pred = stages[r["pp_rank"]]
        measured_transient = r["peak_not_activation"]["device"] - r["model_state"]["device"]
        ms_ok = all(r["model_state"][d] == pred.model_state[d] for d in ("device", "host"))
        exact &= ms_ok
        per_rank.append({
            "rank": r["rank"], "stage": r["pp_rank"],
            "ms_pred": pred.model_state, "ms_meas": r["model_state"], "ms_exact": ms_ok,
            "ms_by_category": r["model_state_by_category"],
            "transient_pred": pred.transient, "transient_meas": measured_transient,
            "act_pred": pred.activation["device"], "act_meas": r["peak_activation"]["device"],
            "act_host_pred": pred.activation["host"], "act_host_meas":
                r["peak_activation"]["host"],
            "device_pred": pred.device, "device_meas": r["peak"]["device"],
            "device_ratio": ratio(r["peak"]["device"], pred.device),
            "host_pred": pred.host, "host_meas": r["peak"]["host"],
            "phases": r["phases"],
            # the last step's collectives, unless it skipped its update (or predates them)
            "calls_pred": stage_calls(job, layout, r["pp_rank"]),
            "calls_meas": None if r.get("calls_step_skipped", True)
            else counted_calls(r["calls"]),
        })
    # the worst rank: the device total furthest from its prediction
    worst = max(per_rank, key=lambda p: abs(p["device_ratio"] - 1))
    per_step = zip(*(r["times"] for r in item["ranks"]), strict=True)
    times = [max(ts) for ts in per_step][1:]  # the slowest rank's, without the warm-up
    measured_s = min(times)  # the machine at its quietest, as measure_this times it
    predicted = step_time(job, layout, hw)
    return {**row, "ms_exact": exact,
            "ms_device_pred": worst["ms_pred"]["device"], "ms_device_meas":
                worst["ms_meas"]["device"],
            "ms_host_pred": worst["ms_pred"]["host"], "ms_host_meas": worst["ms_meas"]["host"],
            "stage_of_worst": worst["stage"],
            "transient_pred": worst["transient_pred"], "transient_meas": worst["transient_meas"],
            "act_pred": worst["act_pred"], "act_meas": worst["act_meas"],
            "device_pred": worst["device_pred"], "device_meas": worst["device_meas"],
            "device_ratio": worst["device_ratio"],
            "time_pred_s": predicted.total, "time_meas_s": measured_s,
            "waited_s": max(p["phases"]["waited"] for p in per_rank),
            "time_ratio": measured_s / predicted.total,
            # every rank's counted collectives equal the prediction (None: none counted)
            "calls_exact": _all_known(None if p["calls_meas"] is None
                                      else p["calls_pred"] == p["calls_meas"] for p in per_rank),
            "time_parts": predicted.to_dict(), "skipped_steps": item["ranks"][0]["skipped_steps"],
            "loss": item["ranks"][0]["loss"], "per_rank": per_rank}


def _all_known(flags) -> bool | None:
    """Whether every flag that is not None holds; None where none is known."""
    known = [f for f in flags if f is not None]
    return all(known) if known else None


def describe_hardware(hw) -> str:
    """The measured figures the time model leans on, in a line."""
    return (f"GEMM {hw.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, memory "
            f"{hw.memory_bandwidth / 1e9:.1f} GB/s, link {hw.intra_node.bandwidth / 1e9:.2f} GB/s "
            f"{hw.intra_node.latency * 1e6:.1f} us"
            + (f", oversubscribed {hw.oversubscribed.bandwidth / 1e9:.2f} GB/s "
               f"{hw.oversubscribed.latency * 1e6:.0f} us" if hw.oversubscribed else "")
            + (f", float16 sums {hw.half_reduction_rate / 1e6:.0f} MB/s"
               if hw.half_reduction_rate else "")
            + (f", elementwise {hw.elementwise_rate / 1e9:.2f} GB/s + "
               f"{hw.layer_overhead * 1e3:.2f} ms a block" if hw.elementwise_rate else "")
            + _send_progress(hw))


def _send_progress(hw) -> str:
    """Whether a message moved while its sender computed (measure_send_progress), if known."""
    sends = ((hw.measured or {}).get("allreduce") or {}).get("send_progress")
    if sends is None:
        return ""
    return ", a message " + ("moves while its sender computes"
                             if sends["moves_while_sender_computes"] else
                             "waits for its computing sender (no single copy)")


def within(ratio: float, tolerance: float) -> bool:
    return abs(ratio - 1) <= tolerance


def on_ranks_json(on_ranks: list[dict]) -> list[dict]:
    """Each round's {world: Hardware measured on that many ranks at once} as run.json keeps
    it (`hardware_on_ranks`)."""
    return [{str(w): h.to_dict() for w, h in r.items()} for r in on_ranks]


def markdown(rows: list[dict], args, hardware: list, on_ranks: list[dict]) -> list[str]:
    """The table and its header: `hardware` each round's measured in one process,
    `on_ranks` each round's {world: hardware measured on that many ranks at once}."""
    ok = [r for r in rows if "error" not in r]
    exact = sum(r["ms_exact"] for r in ok)
    within5 = sum(within(r["device_ratio"], 0.05) for r in ok)
    within20 = sum(within(r["time_ratio"], 0.20) for r in ok)
    quiet20 = sum(within(r["quiet_ratio"], 0.20) for r in ok)
    calls = [r["calls_exact"] for r in ok if r.get("calls_exact") is not None]
    per_round = [sum(within(r["round_ratios"][k], 0.20) for r in ok) for k in range(len(hardware))]
    lines = [
        f"GPT {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, vocabulary "
        f"{args.vocab}, sequence {args.seq_len}, global batch {args.global_batch}; "
        f"{args.precision} (and {', '.join(args.other_precisions) or 'no other precision'}); "
        f"{args.steps} steps per layout, the first a warm-up; {len(hardware)} rounds, each "
        "measuring the hardware here (`measure_this`) and then running every layout: "
        + "; ".join(f"round {k + 1}: {describe_hardware(hw)}"
                    + "".join(f"; on {w} ranks at once (for the {w}-rank layouts): "
                              f"{describe_hardware(h)}" for w, h in sorted(on_ranks[k].items()))
                    for k, hw in enumerate(hardware))
        + f" ({hardware[0].cores_per_node} cores). Per layout its median round (by measured / "
        "predicted step time) and that round's "
        "rank whose device peak is furthest from the prediction for its pipeline stage; KiB. "
        "ms: model states (device / host), exact = the ledger's bytes after the first step "
        "equal the prediction on every rank in every round; transient: the device peak of "
        "everything but activations, less the model states; act: the activation group's device "
        "peak; device: the ledger's device peak (all categories at once) vs StageMemory.device; "
        "time: the least step (each the slowest rank's) vs StepTime.total; rounds: every round's "
        "meas/pred; quiet: the least step of any round (a neighbour's load only adds time to a "
        "step) vs the median of the rounds' predictions (each from its round's hardware, whose "
        "errors go either way: a burst caught in a short timing, a slow spell tilting the "
        "layer's fit); waited: "
        "the most any rank spent blocked in MPI per step (the Engine's profile); calls: every "
        "rank's collectives and sends of the last step on each dimension (the Engine's "
        "counters) equal `zmpi.plan.collectives.stage_calls` in every round (-: the step "
        "skipped its update, or the run predates the count).",
        "",
        f"Model states exact on every rank: {exact}/{len(ok)} layouts; device peak within 5%: "
        f"{within5}/{len(ok)}; "
        + (f"collective calls exact: {sum(calls)}/{len(calls)} layouts counted; " if calls
           else "collective calls not counted (the run predates the count); ")
        + f"step time within 20%: {quiet20}/{len(ok)} by the least step against the median "
        f"prediction, {within20}/{len(ok)} by the median round (round by round "
        f"{', '.join(map(str, per_round))}); by ranks, the least step against the median "
        "prediction "
        + ", ".join(f"{n}: {sum(within(r['quiet_ratio'], 0.2) for r in group)}/{len(group)} "
                    f"(median meas/pred {statistics.median(r['quiet_ratio'] for r in group):.2f})"
                    for n, group in _by_world(ok).items()) + ".",
        "",
        "| layout | prec | ms device pred / meas | ms host pred / meas | exact | transient "
        "pred / meas | act pred / meas | device pred / meas | meas/pred | time pred / meas ms "
        "| meas/pred | rounds | quiet meas/pred | waited ms | calls |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    k = 1024
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['precision']} | error: {r['error']} |"
                         + " |" * 12)
            continue
        lines.append(
            f"| {r['layout']} | {r['precision']} | {r['ms_device_pred'] / k:.1f} / "
            f"{r['ms_device_meas'] / k:.1f} | {r['ms_host_pred'] / k:.1f} / "
            f"{r['ms_host_meas'] / k:.1f} | {_yes_no(r['ms_exact'])} | "
            f"{r['transient_pred'] / k:.1f} / {r['transient_meas'] / k:.1f} | "
            f"{r['act_pred'] / k:.1f} / {r['act_meas'] / k:.1f} | "
            f"{r['device_pred'] / k:.1f} / {r['device_meas'] / k:.1f} | "
            f"{r['device_ratio']:.3f} | {r['time_pred_s'] * 1e3:.0f} / "
            f"{r['time_meas_s'] * 1e3:.0f} | {r['time_ratio']:.2f} | "
            f"{' '.join(f'{x:.2f}' for x in r['round_ratios'])} | {r['quiet_ratio']:.2f} | "
            f"{r['waited_s'] * 1e3:.0f} | {_yes_no(r.get('calls_exact'))} |")
    return lines


def _yes_no(flag: bool | None) -> str:
    return "-" if flag is None else "yes" if flag else "**no**"


def _by_world(rows: list[dict]) -> dict[int, list[dict]]:
    """The rows grouped by their world size, smallest first."""
    groups = {}
    for r in rows:
        groups.setdefault(r["world"], []).append(r)
    return dict(sorted(groups.items()))


def median_round(rows: list[dict]) -> dict:
    """One layout's rows of every round as one: the round whose measured / predicted step time
    is the median (the lower middle of an even count), with every round's ratio
    (`round_ratios`, and as text for table.csv: `rounds`), the model states exact only if
    they were in every round, and the quiet ratio (`quiet_ratio`): the least measured step
    of any round (`quiet_meas_s`) over the median of the rounds' predictions
    (`median_pred_s`, each from its own round's hardware). A neighbour's load only adds time
    to a step, so the least step is the quiet machine's; a calibration's errors go either
    way (a burst caught in a GEMM's tenth of a second, a slow spell under one shape tilting
    the layer's fit), so its median is the estimate an outlier does not move (the least
    prediction, used up to ea4c05c, took the most optimistic calibration)."""
    if any("error" in r for r in rows):
        return next(r for r in rows if "error" in r)
    ratios = [r["time_ratio"] for r in rows]
    middle = sorted(range(len(rows)), key=ratios.__getitem__)[(len(rows) - 1) // 2]
    quiet_meas = min(r["time_meas_s"] for r in rows)
    median_pred = statistics.median(r["time_pred_s"] for r in rows)
    return {**rows[middle], "ms_exact": all(r["ms_exact"] for r in rows),
            "calls_exact": _all_known(r.get("calls_exact") for r in rows),
            "round": middle + 1, "round_ratios": ratios,
            "rounds": " ".join(f"{x:.3f}" for x in ratios),
            "quiet_meas_s": quiet_meas, "median_pred_s": median_pred,
            "quiet_ratio": quiet_meas / median_pred}


def load_line(load: dict, cpus: int) -> str:
    return ("Load average (1, 5, 15 min) before "
            f"{', '.join(f'{x:.2f}' for x in load['before'])}, after "
            f"{', '.join(f'{x:.2f}' for x in load['after'])} ({cpus} CPUs).")


def steal_line(ranks: list[dict]) -> str:
    """' CPU time stolen ...' by world size over the rounds (run.json's "ranks": each
    round's worlds, their "steal" shares), '' where the run did not record it."""
    by_world = {}
    for world in ranks:
        if world.get("steal") is not None:
            by_world.setdefault(world["world"], []).append(world["steal"])
    if not by_world:
        return ""
    return " CPU time the hypervisor gave other guests (steal) while the layouts ran: " + \
        ", ".join(f"{w} rank{'s' if w > 1 else ''} {min(x) * 100:.1f}-{max(x) * 100:.1f}%"
                  for w, x in sorted(by_world.items())) + " over the rounds."


def rerender(run_json, out) -> None:
    """An earlier run's tables again, from its `run_json` (each round's hardware, refitted
    from its raw measurements by this code's fits (`measure.refit`), and every rank's
    figures; nothing is run), with this code's model, into `out`: what a change of the model
    or of the judgement does to a committed validation. The new run.json keeps the
    measurements and names the run they came from."""
    from zmpi.plan.hardware import Hardware
    from zmpi.plan.measure import refit

    sys.path.insert(0, str(HERE))
    from results import write_results

    source = json.loads(Path(run_json).read_text())
    origin = source.get("measured", source)  # a rerendered run.json names its measurement
    hardware = [refit(Hardware.from_dict(h)) for h in source["hardware"]]
    # each round's worlds measured on their own ranks (runs before 2026-11-27 have none)
    on_ranks = [{int(w): refit(Hardware.from_dict(h)) for w, h in r.items()}
                for r in source.get("hardware_on_ranks") or [{} for _ in hardware]]
    rounds = [[compare(item, on_ranks[k].get(world["world"], hw))
               for world in source["ranks"] if world["round"] == k + 1
               for item in world["layouts"]] for k, hw in enumerate(hardware)]
    rows = [median_round(list(same)) for same in zip(*rounds, strict=True)]
    mpi = " ".join(origin["environment"]["mpi_library"].replace("\0", "").splitlines()[0].split())
    lines = markdown(rows, types.SimpleNamespace(**source["args"]), hardware, on_ranks) + [
        "", f"Measured at {origin['git_revision']} on {origin['time']} ({mpi}); the tables "
        "made from its run.json by this revision (`validate_plan.py --rerender`).", "",
        load_line(source["load"], hardware[0].cores_per_node) + steal_line(source["ranks"])]
    print("\n".join(lines))
    write_results(out, rows, lines, types.SimpleNamespace(size=source["world_size"]),
                  argv=sys.argv, args=source["args"], hardware=[h.to_dict() for h in hardware],
                  hardware_on_ranks=on_ranks_json(on_ranks),
                  load=source["load"], ranks=source["ranks"], seconds=source["seconds"],
                  measured={k: origin[k] for k in ("git_revision", "time", "environment",
                                                   "argv")})
    print(f"wrote {out}/table.md, table.csv, run.json")

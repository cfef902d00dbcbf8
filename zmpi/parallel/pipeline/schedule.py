"""Pipeline schedules: the order in which stage s of p runs forward (F) and backward (B) of m
micro-batches in one training step, and the timeline that order makes.

    ops = schedule("1f1b", stage=0, stages=4, micro_batches=8)   # [("F", 0), ("F", 1), ...]
    in_flight("1f1b", stage=0, stages=4, micro_batches=8)        # 4: p - s micro-batches held
    t = timeline("1f1b", stages=4, micro_batches=8, forward_s=1.0, backward_s=2.0)
    t.bubble            # idle fraction of the step: (p - 1) / (m + p - 1) for uniform units
    t.peak_in_flight    # per stage: micro-batches whose activations are held at once

GPipe (Huang et al. 2019) runs every forward, then every backward: a stage holds the
activations of all m micro-batches. 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs p - s - 1
forwards to fill the pipeline, then alternates one forward and one backward, then drains: the
same bubble, but stage s holds at most p - s micro-batches. Both run the backwards in
micro-batch order. A stage's forward of micro-batch i needs the previous stage's forward of
i, and its backward needs the next stage's backward of i (the last stage's, its own forward).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


def schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """Stage `stage`'s ops in order: ("F", i) or ("B", i) for micro-batch i."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    if not 0 <= stage < stages or micro_batches < 1:
        raise ValueError(f"stage {stage} of {stages} with {micro_batches} micro-batches")
    m = micro_batches
    forwards = [("F", i) for i in range(m)]
    backwards = [("B", i) for i in range(m)]
    if name == "gpipe":
        return forwards + backwards
    warmup = min(stages - stage - 1, m)
    ops = forwards[:warmup]
    for i in range(m - warmup):  # steady state: one forward, one backward
        ops += [forwards[warmup + i], backwards[i]]
    return ops + backwards[m - warmup:]


def in_flight(name: str, stage: int, stages: int, micro_batches: int) -> int:
    """The most micro-batches stage `stage` holds at once (forwarded, not yet backwarded):
    m under GPipe, min(p - s, m) under 1F1B."""
    return _peak(schedule(name, stage, stages, micro_batches))


def _peak(ops) -> int:
    """The most micro-batches forwarded and not yet backwarded at once in `ops`, in order
    (each starts with "F" or "B")."""
    held = peak = 0
    for op, *_ in ops:
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak


@dataclass
class Timeline:
    """When each op of each stage ran: spans[s] = [(op, micro-batch, start, end)]."""

    spans: list[list[tuple[str, int, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for ops in self.spans for *_, end in ops)

    @property
    def bubble(self) -> float:
        """The idle fraction of all stages over the step."""
        busy = sum(end - start for ops in self.spans for *_, start, end in ops)
        return 1.0 - busy / (len(self.spans) * self.makespan)

    @property
    def peak_in_flight(self) -> list[int]:
        """Per stage: the most micro-batches forwarded and not yet backwarded at once."""
        return [_peak(ops) for ops in self.spans]


def timeline(name: str, stages: int, micro_batches: int, forward_s=1.0,
             backward_s=2.0) -> Timeline:
    """Run the schedule on unit times: `forward_s` / `backward_s` are one micro-batch's
    forward and backward time on a stage (a number, or a list per stage). Each stage runs its
    ops in order, each as soon as its input has arrived (communication taken as free)."""
    def per_stage(t):
        return list(t) if isinstance(t, (list, tuple)) else [t] * stages

    fwd, bwd = per_stage(forward_s), per_stage(backward_s)
    ops = [schedule(name, s, stages, micro_batches) for s in range(stages)]
    done = {}  # (op, stage, micro-batch) -> end time
    spans = [[] for _ in range(stages)]
    nxt, clock = [0] * stages, [0.0] * stages
    while any(nxt[s] < len(ops[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while nxt[s] < len(ops[s]):
                op, i = ops[s][nxt[s]]
                need = (("F", s - 1, i) if s > 0 else None) if op == "F" else \
                    (("B", s + 1, i) if s < stages - 1 else ("F", s, i))
                if need is not None and need not in done:
                    break
                start = max(clock[s], done[need] if need else 0.0)
                clock[s] = start + (fwd[s] if op == "F" else bwd[s])
                done[(op, s, i)] = clock[s]
                spans[s].append((op, i, start, clock[s]))
                nxt[s] += 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above; a guard, not a hang
            raise RuntimeError(f"schedule {name!r} deadlocks at p = {stages}, "
                               f"m = {micro_batches}")
    return Timeline(spans)


def bubble_formula(stages: int, micro_batches: int) -> float:
    """GPipe's and 1F1B's idle fraction with uniform stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)

"""Where a train_step's time goes: per phase and per unit, and which rank is the critical one.

    engine.phases.table(comm)          # every rank's ms per step per phase (a collective)
    engine.phases.critical_path(comm)  # (rank, exposed communication, imbalance) per step
"""
from __future__ import annotations

import time


class PhaseProfile:
    """Seconds per phase of train_step, summed over steps: forward, backward (compute plus the
    strategy's hooks), step (reductions, optimizer, publishing), and within them the time
    blocked in MPI (`waited`; on the critical rank, exposed communication, see
    `critical_path`) and in the optimizer; and per unit, the seconds of its forward and
    backward (hooks included: a stage-3 gather shows in its unit) and the MPI waits within
    them. Host time: on a GPU nothing is synchronised for it, so
    device work shows in the phase that next waits for it; a delayed (DPU) update counts only
    where the step waits for it. The first step (compiling the host loops, first touch of
    every buffer) is left out of the figures once there are others. `recompute_seconds`
    ({unit: seconds}, what activation_checkpointing.profile measures: zmpi.nn.checkpointing)
    shows as each unit's "recompute", a part of its backward; "-" where no recompute of the
    unit was timed (none, or selective recompute, which runs inside the attention's backward
    and shows there)."""

    PHASES = ("forward", "backward", "step", "optimizer", "waited")
    UNIT_PHASES = ("forward", "backward", "waited", "recompute")

    def __init__(self, unit_names=(), recompute_seconds=None):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.unit_names = list(unit_names)
        self.units = [dict.fromkeys(self.UNIT_PHASES, 0.0) for _ in self.unit_names]
        self.recompute_seconds = {} if recompute_seconds is None else recompute_seconds
        self.steps = 0
        self._first = None  # (seconds, units) at the end of the first step
        self._unit_start = (0.0, 0.0)

    def clock(self):
        return _Clock(self)

    def unit_begins(self) -> None:
        from zmpi.comm import waited_seconds

        self._unit_start = (time.perf_counter(), waited_seconds())

    def unit_ends(self, u: int, phase: str) -> None:
        from zmpi.comm import waited_seconds

        start, waited = self._unit_start
        self.units[u][phase] += time.perf_counter() - start
        self.units[u]["waited"] += waited_seconds() - waited

    def critical_path(self, comm) -> tuple[int, float, float]:
        """(rank, exposed, imbalance), seconds per step (a collective). The critical rank is
        the one busy longest (forward + backward + step less its MPI waits): it never waits
        for a slower rank, so its waits are the communication the step did not hide. What
        other ranks wait beyond that, up to `imbalance`, is waiting for the critical rank's
        compute (load imbalance, or a busy core), not for the network."""
        return self._critical(self._gather(comm))

    def step_ends(self) -> None:
        for u, seconds in self.recompute_seconds.items():
            self.units[u]["recompute"] = seconds
        self.steps += 1
        if self.steps == 1:
            self._first = (dict(self.seconds), [dict(unit) for unit in self.units])

    def counted(self) -> tuple[int, dict, list]:
        """(steps, seconds, units) of the steps counted: all but the first when there were
        more."""
        if self.steps < 2:
            return self.steps, dict(self.seconds), self.units
        seconds, units = self._first
        return (self.steps - 1, {p: self.seconds[p] - seconds[p] for p in self.PHASES},
                [{p: now[p] - then[p] for p in self.UNIT_PHASES}
                 for now, then in zip(self.units, units, strict=True)])

    def _gather(self, comm) -> list:
        return comm.allgather_object((comm.rank, *self.counted()))

    @staticmethod
    def _critical(rows) -> tuple[int, float, float]:
        per = [(rank, (s["forward"] + s["backward"] + s["step"] - s["waited"]) / max(steps, 1),
                s["waited"] / max(steps, 1)) for rank, steps, s, _ in rows]
        rank, _, exposed = max(per, key=lambda r: r[1])
        return rank, exposed, max(w for _, _, w in per) - exposed

    def table(self, comm) -> str:
        """Every rank's milliseconds per step per phase, the critical path, then per unit the
        slowest rank's (a collective)."""
        rows = self._gather(comm)
        lines = [f"{'rank':>4} " + " ".join(f"{p + ' ms':>13}" for p in self.PHASES)
                 + f" {'waited share':>13}"]
        for rank, steps, s, _ in rows:
            per = {p: 1e3 * s[p] / max(steps, 1) for p in self.PHASES}
            total = per["forward"] + per["backward"] + per["step"]
            lines.append(f"{rank:>4} " + " ".join(f"{per[p]:>13.1f}" for p in self.PHASES)
                         + f" {100 * per['waited'] / max(total, 1e-9):>12.1f}%")
        rank, exposed, imbalance = self._critical(rows)
        lines.append(f"critical path: rank {rank} (busy longest); its waits, "
                     f"{1e3 * exposed:.1f} ms/step, are exposed communication; other ranks "
                     f"wait up to {1e3 * imbalance:.1f} ms/step more for its compute")
        if self.unit_names:
            w = max(map(len, self.unit_names))
            lines.append(f"{'unit':>4} {'':<{w}}" + " ".join(f"{p + ' ms':>13}"
                                                          for p in self.UNIT_PHASES))
            for u, name in enumerate(self.unit_names):
                worst = {p: max(1e3 * units[u][p] / max(steps, 1) for _, steps, _, units in rows)
                         for p in self.UNIT_PHASES}
                timed = {p: f"{worst[p]:.1f}" for p in self.UNIT_PHASES}
                if not any(units[u]["recompute"] for _, _, _, units in rows):
                    timed["recompute"] = "-"
                lines.append(f"{u:>4} {name:<{w}}"
                             + " ".join(f"{timed[p]:>13}" for p in self.UNIT_PHASES))
        return "\n".join(lines)


class _Clock:
    def __init__(self, profile):
        from zmpi.comm import waited_seconds

        self.profile, self.waited_seconds = profile, waited_seconds
        self.last, self.waited = time.perf_counter(), waited_seconds()

    def lap(self, phase, optimizer=0.0):
        now, waited = time.perf_counter(), self.waited_seconds()
        s = self.profile.seconds
        s[phase] += now - self.last
        s["waited"] += waited - self.waited
        s["optimizer"] += optimizer
        self.last, self.waited = now, waited
        if phase == "step":
            self.profile.step_ends()

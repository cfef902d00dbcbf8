"""The checks that every rank of a communicator makes the same MPI calls: the debug collective
check (`check_call` before each collective when `Comm.enable_collective_checks` is on, and
`check_at_exit`; a `CollectiveMismatch` names each rank's call and where it was made), and
the check that the ranks' settings that decide which calls they make are alike
(`check_settings_alike`, at each Comm's construction; a `SettingsDiffer`).

Nothing here imports the communicator: the helpers take the Comm as an argument.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI  # zmpi.comm imported zmpi.backend before this (MPI_Init)

from zmpi.comm.faults import _FORWARD_S, SettingsDiffer, _abort, _run_at_abort
from zmpi.comm.watchdog import _call_site, _watched


class CollectiveMismatch(RuntimeError):
    """The ranks of a communicator called different collectives (debug check)."""


def check_call(comm, op: str, dtype=None, counts=(), site=None) -> None:
    """The debug check (`Comm.enable_collective_checks`): every rank's (index, op, dtype,
    counts) on `comm`, compared; CollectiveMismatch on every rank if they differ."""
    comm._calls += 1
    mine = (comm._calls, op, None if dtype is None else str(np.dtype(dtype)),
            tuple(int(c) for c in counts))
    with _watched(f"the collective check of {op} ({comm.size} ranks)"):
        everyone = comm.mpi.allgather((mine, site or _call_site()))
    if any(call != everyone[0][0] for call, _ in everyone):
        lines = [f"rank {r}: call #{c[0]} {c[1]}"
                 + (f" {c[2]} x {'/'.join(map(str, c[3]))}" if c[2] else "") + f" at {site}"
                 for r, (c, site) in enumerate(everyone)]
        raise CollectiveMismatch("the ranks called different collectives on a "
                                 f"{comm.size}-rank communicator:\n  " + "\n  ".join(lines))


def check_at_exit(comm) -> None:
    """At exit (atexit, world communicator): a rank that ends the program while another
    waits in a collective is reported as a mismatch, and the job aborted."""
    if MPI.Is_finalized():
        return
    try:
        comm._start_queued()  # the check is a collective: after what is queued
        check_call(comm, "end of program", site="exit")
    except CollectiveMismatch as e:
        _run_at_abort()
        sys.stderr.write(f"[rank {comm.rank}] {e}\n")
        sys.stderr.flush()
        time.sleep(_FORWARD_S)
        _abort(4)



def check_settings_alike(mpi_comm, settings: dict[str, bool]) -> None:
    """Collective (one small allreduce): every rank of `mpi_comm` has the same `settings`
    ({name: value}), those that decide which MPI calls a rank makes. A rank that differed
    would make calls its peers do not (a blocking collective against a non-blocking one, an
    extra allgather per collective) and hang them; instead a SettingsDiffer (a RuntimeError)
    on every rank names what differs."""
    mine = np.array(list(settings.values()), np.int32)
    both = np.concatenate([mine, -mine])  # one MAX gives the max and (negated) the min
    with _watched(f"the settings check ({mpi_comm.Get_size()} ranks)"):
        mpi_comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
    differ = [name for name, high, low in zip(settings, both[:len(mine)], -both[len(mine):],
                                              strict=True) if high != low]
    if differ:
        raise SettingsDiffer(f"zmpi: the ranks disagree on {' and '.join(differ)}; set it "
                             "alike on every rank (each node's environment and GPUs)",
                             mpi_comm.Get_rank() == 0)

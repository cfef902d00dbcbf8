"""What happens when a run goes wrong under MPI: abort on an uncaught exception (ending the
job's other ranks on this host too), Ctrl-C, and `fail_alone` (one rank's error, said once).
The watchdog over every blocking MPI wait is zmpi.comm.watchdog's; the debug collective check
and the check that the ranks' settings are alike are zmpi.comm.checks'; both end the job
through `_abort` here.

With more than one rank, `Comm()` installs `install_abort_on_exception()`: an uncaught
exception on any rank prints its traceback (tagged with the rank) and aborts the whole job,
instead of leaving the other ranks waiting forever in their next collective (MPICH's
behaviour under a plain `mpiexec -n K python script.py`). Every abort in zmpi (that, the
watchdog, Ctrl-C, the debug check at exit) calls MPI_Abort, then SIGKILLs the job's other
ranks on the aborting rank's host, stopped (SIGSTOP) ones too, waits up to a second for them
to die, and exits: MPICH 5.0's MPI_Abort returns and leaves the killing to the process
manager, whose mpiexec returns before its proxies have ended the ranks, and a proxy that
cannot act then leaves them behind (`_abort`). Ranks on other hosts are left to the
launcher. Only processes that the first `Comm()` on COMM_WORLD found to be ranks of this job
on this host (same boot, pid namespace, pid and start time; a pidfd held on each) are ever
signalled.

Nothing here imports the communicator.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from mpi4py import MPI  # zmpi.comm imported zmpi.backend before this (MPI_Init)

_abort_installed = False
# mpiexec forwards a rank's output asynchronously and drops what is in flight when the job is
# aborted: a rank that has something to say waits this long before it calls MPI_Abort.
_FORWARD_S = 0.25


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of process `pid` from /proc, or
    None where there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in (), may hold anything
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _identity() -> tuple | None:
    """What another rank needs to end this process, and only it: (boot id, pid namespace,
    pid, start time); None where /proc does not say (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    stat = _proc_stat(os.getpid())
    return None if stat is None else (boot, namespace, os.getpid(), stat[1])


_PEERS: list = []  # [(pid, start time, pidfd or None)]: this job's other ranks on this host
_PEERS_ASKED = False  # the first Comm on COMM_WORLD gathers them (collective, once)


def _set_peers(identities) -> None:
    """Remember, of the ranks' `_identity()`s, those of other processes on this machine in this
    pid namespace, each with a pidfd (Linux 5.3+) opened on it and checked against its start
    time, so a later signal can reach only that process, never a pid reused since."""
    global _PEERS_ASKED
    _PEERS_ASKED = True
    mine = _identity()
    if mine is None:
        return
    for other in identities:
        if other is None or other[:2] != mine[:2] or other[2] == mine[2]:
            continue
        pid, start, fd = other[2], other[3], None
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pass  # checked against the start time again before each signal
        stat = _proc_stat(pid)
        if stat is None or stat[1] != start:  # already gone: not that process
            if fd is not None:
                os.close(fd)
            continue
        _PEERS.append((pid, start, fd))


def gather_peers(local) -> None:
    """Once per process, collective over `local` (COMM_WORLD's node-local group): remember
    whom an abort ends on this host."""
    if not _PEERS_ASKED:
        _set_peers(local.allgather(_identity()))


def _end_local_peers(wait: float = 1.0) -> None:
    """SIGKILL this job's other ranks on this host (those `_set_peers` found; SIGKILL ends a
    stopped process too) and wait up to `wait` seconds for them to die; never raises. Of two
    ranks aborting at once each may end the other: both have handed their abort to mpiexec
    by then (`_abort`), so the job's exit code stays the abort's."""
    try:
        for pid, start, fd in _PEERS:
            try:
                if fd is not None:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                elif (_proc_stat(pid) or ("", None))[1] == start:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # it has ended already
        deadline = time.monotonic() + wait
        for pid, start, _ in _PEERS:
            while time.monotonic() < deadline:
                stat = _proc_stat(pid)
                if stat is None or stat[1] != start or stat[0] in "ZX":
                    break
                time.sleep(0.005)
    except Exception:  # the process is ending: nothing may stop that
        pass


_AT_ABORT: list = []  # what an abort runs before MPI_Abort (at_abort)


def at_abort(fn) -> None:
    """Have every abort in zmpi call fn() before MPI_Abort, which skips `close()`,
    finalizers and atexit, and before this rank ends its peers: the NVMe tier registers the
    removal of its swap files, its own and those of the job's other ranks on this host
    (`local_peer_pids`), which are killed without a chance to (zmpi.offload.files). fn must
    be quick and safe to call more than once (a weakref.finalize is); its errors are
    ignored. Finalizers that have run are dropped at the next registration."""
    _AT_ABORT[:] = [f for f in _AT_ABORT if getattr(f, "alive", True)]
    _AT_ABORT.append(fn)


def _run_at_abort() -> None:
    """Run the `at_abort` hooks (they remove the swap files of this rank and of its peers on
    this host); never raises. Every path to an abort calls this before it waits for anything
    (a rank's output to be forwarded, rank 0's line after Ctrl-C, the other ranks' watchdog
    lines): the first rank's abort reaches mpiexec, whose proxies kill the ranks of every
    host, a waiting one with its files, so a wait before the removal left another host's
    swap files behind. Each hook runs once: an abort path that calls this before its wait
    and again in `_abort` finds none left the second time."""
    hooks, _AT_ABORT[:] = list(_AT_ABORT), []
    for fn in hooks:
        try:
            fn()
        except Exception:  # the job is being aborted: nothing may stop that
            pass


def local_peer_pids() -> list[int]:
    """The pids of this job's other ranks on this host (those an abort ends)."""
    return [pid for pid, _, _ in _PEERS]


def _abort(code: int) -> None:
    """End the whole job with exit code `code`; never returns.

    MPI_Abort(COMM_WORLD) first: it hands the abort, and so the job's exit code, to mpiexec.
    MPICH 5.0 then returns, leaving every process to be ended by its process manager: Hydra's
    mpiexec returns as soon as the abort reaches it, and its per-host proxies SIGKILL the
    ranks (each in a session of its own) only after that, or never where a proxy is stopped
    or gone by then (a batch system ending mpiexec's process group): a rank stopped with
    SIGSTOP stayed behind for ever, and the aborting rank ran on. So this rank then SIGKILLs
    the job's other ranks on its host itself (`_end_local_peers`; ranks on other hosts are left
    to the launcher) and ends with os._exit(code). An MPI whose MPI_Abort ends the calling
    process itself leaves the peers to its launcher, as before. The `at_abort` hooks run
    first (`_run_at_abort`; every caller that waits before it aborts has run them before
    that wait already)."""
    _run_at_abort()
    MPI.COMM_WORLD.Abort(code)
    _end_local_peers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # ending anyway
            pass
    os._exit(code)


def fail_alone(message: str, code: int) -> None:
    """End the job for a failure of this rank's own that its peers cannot know of (its swap
    file failed a read in a step): `message` as one line on stderr, tagged with the rank
    under several, then the job aborted (`_abort`: the at_abort hooks remove this rank's
    swap files and what its peers on this host leave); one rank exits with `code`. Never
    returns."""
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(code)
    _run_at_abort()
    sys.stdout.flush()
    sys.stderr.write(f"[rank {world.Get_rank()}] {message}; aborting the MPI job\n")
    sys.stderr.flush()
    time.sleep(_FORWARD_S)
    _abort(code)


class SettingsDiffer(RuntimeError):
    """The ranks' settings differ (zmpi.comm.checks.check_settings_alike): raised on every
    rank of the communicator alike, so an uncaught one is said once, by its rank 0
    (`said_here`), not as a traceback per rank."""

    def __init__(self, message: str, said_here: bool = True):
        super().__init__(message)
        self.said_here = said_here


def install_abort_on_exception():
    """Make an uncaught exception on any rank print its traceback and abort the MPI job.

    Wraps `sys.excepthook` (once per process): prints the traceback with every line tagged
    `[rank r]` to stderr, then calls `MPI.COMM_WORLD.Abort(1)`, so the other ranks do not
    wait forever in their next collective. Equivalent to launching with `python -m mpi4py`.
    Every abort in zmpi then SIGKILLs the job's other ranks on this host and exits (`_abort`).
    A KeyboardInterrupt (Ctrl-C, which mpiexec forwards to every rank) prints one line on
    rank 0 instead of a traceback per rank, and aborts with exit code 130; a SettingsDiffer
    (raised alike on every rank) prints its message once, on rank 0, and aborts (exit 1).
    """
    global _abort_installed
    if _abort_installed:
        return
    previous = sys.excepthook

    def abort_hook(exc_type, exc, tb):
        if MPI.Is_finalized() or not MPI.Is_initialized():
            return previous(exc_type, exc, tb)
        world = MPI.COMM_WORLD
        if issubclass(exc_type, KeyboardInterrupt):
            _interrupted()
        _run_at_abort()
        if issubclass(exc_type, SettingsDiffer):  # its ranks all raised it: one line
            _say_once(str(exc), exc.said_here)
            _abort(1)
        tag = f"[rank {world.Get_rank()}] "
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        lines = [f"uncaught exception on rank {world.Get_rank()} of {world.Get_size()}, "
                 "aborting the MPI job", *text.rstrip("\n").split("\n")]
        try:
            sys.stdout.flush()
            sys.stderr.write("".join(tag + line + "\n" for line in lines))
            sys.stderr.flush()
            time.sleep(_FORWARD_S)
        finally:
            _abort(1)

    sys.excepthook = abort_hook
    _abort_installed = True
    if threading.current_thread() is threading.main_thread():
        _watch_interrupts()


_INTERRUPT = threading.Lock()


def _interrupted():
    """Ctrl-C reached this rank (mpiexec forwards it to every rank): the `at_abort` hooks run
    at once (this rank's swap files go before any wait), rank 0 says so in one line, the
    others give it a second to do that, and the job is aborted (exit code 130).
    Once per process (the main thread and the watcher thread may both get here)."""
    if not _INTERRUPT.acquire(blocking=False):
        time.sleep(60)  # the other caller is aborting the job
        return
    _run_at_abort()  # before the wait: another host's abort may kill this rank during it
    world = MPI.COMM_WORLD
    _say_once(f"zmpi: interrupted; ending all {world.Get_size()} ranks", world.Get_rank() == 0)
    _abort(130)


def _say_once(line: str, here: bool) -> None:
    """Before an abort that every rank makes alike: the one rank `here` writes `line` to
    stderr and gives mpiexec time to forward it; the others give it a second to do that."""
    if here:
        sys.stdout.flush()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        time.sleep(_FORWARD_S)
    else:
        time.sleep(1.0)


def _watch_interrupts():
    """Act on SIGINT even while the main thread is blocked inside MPI (where Python cannot
    raise KeyboardInterrupt): the C-level handler writes the signal number to a pipe
    (`signal.set_wakeup_fd`) that a daemon thread reads. By design any SIGINT ends a
    multi-rank job, even where the program catches KeyboardInterrupt: one rank surviving
    Ctrl-C would leave the others waiting."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch():
        while True:
            if signal.SIGINT in os.read(read_fd, 64):
                _interrupted()

    threading.Thread(target=watch, name="zmpi-interrupts", daemon=True).start()

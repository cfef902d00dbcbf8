"""What happens when a run goes wrong under MPI: abort on an uncaught exception (ending the
job's other ranks on this host too), Ctrl-C, the watchdog over every blocking MPI wait
(`_watched`, and `waited_seconds`), the debug collective check (`CollectiveMismatch`,
`check_call`, `check_at_exit`), and the check that the ranks' settings are alike
(`check_settings_alike`, at each Comm's construction).

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

Nothing here imports the communicator: the check helpers take the Comm as an argument.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
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
    swap files behind."""
    for fn in list(_AT_ABORT):
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


class CollectiveMismatch(RuntimeError):
    """The ranks of a communicator called different collectives (debug check)."""


_COMM_PACKAGE = os.path.dirname(os.path.abspath(__file__))  # zmpi/comm
_PACKAGE = os.path.dirname(_COMM_PACKAGE)  # zmpi


def _call_site(frame=None) -> str:
    """Where a collective was called from `frame`'s stack (default: this call's): the
    innermost frame outside this package (zmpi.comm), and the innermost outside the zmpi
    package (the user's line), as 'file:line in function (from file:line in function)'."""
    def describe(f):
        path = os.path.relpath(f.f_code.co_filename)
        path = f.f_code.co_filename if path.startswith("..") else path
        return f"{path}:{f.f_lineno} in {f.f_code.co_name}"

    frame = frame or sys._getframe(1)
    inner = user = None
    while frame is not None and user is None:
        name = frame.f_code.co_filename
        if inner is None and not os.path.abspath(name).startswith(_COMM_PACKAGE + os.sep) \
                and not name.endswith("contextlib.py"):
            inner = frame
        if not os.path.abspath(name).startswith(_PACKAGE + os.sep):
            user = frame
        frame = frame.f_back
    if inner is None:
        return "?"
    return describe(inner) + (f" (from {describe(user)})" if user not in (None, inner) else "")


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



class _Watchdog:
    """Aborts the job when this process waits in one collective longer than `timeout` seconds.

    A daemon thread sleeps and checks the waits in progress (no spinning); on expiry it prints,
    tagged with the rank, which collective is waited for and where it was called, gives the
    other waiting ranks two seconds to say the same, and calls MPI_Abort (the `at_abort`
    hooks run before those two seconds).
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._waits = {}  # token -> (what, frame, start)
        self._thread = threading.Thread(target=self._run, name="zmpi-watchdog", daemon=True)
        self._thread.start()

    def begin(self, what, frame) -> object:
        token = object()
        self._waits[token] = (what, frame, time.monotonic())
        return token

    def end(self, token) -> None:
        del self._waits[token]

    def _run(self):
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            # no loop variable may hold a frame between checks: a frame keeps its locals,
            # and so the buffers of a finished collective, alive
            for what, frame, waited in [(w, f, now - s) for w, f, s in list(self._waits.values())
                                        if now - s > self.timeout]:
                self._expire(what, frame, waited)

    @staticmethod
    def _expire(what, frame, waited):
        site = _call_site(frame)
        what = what() if callable(what) else what
        world = MPI.COMM_WORLD
        _run_at_abort()  # before the wait for the other ranks' lines (`_run_at_abort`)
        sys.stderr.write(f"[rank {world.Get_rank()}] zmpi watchdog: waited {waited:.0f} s "
                         f"(ZMPI_COLLECTIVE_TIMEOUT) in {what}, called at {site}; a rank "
                         "that does not call it (or hangs before it) stops the job; "
                         "aborting\n")
        sys.stderr.flush()
        time.sleep(2.0)
        _abort(3)


_WATCHDOG = None


def _watchdog():
    """The process's watchdog (ZMPI_COLLECTIVE_TIMEOUT seconds, default 1800; 0: none)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        text = os.environ.get("ZMPI_COLLECTIVE_TIMEOUT", "1800").strip()
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"ZMPI_COLLECTIVE_TIMEOUT={text!r}: expected seconds") from None
        _WATCHDOG = _Watchdog(timeout) if timeout > 0 else False
    return _WATCHDOG


_WAITED = [0.0]  # seconds this process spent blocked in MPI (every communicator)


def waited_seconds() -> float:
    """Seconds this process has spent blocked in MPI so far: blocking collectives and
    point-to-point messages, and waits for non-blocking ones (exposed communication, for
    profiles)."""
    return _WAITED[0]


class SettingsDiffer(RuntimeError):
    """The ranks' settings differ (`check_settings_alike`): raised on every rank of the
    communicator alike, so an uncaught one is said once, by its rank 0 (`said_here`), not as
    a traceback per rank."""

    def __init__(self, message: str, said_here: bool = True):
        super().__init__(message)
        self.said_here = said_here


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


class _watched:  # noqa: N801 (used as a function-like context manager)
    """`with _watched(what):` around a blocking MPI wait (`what`: its name, or a callable
    that makes it, called only if the watchdog shows it): the watchdog's view of it (the frame
    of the function holding the `with` is kept for the call site; it is alive meanwhile), and
    the time it takes, added to `waited_seconds()`."""

    def __init__(self, what: str):
        self.what, self.dog, self.token = what, _watchdog(), None

    def __enter__(self):
        if self.dog:
            self.token = self.dog.begin(self.what, sys._getframe(1))
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        _WAITED[0] += time.perf_counter() - self.start
        if self.token is not None:
            self.dog.end(self.token)


"""The watchdog over every blocking MPI wait: `with _watched(what):` around a wait lets the
process's watchdog (ZMPI_COLLECTIVE_TIMEOUT seconds, default 1800; 0: none) abort the job
when it lasts longer, saying which wait and where it was called (`_call_site`), and adds the
time waited to `waited_seconds()` (exposed communication, for profiles). The abort is
zmpi.comm.faults'.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from mpi4py import MPI  # zmpi.comm imported zmpi.backend before this (MPI_Init)

from zmpi.comm.faults import _abort, _run_at_abort

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

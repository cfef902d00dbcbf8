"""The files of the NVMe tier: one rank's swap file, reserved whole, opened with O_DIRECT
where the filesystem allows it, removed on close, on collection, at exit or when the job is
aborted; and the 4 KiB-aligned host buffers direct I/O reads into and writes from
(zmpi.offload.nvme says what goes in them).

A swap directory is locked (an advisory `flock` on its `.zmpi-lock`, which names the process)
for as long as its process lives, however that ends, as a checkpoint directory is
(zmpi.checkpoint.ownership). A run killed with SIGKILL leaves its directory behind, unlocked:
the next SwapFile made under the same nvme_path removes it before it reserves its own file
(`remove_dead`), and says so on stderr, so a dead run's files cannot fill the drive. An
abort, which skips close() and atexit, removes this rank's directory and those of the job's
other ranks on this host, which it kills (zmpi.comm.faults.at_abort).
"""
from __future__ import annotations

import fcntl
import functools
import json
import mmap
import os
import shutil
import socket
import sys
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np

from zmpi import backend
from zmpi.offload.aio import AsyncIO

ALIGN = 4096  # bytes: what direct I/O needs of offsets, sizes and buffer addresses
_MiB = 2**20


class NVMeError(RuntimeError):
    """The NVMe tier cannot go on: its path, the free space, a failed read or write."""


def aligned_empty(numel: int, dtype, pinned: bool) -> np.ndarray:
    """A host array at a 4 KiB-aligned address, page-locked under CuPy if `pinned`, else
    anonymous memory (zeroed pages, resident once touched)."""
    if pinned and backend.is_gpu:
        arr = backend.pinned_empty(numel, dtype)
        if arr.ctypes.data % ALIGN == 0:
            return arr
    nbytes = numel * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype, count=numel)


PREFIX, LOCK = "zmpi-nvme-", ".zmpi-lock"


def _remove(fds: list, directory: str, lock) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)
    lock.close()  # after the removal: no other process may find the directory unlocked


def _locked(directory: Path):
    """The open lock file of swap directory `directory`, locked (exclusive, non-blocking),
    or None where another process holds it (or the directory is gone)."""
    try:
        f = open(directory / LOCK, "r+")  # noqa: SIM115 (held while the directory lives)
    except OSError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _holder(text: str) -> dict:
    """What a swap directory's lock file says of its process: pid, host, since ({} where it
    says nothing readable)."""
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def remove_dead(root: Path) -> list[str]:
    """Remove the swap directories under `root` whose process has ended without removing
    them (SIGKILL, a node's crash): those whose lock no process holds. Returns a line for
    each one removed. A directory being made is not yet named PREFIX* (SwapFile renames it
    once it is locked), so a live one is never taken for dead."""
    said = []
    for path in sorted(root.glob(PREFIX + "*")):
        lock = _locked(path)
        if lock is None:
            continue
        holder = _holder(lock.read())
        who = (f"pid {holder['pid']} on {holder['host']}, since {holder['since']}"
               if {"pid", "host", "since"} <= holder.keys() else "an unknown process")
        size = sum(f.stat().st_size for f in path.glob("*.bin"))
        shutil.rmtree(path, ignore_errors=True)
        lock.close()
        if not path.exists():
            said.append(f"removed {path}, the swap directory of a run that ended without "
                        f"removing it ({who}; {size / _MiB:,.1f} MiB)")
    return said


def drop_pages(fd: int, offset: int, nbytes: int) -> None:
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def sync_and_drop(fd: int, offset: int, nbytes: int) -> None:
    os.fdatasync(fd)
    drop_pages(fd, offset, nbytes)


def check_nvme_dir(nvme_path) -> Path:
    """`nvme_path` as a Path; NVMeError unless it is a directory this process can write in
    (a directory is made and removed there: root passes the permission check on /proc and
    on a read-only mount, and only trying finds them)."""
    root = Path(nvme_path)
    if not root.is_dir():
        raise NVMeError(f"nvme_path {root}: not a directory (create it on the NVMe drive)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise NVMeError(f"nvme_path {root}: not writable by this process")
    os.rmdir(_make_dir(root, ".zmpi-probe-"))
    return root


def _make_dir(root: Path, prefix: str) -> str:
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=root)
    except OSError as e:
        raise NVMeError(f"nvme_path {root}: cannot create a directory: "
                        f"{e.strerror or e}") from e


def _remove_peers_dirs(root: Path) -> None:
    """As the job is aborted: remove the swap directories under `root` that this job's other
    ranks on this host hold (their locks name them), which they cannot, being killed; their
    space is freed as they end."""
    from zmpi.comm.faults import local_peer_pids

    peers, host = set(local_peer_pids()), socket.gethostname()
    for path in root.glob(PREFIX + "*"):
        try:
            holder = _holder((path / LOCK).read_text())
        except OSError:
            continue
        if holder.get("host") == host and holder.get("pid") in peers:
            shutil.rmtree(path, ignore_errors=True)


class _RemoveOnAbort:
    """A SwapFile's `at_abort` hook: remove its directory by name, and nothing more. The
    descriptors stay open (the process ends within seconds, closing them): an abort runs its
    hooks before it waits (zmpi.comm.faults), while this process's other threads may still
    read and write the file, and a descriptor closed under them could be reused by another
    file they then write. Dropped from the hooks once the SwapFile is closed (`alive`)."""

    def __init__(self, finalizer, directory: str):
        self.finalizer, self.directory = finalizer, directory

    @property
    def alive(self) -> bool:
        return self.finalizer.alive

    def __call__(self) -> None:
        if self.finalizer.alive:
            shutil.rmtree(self.directory, ignore_errors=True)


def _make_locked_dir(root: Path) -> tuple[str, object]:
    """A new swap directory PREFIX* under `root`, and its lock file, held: made under a
    hidden name, locked, then renamed, so `remove_dead` never finds one unlocked."""
    made = _make_dir(root, "." + PREFIX)
    lock = None
    try:
        lock = open(Path(made) / LOCK, "w")  # noqa: SIM115 (held while the directory lives)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else has it
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        lock.flush()
        named = str(root / Path(made).name[1:])
        os.rename(made, named)
        return named, lock
    except OSError as e:
        shutil.rmtree(made, ignore_errors=True)
        if lock is not None:
            lock.close()
        raise NVMeError(f"nvme_path {root}: cannot create a directory: "
                        f"{e.strerror or e}") from e


class SwapFile:
    """One rank's file `name`.bin of `nbytes` under `nvme_path`, in a directory of its own,
    reserved whole. `need` is what the node's ranks need together, named in the error when
    the drive has less free space than this rank's `nbytes` (`what` names the data): the
    other ranks may have reserved theirs already, so a node-wide shortage is the reservation's
    error (ENOSPC). Removed by close(), on collection, at exit or before the job is aborted
    (zmpi.comm.faults.at_abort); a dead run's directories under `nvme_path` are removed first
    (`remove_dead`, the module's docstring)."""

    def __init__(self, nvme_path, nbytes: int, need: int, name: str = "optimizer",
                 what: str = "optimizer state"):
        from zmpi.comm.faults import at_abort

        root = check_nvme_dir(nvme_path)
        for line in remove_dead(root):
            print(f"zmpi: {line}", file=sys.stderr, flush=True)
        stat = os.statvfs(root)
        free = stat.f_bavail * stat.f_frsize
        if free < nbytes:
            raise NVMeError(f"nvme_path {root}: {free / _MiB:,.1f} MiB free, the {what} "
                            f"of this rank needs {nbytes / _MiB:,.1f} MiB (this node's ranks "
                            f"{need / _MiB:,.1f} MiB together)")
        self.dir, lock = _make_locked_dir(root)
        self.path, self._fds = Path(self.dir) / f"{name}.bin", []
        self._finalizer = weakref.finalize(self, _remove, self._fds, self.dir, lock)
        at_abort(_RemoveOnAbort(self._finalizer, self.dir))
        at_abort(functools.partial(_remove_peers_dirs, root))
        try:
            self.fd, self.direct = self._open(nbytes)
        except OSError as e:
            self.close()
            raise NVMeError(f"{self.path}: cannot reserve {nbytes / _MiB:,.1f} MiB: "
                            f"{e.strerror or e}") from e

    def _open(self, nbytes: int) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
        except OSError:  # EINVAL: the filesystem has no direct I/O (tmpfs); it may have
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)  # made the file already
            self._fds.append(fd)
            os.posix_fallocate(fd, 0, nbytes)
            return fd, False
        self._fds.append(fd)
        os.posix_fallocate(fd, 0, nbytes)
        probe = aligned_empty(ALIGN, np.uint8, False)
        try:  # some filesystems accept O_DIRECT at open and refuse the I/O
            os.pwritev(fd, [probe], 0)
            os.preadv(fd, [probe], 0)
        except OSError:
            self._fds.remove(fd)
            os.close(fd)
            fd = os.open(self.path, os.O_RDWR)
            self._fds.append(fd)
            return fd, False
        return fd, True

    def close(self) -> None:
        self._finalizer()


def open_on_every_rank(comm, build):
    """build() on every rank of `comm` (a collective): if it fails on any rank, every rank
    raises (the failing rank its own error, the others an NVMeError naming it) and no rank
    keeps what it built (its close() is called)."""
    built, error = None, None
    try:
        built = build()
    except Exception as e:  # handed to every rank below
        error = e
    messages = comm.allgather_object(None if error is None else str(error))
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        if built is not None:
            built.close()
        if error is not None:
            raise error
        raise NVMeError(f"the NVMe tier failed on rank {failed[0][0]}: {failed[0][1]}")
    return built


def wait_quietly(transfers) -> None:
    """Wait for every transfer, ignoring their errors: after another error, so that none may
    touch a buffer later."""
    for transfer in transfers:
        try:
            transfer.wait()
        except OSError:
            pass


class SwappedStore:
    """What both NVMe tiers share (nvme.py's NvmeOptimizerState, nvme_param.py's
    NvmeParamShard): building on every rank, the I/O threads, waiting for transfers, where
    the data lives, whether it may be used, and closing. A subclass sets `WHAT` (what it
    holds, for messages), `file` (a SwapFile, or None when everything fits in `max_in_cpu`),
    `io` (None until `_start_io`), `ledger`, `_closed`, `_broken` (None, or what broke it),
    `io_wait_s`, `_host_arrays()` (the host buffers it registered with the ledger) and
    `_where(...)` (what a transfer moved, for its error); its constructor takes
    `local_ranks` last."""

    WHAT = "the state"

    @classmethod
    def open(cls, comm, *args):
        """Build it on every rank of `comm` (a collective; `args` the constructor's but
        local_ranks, comm's ranks on this node): if it fails on any rank, every rank raises
        and no rank keeps a file (open_on_every_rank)."""
        return open_on_every_rank(comm, lambda: cls(*args, local_ranks=comm.local_size))

    def _start_io(self, aio) -> None:
        """The I/O threads of the `aio` config for `self.file` (without direct I/O, each
        request syncs and drops its pages)."""
        self.io = AsyncIO(aio.block_size, aio.queue_depth, aio.thread_count,
                          *(() if self.file.direct else (drop_pages, sync_and_drop)))

    def _finish(self, items, what: str) -> None:
        """Wait for (transfer, verb, *where) items; raise NVMeError for the first that failed,
        naming what it moved (`_where(*where)`). The wait counts in io_wait_s."""
        start, error = time.perf_counter(), None
        for transfer, verb, *where in items:
            try:
                transfer.wait()
            except OSError as e:
                error = error or NVMeError(
                    f"{what}: {verb} of {self._where(*where)} of {self.file.path} failed: "
                    f"{e.strerror or e}")
                error.__cause__ = error.__cause__ or e
        self.io_wait_s += time.perf_counter() - start
        if error is not None:
            raise error

    @property
    def direct(self) -> bool:
        """Whether the file bypasses the page cache (O_DIRECT)."""
        return self.file is not None and self.file.direct

    def where(self) -> str:
        return str(self.file.path) if self.file else "host memory (max_in_cpu)"

    def close(self) -> None:
        """Finish the I/O, remove the file and its directory, release the host buffers.
        Further use raises NVMeError."""
        self._closed = True
        if self.io is not None:
            self.io.close()
        if self.file is not None:
            self.file.close()
        for buf in self._host_arrays():
            if self.ledger is not None and self.ledger.holds(buf):
                self.ledger.release(buf)

    def _usable(self, rewriting: bool = False) -> None:
        if self._closed:
            raise NVMeError(f"{self.WHAT} on NVMe was closed (engine.close()); its files are "
                            "gone")
        if self._broken is not None and not rewriting:
            raise NVMeError(f"{self.WHAT} in {self.where()} is inconsistent since "
                            f"{self._broken}: load a checkpoint before training on")


"""The files of the NVMe tier: one rank's swap file, reserved whole, opened with O_DIRECT
where the filesystem allows it, removed on close, on collection or at exit; and the
4 KiB-aligned host buffers direct I/O reads into and writes from (zmpi.offload.nvme says what
goes in them).
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np

from zmpi import backend

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


def _remove(fds: list, directory: str) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)


def drop_pages(fd: int, offset: int, nbytes: int) -> None:
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def sync_and_drop(fd: int, offset: int, nbytes: int) -> None:
    os.fdatasync(fd)
    drop_pages(fd, offset, nbytes)


class SwapFile:
    """One rank's file `name`.bin of `nbytes` under `nvme_path`, in a directory of its own,
    reserved whole. `need` is what the node's ranks need together, named in the error when
    the drive has less free space than this rank's `nbytes` (`what` names the data): the
    other ranks may have reserved theirs already, so a node-wide shortage is the reservation's
    error (ENOSPC). Removed by close(), on collection or at exit."""

    def __init__(self, nvme_path, nbytes: int, need: int, name: str = "optimizer",
                 what: str = "optimizer state"):
        root = Path(nvme_path)
        if not root.is_dir():
            raise NVMeError(f"nvme_path {root}: not a directory (create it on the NVMe drive)")
        if not os.access(root, os.W_OK | os.X_OK):
            raise NVMeError(f"nvme_path {root}: not writable by this process")
        stat = os.statvfs(root)
        free = stat.f_bavail * stat.f_frsize
        if free < nbytes:
            raise NVMeError(f"nvme_path {root}: {free / _MiB:,.1f} MiB free, the {what} "
                            f"of this rank needs {nbytes / _MiB:,.1f} MiB (this node's ranks "
                            f"{need / _MiB:,.1f} MiB together)")
        try:
            self.dir = tempfile.mkdtemp(prefix="zmpi-nvme-", dir=root)
        except OSError as e:
            raise NVMeError(f"nvme_path {root}: cannot create a directory: "
                            f"{e.strerror or e}") from e
        self.path, self._fds = Path(self.dir) / f"{name}.bin", []
        self._finalizer = weakref.finalize(self, _remove, self._fds, self.dir)
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


class SwappedStore:
    """What both NVMe tiers share (nvme.py's NvmeOptimizerState, nvme_param.py's
    NvmeParamShard): where the data lives, whether it may be used, and closing. A subclass
    sets `WHAT` (what it holds, for messages), `file` (a SwapFile, or None when everything
    fits in `max_in_cpu`), `io`, `ledger`, `_closed`, `_broken` (None, or what broke it) and
    `_host_arrays()` (the host buffers it registered with the ledger)."""

    WHAT = "the state"

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


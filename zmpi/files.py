"""Files zmpi writes: checked before any work, written whole or not at all.

    out = check_output(args.out, "--out")    # ValueError, one line, unless a file can go there
    write_atomic(out, data)                  # a crash or a full disk leaves the old file or none
    with replacing(out) as tmp:              # the same for a writer that streams into `tmp`
        write_into(tmp)                      # (and fsyncs it)

Used by the checkpoint format (zmpi.checkpoint.store), `zmpi ckpt consolidate` and `zmpi plan`.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

_NOT_REGULAR = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def check_output(path, what: str) -> Path:
    """`path` as a Path if a regular file can be written there (replacing one that is there),
    else a ValueError, one line starting with `what` and `path`: an empty name, a directory, an
    existing file that is not a regular file (a device such as /dev/full, a FIFO, a socket, or
    a link to one: writing would destroy it, block, or make no file), no directory to write it
    in, or a directory in which this process cannot create a file (a read-only mount, no
    permission; probed with a file created and removed)."""
    if not str(path):
        raise ValueError(f"{what} needs a file name")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path}: a directory; give a file name")
    try:
        mode = path.stat().st_mode  # through a link: what a write would reach
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot be examined: {e.strerror}") from None
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")
        link = f" (a link to {path.resolve()})" if path.is_symlink() else ""
        raise ValueError(f"{what} {path}{link}: {kind}, not a regular file; give a file name")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: no directory {path.parent} to write it in")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".zmpi-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write in {parent}: {e.strerror}") from None
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: Path):
    """Yield `path`.tmp for the block to write (and fsync); then rename it over `path`, so a
    crash leaves the old file or the new one (fsync the directory to make the rename durable).
    If the block raises (a full disk, say), the
    temporary file is removed, `path` is untouched, and the error goes on (a clean-up that
    cannot remove it, as on a read-only mount where nothing was written, raises nothing)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one (and
    a failed write, e.g. a full disk, leaves the old one and no temporary file)."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)

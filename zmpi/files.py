"""Files zmpi reads and writes: checked before any work, written whole or not at all.

    path = check_input(args.config, "--config")  # ValueError, one line, unless a regular file
    out = check_output(args.out, "--out")    # ValueError, one line, unless a file can go there
    check_output_dir(args.log_dir, "--log-dir")  # the same for a directory of files
    write_atomic(out, data)                  # a crash or a full disk leaves the old file or none
    with replacing(out) as tmp:              # the same for a writer that streams into `tmp`
        write_into(tmp)                      # (and fsyncs it; a link is written through)

Used by the checkpoint format (zmpi.checkpoint.store), `zmpi ckpt consolidate`, `zmpi plan`, and
`zmpi train`'s --config, --data, --out and --log-dir.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

_NOT_REGULAR = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _NOT_REGULAR if test(mode)), "not a file")


def check_input(path, what: str) -> Path:
    """`path` as a Path if it is a regular file (through links), else a ValueError, one line
    starting with `what` (if any) and `path`: missing (a link: to a target that is missing), a
    directory, or a device (/dev/zero, /dev/urandom: reading it would never end), a FIFO (it
    would wait for a writer) or a socket, named by kind. The error of the read that follows
    (EACCES, EIO) is the caller's."""
    path = Path(path)
    what = f"{what} {path}" if what else str(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        link = f" (a link to {os.readlink(path)}, which does not exist)" \
            if path.is_symlink() else ""
        raise ValueError(f"{what}: not found{link}") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot be examined: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"{what}: a directory, not a file")
    if not stat.S_ISREG(mode):
        link = f" (a link to {path.resolve()})" if path.is_symlink() else ""
        raise ValueError(f"{what}{link}: {_kind(mode)}, not a regular file")
    return path


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
        link = f" (a link to {path.resolve()})" if path.is_symlink() else ""
        raise ValueError(f"{what} {path}{link}: {_kind(mode)}, not a regular file; give a "
                         "file name")
    parent = path.resolve().parent
    if not parent.is_dir():
        if path.is_symlink():  # dangling: the link's own directory is there
            raise ValueError(f"{what} {path}: a link to {os.readlink(path)}, whose directory "
                             f"{parent} does not exist")
        raise ValueError(f"{what} {path}: no directory {path.parent} to write it in")
    _probe(parent, f"{what} {path}")
    return path


def _probe(directory: Path, said: str) -> None:
    """ValueError `said: cannot write in directory: why` unless this process can create a
    file in `directory` (created and removed; root passes access(2) on a read-only mount or
    /proc, so only trying tells)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".zmpi-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{said}: cannot write in {directory}: {e.strerror}") from None


def check_output_dir(path, what: str) -> Path:
    """`path` as a Path if it is a directory this process can write files in, or one that
    `mkdir -p` could make (its nearest existing ancestor is a directory it can write in);
    else a ValueError, one line starting with `what` and `path`: a file there, or a place
    where nothing can be written (/proc, a read-only mount). Nothing is made but a probe,
    created and removed."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a directory")
    existing = Path(os.path.abspath(path))
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {path}: {existing} is a file, not a directory")
    _probe(existing, f"{what} {path}")
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
    A symbolic link is written through: the file it leads to is replaced (beside it), never
    the link itself (`zmpi ckpt consolidate CK /dev/stdout` replaced the link /dev/stdout).
    If the block raises (a full disk, say), the
    temporary file is removed, `path` is untouched, and the error goes on (a clean-up that
    cannot remove it, as on a read-only mount where nothing was written, raises nothing)."""
    path = Path(os.path.realpath(path))
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
    fsync_dir(tmp.parent)

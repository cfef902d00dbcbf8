"""Asynchronous file I/O for the NVMe tier: pread/pwrite requests on a pool of threads.

    io = AsyncIO(block_size=1 << 20, queue_depth=8, thread_count=1)
    t = io.read(fd, view, offset)   # view: a writable, contiguous uint8 array; a Transfer
    ...                             # compute meanwhile: the threads move the bytes
    t.wait()                        # the OSError of a failed request is raised here
    io.close()

DeepSpeed's `aio` section (libaio on Linux) maps onto this as follows: a transfer of one
buffer is cut into requests of `block_size` bytes; at most `queue_depth` requests are
submitted and not yet done (a submission beyond waits for one to finish); `thread_count`
threads issue them as `os.preadv` / `os.pwritev`, which release the GIL, so the disk works
while the caller computes. The caller owns the buffers: it must not touch one, nor let it be
freed, before its transfer's `wait()` returns, and `wait()` returns only once every request of
the transfer has finished, also when one failed. Requests are submitted by one thread (the
caller's); the workers never submit, so a full queue cannot deadlock.

Checksums. Every request written records the CRC32 of its bytes (zlib.crc32, on the worker,
before the write), keyed by (fd, offset); a later read of the same bytes compares them, and a
mismatch fails that request as a ChecksumError (an OSError, EIO), as a short file does. So
what a drive or another process changed in a swap file is an error, never state trained on.
A read must cover what one write did (the callers read and write the same extents, cut into
the same requests): a read of another length at a written offset is refused the same way.
The CRC costs about 1.8 GB/s of one core per direction, on the I/O threads (docs/offload.md
gives the measured share of the transfer).

This module knows nothing of what the bytes are (zmpi.offload.nvme does). `_pread` and
`_pwrite` are module-level so that tests can inject a failing disk.
"""
from __future__ import annotations

import errno
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor


def _pread(fd: int, view, offset: int) -> None:
    """Fill `view` from the file at `offset` (a short read is continued; EOF is an error)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset + done}")
        done += n


def _pwrite(fd: int, view, offset: int) -> None:
    """Write all of `view` to the file at `offset` (a short write is continued)."""
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"nothing written at byte {offset + done}")
        done += n


class ChecksumError(OSError):
    """What a read found differs from what was written there (its CRC32)."""


class Transfer:
    """The requests of one buffer's read or write, in flight."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def wait(self) -> None:
        """Return once every request finished; raise the first one's error, if any failed."""
        error = None
        for f in self.futures:
            e = f.exception()  # waits
            error = error or e
        if error is not None:
            raise error


class AsyncIO:
    """Threads that read and write byte ranges of files, `queue_depth` requests at most in
    flight, each at most `block_size` bytes. `after_write(fd, offset, nbytes)` and
    `after_read(...)`, if given, run on the worker after each request (the buffered fallback
    of zmpi.offload.nvme syncs and drops the pages there)."""

    def __init__(self, block_size: int, queue_depth: int, thread_count: int,
                 after_read=None, after_write=None):
        if block_size < 1 or queue_depth < 1 or thread_count < 1:
            raise ValueError(f"block_size, queue_depth and thread_count must be >= 1, got "
                             f"{block_size}, {queue_depth}, {thread_count}")
        self.block_size = block_size
        self._slots = threading.BoundedSemaphore(queue_depth)
        self._pool = ThreadPoolExecutor(thread_count, thread_name_prefix="zmpi-aio")
        self._after_read, self._after_write = after_read, after_write
        self._crc = {}  # (fd, offset) -> (bytes, CRC32) of each request written

    def read(self, fd: int, view, offset: int) -> Transfer:
        """Start reading len(view) bytes at `offset` into `view` (checked against what was
        written there: the module's docstring)."""
        return self._submit(self._read, fd, view, offset)

    def write(self, fd: int, view, offset: int) -> Transfer:
        """Start writing `view` at `offset`."""
        return self._submit(self._write, fd, view, offset)

    def _read(self, fd, piece, offset) -> None:
        _pread(fd, piece, offset)
        if self._after_read is not None:
            self._after_read(fd, offset, len(piece))
        written = self._crc.get((fd, offset))
        if written is not None:
            crc = zlib.crc32(piece)
            if written != (len(piece), crc):
                raise ChecksumError(errno.EIO, f"checksum mismatch at byte {offset}: CRC32 "
                                    f"{crc:08x} of {len(piece)} bytes, written as "
                                    f"{written[1]:08x} of {written[0]} (the file was changed "
                                    "behind zmpi's back)")

    def _write(self, fd, piece, offset) -> None:
        self._crc.pop((fd, offset), None)  # a failed write leaves the bytes unknown
        crc = zlib.crc32(piece)
        _pwrite(fd, piece, offset)
        if self._after_write is not None:
            self._after_write(fd, offset, len(piece))
        self._crc[(fd, offset)] = (len(piece), crc)

    def _submit(self, op, fd, view, offset) -> Transfer:
        futures = []
        for at in range(0, len(view), self.block_size):
            piece = view[at:at + self.block_size]
            self._slots.acquire()  # the queue is full: wait for a request to finish
            try:
                futures.append(self._pool.submit(self._run, op, fd, piece, offset + at))
            except BaseException:  # (the pool was shut down): none may outlive this call
                self._slots.release()
                for f in futures:
                    f.exception()
                raise
        return Transfer(futures)

    def _run(self, op, fd, piece, offset) -> None:
        try:
            op(fd, piece, offset)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Finish the requests in flight and stop the threads."""
        self._pool.shutdown(wait=True)

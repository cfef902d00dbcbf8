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

This module knows nothing of what the bytes are (zmpi.offload.nvme does). `_pread` and
`_pwrite` are module-level so that tests can inject a failing disk.
"""
from __future__ import annotations

import errno
import os
import threading
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

    def read(self, fd: int, view, offset: int) -> Transfer:
        """Start reading len(view) bytes at `offset` into `view`."""
        return self._submit(_pread, self._after_read, fd, view, offset)

    def write(self, fd: int, view, offset: int) -> Transfer:
        """Start writing `view` at `offset`."""
        return self._submit(_pwrite, self._after_write, fd, view, offset)

    def _submit(self, op, after, fd, view, offset) -> Transfer:
        futures = []
        for at in range(0, len(view), self.block_size):
            piece = view[at:at + self.block_size]
            self._slots.acquire()  # the queue is full: wait for a request to finish
            try:
                futures.append(self._pool.submit(self._run, op, after, fd, piece,
                                                 offset + at))
            except BaseException:  # (the pool was shut down): none may outlive this call
                self._slots.release()
                for f in futures:
                    f.exception()
                raise
        return Transfer(futures)

    def _run(self, op, after, fd, piece, offset) -> None:
        try:
            op(fd, piece, offset)
            if after is not None:
                after(fd, offset, len(piece))
        finally:
            self._slots.release()

    def close(self) -> None:
        """Finish the requests in flight and stop the threads."""
        self._pool.shutdown(wait=True)

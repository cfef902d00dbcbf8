"""ZeRO-Infinity's NVMe tier for the optimizer state (Rajbhandari et al., SC'21): a rank's
fp32 master weights and Adam moments in a file, streamed through a few host buffers.

    state = NvmeOptimizerState.open(comm, numel, np.float32, offload_cfg, aio_cfg, ledger)
    state.master, state.adam_m, state.adam_v     # SwappedState handles: shape, dtype, [a:b]
    state.step(optimizer, grads, grad_scale, clip_coef, publish)   # one Adam step
    state.close()                                 # the file and its directory are removed

Layout. Elements [0, R) of each state (R = `max_in_cpu`) stay in host arrays. The other
numel - R live in one file, `nvme_path/zmpi-nvme-XXXX/optimizer.bin`, one state after another,
each region rounded up to 4 KiB. The whole file is reserved when it is made
(posix_fallocate), so a full disk fails at start and never in the middle of a step. The file is
opened with O_DIRECT where the filesystem allows it: the page cache then holds none of it, and
the bandwidth measured is the disk's. Elsewhere it is buffered, and every request is synced
and its pages dropped (posix_fadvise DONTNEED), so the cache does not grow with the state
either. `direct` says which mode is in use.

The step. The swapped part is cut into blocks of B elements (`buffer_size`, rounded down to
4 KiB). The pool holds `buffer_count` // 3 slots. A slot is three buffers: the master, m and v
of one block. Each buffer is registered with the ledger as host memory of its category, so
the host holds R + slots x B elements of each state whatever numel is. The reads of block k
are submitted slots - 1 blocks ahead (`pipeline_read`). Adam runs on the block (`Adam.update_`:
HostAdam's rule, chunks and threads), the updated parameters are cast into `publish`, and the
block's three writes go out behind (`pipeline_write`) while the next block computes. A slot is
read into again only after its writes are done. Adam is elementwise, so the block boundaries
change no bit: the state and the parameters equal CPU offload's exactly (tests/test_nvme.py).

Failures. A failed request raises NVMeError, which names the state, the elements, the file and
the OS error; so does a block that reads back other than it was written (its CRC32, checked
on every read: zmpi.offload.aio), or a file cut short. It is raised only after every request
in flight has finished. If a pass that writes fails, the state on disk is part old, part new.
Every later use then raises, until all three states have been written whole again (a
checkpoint load does that), so a half-updated state is never trained on silently. The files
are removed by close(), when the object is collected, at exit and when the job is aborted
(zmpi.offload.files).
"""
from __future__ import annotations

import numpy as np

from zmpi import backend
from zmpi.config import AioConfig
from zmpi.offload.files import (
    ALIGN,
    NVMeError,
    SwapFile,
    SwappedStore,
    aligned_empty,
    wait_quietly,
)

STATES = ("master", "adam_m", "adam_v")
__all__ = ["ALIGN", "NVMeError", "NvmeOptimizerState", "STATES", "SwappedState"]


class SwappedState:
    """One state (master, adam_m or adam_v) of an NvmeOptimizerState, addressed like the 1-D
    array it stands for: `shape`, `dtype`, `nbytes`; `state[a:b]` reads those elements into a
    new read-only array; `state[...] = x` writes the whole state (x an array of its length, or
    a scalar); `np.asarray(state)` reads it whole (host memory of the whole state: checks and
    tools, never the step). It is not an array: an in-place update of a slice would change a
    copy, so what it reads is read-only and such an update raises."""

    ndim = 1

    def __init__(self, owner: NvmeOptimizerState, index: int):
        self.owner, self.index = owner, index
        self.shape, self.dtype = (owner.numel,), owner.dtype
        self.size, self.nbytes = owner.numel, owner.numel * owner.dtype.itemsize

    @property
    def name(self) -> str:
        return STATES[self.index]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            lo, hi, _ = key.indices(self.size)
            return self.owner.read(self.index, lo, max(lo, hi))
        raise TypeError(f"{self.name} is on NVMe: read contiguous slices [a:b] (a read-only "
                        f"copy), not {key!r}")

    def __setitem__(self, key, value) -> None:
        if key is not Ellipsis and key != slice(None):
            raise TypeError(f"{self.name} is on NVMe: only the whole state is written "
                            f"(state[...] = values), not [{key!r}]")
        self.owner.write(self.index, value)

    def __array__(self, dtype=None, copy=None):
        whole = self.owner.read(self.index, 0, self.size)
        return whole if dtype is None else whole.astype(dtype)

    def __repr__(self) -> str:
        return f"SwappedState({self.name}, {self.size} x {self.dtype}, {self.owner.where()})"


def _publish(pieces, block, at: int) -> None:
    """Cast the elements [at, at + len(block)) of the master into what each publish piece
    (start, dst) stands for, dst on the host or the device."""
    for start, dst in pieces:
        lo, hi = max(at, start), min(at + len(block), start + len(dst))
        if lo < hi:
            backend.copy_(dst[lo - start:hi - start], block[lo - at:hi - at])


class NvmeOptimizerState(SwappedStore):
    """The master weights and Adam moments of one rank, `numel` elements of `dtype` each, on
    NVMe (the module's docstring says how). `offload`: the OffloadConfig (nvme_path,
    buffer_count, buffer_size, max_in_cpu, pin_memory, pipeline_read/write); `aio`: the
    AioConfig; `ledger`: where the host buffers are registered; `local_ranks`: how many ranks
    of this node share the drive (for the free-space check). Build it with `open` on every
    rank. Not thread-safe: one caller at a time."""

    WHAT = "the optimizer state"

    def _host_arrays(self) -> list:
        return self._resident + self._buffers

    def __init__(self, numel: int, dtype, offload, aio=None, ledger=None, local_ranks=1):
        aio = aio or AioConfig()
        self.numel, self.dtype, self.ledger = numel, np.dtype(dtype), ledger
        self.align = ALIGN // self.dtype.itemsize
        self.resident = min(offload.max_in_cpu, numel)
        self.swapped = numel - self.resident
        self.region = -(-self.swapped // self.align) * self.align  # a state's file extent
        self.block = min(offload.buffer_size // self.align * self.align, self.region)
        self.piece = aio.block_size // self.dtype.itemsize  # elements of one I/O request
        self.pipeline_read, self.pipeline_write = offload.pipeline_read, offload.pipeline_write
        self.states = tuple(SwappedState(self, i) for i in range(3))
        self.master, self.adam_m, self.adam_v = self.states
        self.file = self.io = None
        self._resident, self._buffers = [], []
        self._broken, self._rewritten, self._closed = None, set(), False
        self.io_wait_s = 0.0  # time the caller waited for transfers (what I/O did not hide)
        try:
            for s in STATES if self.resident else ():
                self._resident.append(ledger.allocate((self.resident,), self.dtype, s, "host",
                                                      f"{s} (max_in_cpu)"))
            if self.swapped:
                nbytes = 3 * self.region * self.dtype.itemsize
                self.file = SwapFile(offload.nvme_path, nbytes, nbytes * local_ranks)
                slots = min(offload.buffer_count // 3, -(-self.region // self.block))
                for k in range(3 * slots):
                    self._buffers.append(ledger.register(
                        aligned_empty(self.block, self.dtype, offload.pin_memory),
                        STATES[k % 3], "host", f"nvme {STATES[k % 3]} buffer {k // 3}"))
                self._start_io(aio)
        except BaseException:
            self.close()
            raise

    # ---- what the host holds, and where --------------------------------------------------
    def host_bytes(self) -> dict[str, int]:
        """{category: bytes} the host holds of each state: its resident part and its buffers."""
        held = (self.resident + len(self._buffers) // 3 * self.block) * self.dtype.itemsize
        return dict.fromkeys(STATES, held)

    # ---- the step --------------------------------------------------------------------------
    def step(self, optimizer, grads, grad_scale=1.0, clip_coef=1.0, publish=None,
             advance=True) -> None:
        """One Adam step of `optimizer` (zmpi.optim.Adam: it counts the step and updates each
        block with `update_`) from `grads` (numel, host, any float dtype; read only). publish:
        [(start, dst), ...] as Adam.step_'s, dst on the host or the device: each updated block
        is cast into them. advance=False: the step was counted already (a second set of
        states of the same step, as Adam.update_)."""
        self._usable()
        if grads.shape != (self.numel,):
            raise ValueError(f"grads {grads.shape}: ({self.numel},) expected")
        pieces = sorted(publish or [], key=lambda piece: piece[0])
        optimizer.step_count += advance
        r = self.resident
        if r:
            p, m, v = self._resident
            optimizer.update_(p, grads[:r], m, v, grad_scale, clip_coef)
            _publish(pieces, p, 0)

        def update(x0, views):
            p, m, v = views
            lo = r + x0
            optimizer.update_(p, grads[lo:lo + len(p)], m, v, grad_scale, clip_coef)
            _publish(pieces, p, lo)

        self._stream((0, 1, 2), self._extents(0, self.swapped), update, read=True, write=True,
                     what=f"optimizer step {optimizer.step_count}")

    # ---- whole states and slices ---------------------------------------------------------
    def read(self, state: int, lo: int, hi: int, out=None) -> np.ndarray:
        """Elements [lo, hi) of state `state` (0 master, 1 m, 2 v): into `out` (a host array
        of hi - lo elements) if given, else a new read-only array."""
        self._usable()
        given = out is not None
        out = out if given else np.empty(hi - lo, self.dtype)
        r = self.resident
        if lo < r:
            out[:min(hi, r) - lo] = self._resident[state][lo:min(hi, r)]
        a, b = max(lo, r) - r, hi - r  # in the swapped part

        def take(x0, views):
            x, y = max(a, x0), min(b, x0 + len(views[0]))
            out[x + r - lo:y + r - lo] = views[0][x - x0:y - x0]

        if a < b:
            self._stream((state,), self._extents(a, b), take, read=True, write=False,
                         what=f"reading {STATES[state]}")
        if not given:
            out.flags.writeable = False
        return out

    def scan(self, state: int, fn) -> None:
        """fn(lo, block) for each block of state `state` in order: `block` holds its elements
        [lo, lo + len(block)), read-only to fn and valid only during the call (the resident
        part first, then the file's blocks, read ahead through the whole pool)."""
        self._usable()
        if self.resident:
            fn(0, self._resident[state])
        self._stream((state,), self._extents(0, self.swapped),
                     lambda x0, views: fn(self.resident + x0, views[0]), read=True,
                     write=False, what=f"reading {STATES[state]}")

    def write(self, state: int, values) -> None:
        """Write the whole state `state` from `values`: an array of numel elements (host or
        device, cast to the state's dtype) or a scalar."""
        self._usable(rewriting=True)
        scalar = np.ndim(values) == 0
        if not scalar and len(values) != self.numel:
            raise ValueError(f"{STATES[state]}: {len(values)} values for {self.numel} elements")
        r = self.resident

        def put(dst, lo):
            if scalar:
                dst.fill(values)
            else:
                backend.copy_(dst, values[lo:lo + len(dst)])

        if r:
            put(self._resident[state], 0)
        self._stream((state,), self._extents(0, self.swapped), lambda x0, v: put(v[0], r + x0),
                     read=False, write=True, what=f"writing {STATES[state]}")
        if self._broken is not None:
            self._rewritten.add(state)
            if len(self._rewritten) == len(STATES):
                self._broken = None

    # ---- streaming -----------------------------------------------------------------------
    def _extents(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The file extents (element ranges of the swapped part) that cover [lo, hi), one per
        block [k B, (k + 1) B) (the last one cut at the region's 4 KiB-aligned end) that
        [lo, hi) meets: from the start of the I/O request (`aio.block_size` bytes, counted
        from the block's start) that holds its first element to the end of the one that holds
        its last. A pass over the whole state writes each block as the same requests, so a
        read covers whole requests as they were written, and their checksums apply
        (zmpi.offload.aio); a slice reads at most one request more at each end."""
        extents, step, piece = [], self.block or 1, self.piece
        for x0 in range(lo // step * step, hi, step):
            x1 = min(x0 + step, self.region)
            a = x0 + (max(lo, x0) - x0) // piece * piece
            extents.append((a, min(x0 + -(-(min(hi, x1) - x0) // piece) * piece, x1)))
        return extents

    def _offset(self, state: int, x: int) -> int:
        return (state * self.region + x) * self.dtype.itemsize

    def _stream(self, states, extents, fn, read: bool, write: bool, what: str) -> None:
        """fn(x0, views) for each extent (x0, x1) in order, views one per state in `states`:
        the extent's data elements (clipped to the swapped part) in a pool buffer, read from
        the file first if `read`, written back after if `write`, with read-ahead and
        write-behind over the slots of len(states) buffers the pool has."""
        per, n = len(states), len(extents)
        slots = min(len(self._buffers) // per, n)
        reads, writes, submitted = {}, {}, -1
        ahead = slots - 1 if self.pipeline_read else 0

        def buffers(i):
            k, (x0, x1) = i % slots * per, extents[i]
            return [self._buffers[k + t][:x1 - x0] for t in range(per)]

        def submit(i, op, verb):
            x0, x1 = extents[i]
            return [(op(self.file.fd, buf.view(np.uint8), self._offset(s, x0)), verb, s, x0, x1)
                    for s, buf in zip(states, buffers(i), strict=True)]

        def submit_reads(upto):
            nonlocal submitted
            while submitted < min(upto, n - 1):
                submitted += 1
                self._finish(writes.pop(submitted % slots, ()), what)  # the slot is free
                if read:
                    reads[submitted] = submit(submitted, self.io.read, "read")

        try:
            for i in range(n):
                submit_reads(i)
                self._finish(reads.pop(i, ()), what)
                x0 = extents[i][0]
                fn(x0, [buf[:max(0, self.swapped - x0)] for buf in buffers(i)])
                if write:
                    writes[i % slots] = submit(i, self.io.write, "write")
                    if not self.pipeline_write:
                        self._finish(writes.pop(i % slots), what)
                submit_reads(i + ahead)
            for k in list(writes):
                self._finish(writes.pop(k), what)
        except BaseException as e:
            wait_quietly(transfer for item in [*reads.values(), *writes.values()]
                         for transfer, *_ in item)
            if write:
                self._broken, self._rewritten = f"{what} failed ({e})", set()
            raise

    def _where(self, s: int, x0: int, x1: int) -> str:
        return (f"{STATES[s]} elements [{self.resident + x0}, {self.resident + x1}) at byte "
                f"{self._offset(s, x0)}")

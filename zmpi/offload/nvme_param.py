"""ZeRO-Infinity's NVMe tier for stage 3's parameter shards (`offload_param.device: "nvme"`):
a rank's parameter shard (S elements of the storage dtype) in a file, a unit's part read into
a pooled host buffer when its gather starts and allgathered from there.

    store = NvmeParamShard.open(comm, unit_slices, dtype, offload_param, aio, ledger)
    store.handle                      # what strategy.params_shard is: a SwappedState-like
                                      # handle (shape, dtype, [a:b] reads, [...] = writes)
    request = store.iallgather(u, out, comm)   # read unit u's shard, then allgather it
    request.wait()
    store.handle[...] = master        # the updated shard, written back unit by unit
    store.close()                     # the file and its directory are removed

Layout. `unit_slices` are the units' (start, stop) in the shard, in order. The leading units
whose shards fit together in `max_in_cpu` elements stay in host arrays; every other unit's
shard has an extent of its own in `nvme_path/zmpi-nvme-XXXX/params.bin`, rounded up to 4 KiB,
so that a unit is one aligned read. The file is reserved whole at start and opened as the
optimizer tier's (zmpi.offload.files.SwapFile: O_DIRECT where the filesystem allows it).

The pool. `buffer_count` host buffers (at most one per unit on file), each the largest unit's
extent (`buffer_size` must hold it), registered with the ledger as host "param" memory: the
host holds the resident units and the pool, whatever the model's size. A buffer is held by a
unit's read and its allgather until the allgather completes, or by a unit's write until it is
on disk; when none is free, the oldest holder is finished first (a deterministic choice, the
same on every rank).

Gathers. `iallgather` submits the read at once (prefetch thus reads ahead) and returns a
request whose allgather starts, in the order the gathers were asked for, when it or a later
one is waited or started: every rank starts its collectives in the same order, and the
gather of a prefetched unit finds its read done unless the disk is slower than the compute.

Writes. `handle[...] = values` (the updated master after a step, a checkpoint, the initial
values) casts each unit's part into a buffer and writes it behind the next unit's cast; the
call returns once all are on disk. A source on NVMe itself (the optimizer tier's master) is
scanned block by block, so no whole copy is made. The bits are those of CPU offload: the same
casts into the same dtype. Failures raise NVMeError as the optimizer tier's do; after a
failed write the shard is part old, part new and every later use raises until it is written
whole again (a checkpoint load).
"""
from __future__ import annotations

import bisect
from collections import deque

import numpy as np

from zmpi import backend
from zmpi.config import AioConfig, ConfigError
from zmpi.offload.files import ALIGN, SwapFile, SwappedStore, aligned_empty, wait_quietly
from zmpi.offload.nvme import SwappedState

__all__ = ["NvmeParamShard"]


class ParamHandle(SwappedState):
    """strategy.params_shard under NVMe param offload: SwappedState's contract (contiguous
    slices read into a new read-only array, `[...] =` writes the whole shard)."""

    name = "params"


class _Gather:
    """A request (wait/test/start, as Comm's) for the allgather of unit u from its shard on
    NVMe into `out`: the read is in flight; the allgather starts when this or a later gather
    is started or waited (NvmeParamShard's docstring)."""

    def __init__(self, store: NvmeParamShard, u: int, out, comm):
        self.store, self.u, self.out, self.comm = store, u, out, comm
        self.slot = self.transfer = self.request = None
        self.done = False

    def start(self) -> None:
        self.store._start_through(self)

    def test(self) -> bool:
        return self.request is not None and self.request.test()

    def wait(self) -> None:
        if self.done:
            return
        self.start()
        self.request.wait()
        self.done = True
        self.store._free(self)


class NvmeParamShard(SwappedStore):
    """One rank's parameter shard on NVMe (the module's docstring says how). unit_slices:
    [(start, stop)] of each unit in the shard, contiguous and in order; `offload`: the
    OffloadParamConfig; `aio`: the AioConfig; `ledger`: where the host arrays are registered;
    `local_ranks`: ranks of this node sharing the drive. Not thread-safe: one caller."""

    WHAT = "the parameter shard"

    def _host_arrays(self) -> list:
        return [*self._resident.values(), *self._buffers]

    def __init__(self, unit_slices, dtype, offload, aio=None, ledger=None, local_ranks=1):
        aio = aio or AioConfig()
        self.dtype, self.ledger = np.dtype(dtype), ledger
        self.slices = [(int(a), int(b)) for a, b in unit_slices]
        self.starts = [a for a, _ in self.slices]
        self.numel = self.slices[-1][1] if self.slices else 0
        align = ALIGN // self.dtype.itemsize
        self.file = self.io = None
        self.pinned = offload.pin_memory
        self.block = 0  # elements of a pool buffer: the largest unit's extent
        self._resident, self._at, self._buffers = {}, {}, []
        self._free_slots, self._holders, self._queue = [], deque(), deque()
        self._broken, self._closed = None, False
        self.io_wait_s = 0.0  # time the caller waited for reads and writes
        try:
            for u, (a, b) in enumerate(self.slices):  # the leading units within max_in_cpu
                if b <= offload.max_in_cpu and len(self._resident) == u:
                    self._resident[u] = ledger.allocate((b - a,), self.dtype, "param", "host",
                                                        f"param shard {u} (max_in_cpu)")
                else:
                    self._at[u] = None
            self._layout(align)
            if self._at:
                largest = max(b - a for u, (a, b) in enumerate(self.slices) if u in self._at)
                if offload.buffer_size < largest:
                    raise ConfigError("zero_optimization.offload_param.buffer_size",
                                      f"{offload.buffer_size} elements cannot hold the largest "
                                      f"unit's shard ({largest} elements); raise it")
                nbytes = self._end * self.dtype.itemsize
                self.file = SwapFile(offload.nvme_path, nbytes, nbytes * local_ranks,
                                     name="params", what="parameter shards")
                self.block = -(-largest // align) * align
                for k in range(min(offload.buffer_count, len(self._at))):
                    self._buffers.append(ledger.register(
                        aligned_empty(self.block, self.dtype, offload.pin_memory), "param",
                        "host", f"nvme param buffer {k}"))
                self._free_slots = list(range(len(self._buffers)))
                self._start_io(aio)
        except BaseException:
            self.close()
            raise
        self.handle = ParamHandle(self, 0)

    def _layout(self, align: int) -> None:
        """Each unit on file gets the next 4 KiB-aligned extent."""
        end = 0
        for u in sorted(self._at):
            a, b = self.slices[u]
            self._at[u] = end
            end += -(-(b - a) // align) * align
        self._end = end

    # ---- what the host holds, and where ----------------------------------------------------
    def host_bytes(self) -> dict[str, int]:
        held = sum(b.size for b in self._resident.values()) + len(self._buffers) * self.block
        return {"param": held * self.dtype.itemsize}

    # ---- gathers ---------------------------------------------------------------------------
    def iallgather(self, u: int, out, comm) -> _Gather:
        """Start reading unit u's shard; the returned request allgathers it over `comm` into
        `out` (the unit's padded parameters, the shard's dtype)."""
        self._usable()
        g = _Gather(self, u, out, comm)
        if u in self._at:
            g.slot = self._acquire()
            g.transfer = self.io.read(self.file.fd, self._view(g.slot, u, True).view(np.uint8),
                                      self._offset(u))
            self._holders.append(g)
        self._queue.append(g)
        return g

    def _start_through(self, g: _Gather) -> None:
        """Start the queued allgathers in order, up to and including g's."""
        while g.request is None:
            h = self._queue.popleft()
            a, b = self.slices[h.u]
            if h.transfer is not None:
                try:
                    self._finish([(h.transfer, "read", h.u)], f"gathering unit {h.u}")
                except BaseException:  # first in line still: no later allgather may start
                    self._queue.appendleft(h)  # before it (the other ranks wait in h's)
                    raise
                shard = self._buffers[h.slot][:b - a]
            else:
                shard = self._resident[h.u]
            h.request = h.comm.iallgather(shard, h.out)

    def _free(self, holder) -> None:
        if holder.slot is not None:
            self._holders.remove(holder)
            self._free_slots.append(holder.slot)
            holder.slot = None

    def _acquire(self) -> int:
        """A free buffer of the pool, finishing the oldest holder if none is."""
        while not self._free_slots:
            self._holders[0].wait()
        return self._free_slots.pop()

    # ---- whole reads and writes (SwappedState's owner interface) ---------------------------
    def read(self, state: int, lo: int, hi: int, out=None) -> np.ndarray:
        """Elements [lo, hi) of the shard, into `out` if given, else a new read-only array."""
        self._usable()
        given = out is not None
        out = out if given else np.empty(hi - lo, self.dtype)
        for u in self._units(lo, hi):
            a, b = self.slices[u]
            x, y = max(a, lo), min(b, hi)
            if u in self._resident:
                src = self._resident[u]
            else:
                slot = self._acquire()
                src, whole = self._view(slot, u), self._view(slot, u, whole=True)
                try:
                    transfer = self.io.read(self.file.fd, whole.view(np.uint8), self._offset(u))
                    self._finish([(transfer, "read", u)], "reading params")
                finally:
                    self._free_slots.append(slot)
            out[x - lo:y - lo] = src[x - a:y - a]
        if not given:
            out.flags.writeable = False
        return out

    def write(self, state: int, values) -> None:
        """Write the whole shard from `values`: an array of numel elements (host or device,
        cast to the shard's dtype), a scalar, or a SwappedState (scanned block by block)."""
        self._usable(rewriting=True)
        scalar, scan = np.ndim(values) == 0, isinstance(values, SwappedState)
        if not (scalar or scan) and len(values) != self.numel:
            raise ValueError(f"params: {len(values)} values for {self.numel} elements")
        self._settle()
        staged, writes = {}, []  # u -> [slot, elements filled]; (transfer, u, slot)

        def put(lo, block):
            for u in self._units(lo, lo + len(block)):
                a, b = self.slices[u]
                x, y = max(a, lo), min(b, lo + len(block))
                if u in self._resident:
                    backend.copy_(self._resident[u][x - a:y - a], block[x - lo:y - lo])
                    continue
                if u not in staged:
                    while not self._free_slots:  # the oldest write frees its buffer
                        self._finish_writes([writes.pop(0)])
                    staged[u] = [self._free_slots.pop(), 0]
                slot = staged[u][0]
                backend.copy_(self._view(slot, u)[x - a:y - a], block[x - lo:y - lo])
                staged[u][1] += y - x
                if staged[u][1] == b - a:
                    del staged[u]
                    writes.append((self.io.write(self.file.fd, self._view(slot, u, whole=True)
                                                 .view(np.uint8), self._offset(u)), u, slot))

        try:
            if scan:
                values.owner.scan(values.index, put)
            else:
                put(0, np.full(self.numel, values, self.dtype) if scalar else values)
            pending, writes[:] = list(writes), []
            self._finish_writes(pending)
        except BaseException as e:
            wait_quietly(transfer for transfer, _, _ in writes)  # none may touch a buffer
            self._free_slots.extend(slot for _, _, slot in writes)  # later
            self._free_slots.extend(slot for slot, _ in staged.values())
            self._broken = f"writing the parameter shard failed ({e})"
            raise
        self._broken = None

    def _finish_writes(self, writes) -> None:
        """Wait for (transfer, u, slot) writes, taken off the caller's list; free their
        buffers, also when one failed."""
        try:
            self._finish([(t, "write", u) for t, u, _ in writes], "writing params")
        finally:
            self._free_slots.extend(slot for _, _, slot in writes)

    def abandon(self) -> list:
        """After an error in a step (Strategy.abandon_in_flight): forget the gathers in
        flight. A read is waited for (it is local); a buffer an allgather may still send from
        is replaced by a new one and returned, for the caller to keep alive."""
        kept = []
        for g in list(self._holders):
            wait_quietly([g.transfer] if g.transfer is not None else [])
            if g.request is not None and not g.request.test():
                old = self._buffers[g.slot]
                self.ledger.release(old)
                kept.append(old)
                self._buffers[g.slot] = self.ledger.register(
                    aligned_empty(self.block, self.dtype, self.pinned), "param", "host",
                    f"nvme param buffer {g.slot}")
            g.done = True
            self._free(g)
        self._queue.clear()
        return kept

    # ---- helpers ---------------------------------------------------------------------------
    def _settle(self) -> None:
        """Finish every gather in flight (a write must not reuse a buffer one reads from)."""
        while self._holders:
            self._holders[0].wait()

    def _units(self, lo: int, hi: int) -> range:
        first = max(0, bisect.bisect_right(self.starts, lo) - 1)
        return range(first, bisect.bisect_left(self.starts, hi) if hi > lo else first)

    def _view(self, slot: int, u: int, whole: bool = False):
        """Unit u's shard in buffer `slot`: its elements, or (whole) its aligned extent."""
        a, b = self.slices[u]
        align = ALIGN // self.dtype.itemsize
        return self._buffers[slot][:-(-(b - a) // align) * align if whole else b - a]

    def _offset(self, u: int) -> int:
        return self._at[u] * self.dtype.itemsize

    def _where(self, u: int) -> str:
        a, b = self.slices[u]
        return f"the parameter shard of unit {u} (elements [{a}, {b})) at byte {self._offset(u)}"

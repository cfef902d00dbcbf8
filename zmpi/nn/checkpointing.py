"""Where a recomputed unit's input waits for its backward: DeepSpeed's `activation_checkpointing`
options, for UnitModel's full recompute (ZeRO-R's Pa, Pa+cpu and MD).

    store = InputStore(partition=tp_comm, to_host=True, slots=12)
    kept = store.keep(x)         # in forward: x's copy (or this rank's share of it) is kept
    x = store.restore(kept)      # in backward, before the recompute: x, the same bits
    store.release(kept)          # once the unit's backward ran: its slot is free again

What is kept is counted in the ledger of the running engine (zmpi.nn.base.ACTIVATIONS) as
"saved_input", on the device or the host. This module imports no MPI: `partition` is any
object with zmpi.comm.Comm's `rank`, `size` and `allgather_inplace`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np

from zmpi import backend
from zmpi.nn.base import ACTIVATIONS

_ALIGN = 64  # bytes: every slot starts at a multiple, so it views as any dtype
_NAME = "contiguous saved inputs"  # the slots' buffer, in the ledger


class Kept(NamedTuple):
    """A kept input: `data` (the array kept, or None when it lives in slot `slot` of the
    store's buffer), the input's `shape` and `dtype`, and `copying`, the device -> host copy
    still in flight (cpu_checkpointing on a GPU)."""

    data: Any
    shape: tuple
    dtype: Any
    slot: int | None = None
    copying: Any = None


class InputStore:
    """Keeps a checkpointed unit's input until its recompute.

    partition: a Comm (the tensor group): `partition_activations` keeps only this rank's
        ceil(n / size) elements of the flattened input (zero-padded at the end); `restore`
        allgathers them. The input must be the same on every rank of `partition` (it is in a
        tensor group without sequence parallelism).
    to_host: `cpu_checkpointing`: what is kept lives in host memory (on a GPU the copy runs on
        a side stream, overlapping the forward that follows, in page-locked memory); `restore`
        copies it back before the recompute.
    slots: `contiguous_memory_optimization` with `number_checkpoints`: what is kept is copied
        into one preallocated buffer of `slots` equal slots (no allocation per input, no
        fragmentation: ZeRO-R's MD). The slot size is the largest input kept so far; a
        larger one regrows the buffer once (live slots are copied over). More inputs kept at
        once than slots is an error naming the setting.
    synchronize: `synchronize_checkpoint_boundary`: the device is synchronised before and
        after each checkpointed unit's forward and recompute (`boundary`; NumPy: nothing is
        asynchronous).
    profile: `profile`: `recompute_seconds[i]` sums the seconds of unit i's recomputes (device
        synchronised around each, so the time is the recompute's).
    """

    def __init__(self, partition=None, to_host=False, slots=None, synchronize=False,
                 profile=False):
        if slots is not None and slots < 1:
            raise ValueError(f"number_checkpoints must be >= 1, got {slots}")
        self.partition, self.to_host, self.slots = partition, to_host, slots
        self.synchronize, self.profile = synchronize, profile
        self.recompute_seconds: dict[int, float] = {}
        self._buffer = None  # the slots' buffer: uint8, slots x _slot_bytes
        self._slot_bytes = 0
        self._used: dict[int, tuple] = {}  # slot -> (bytes it holds, its copy in flight)
        self._ledger = None  # the ledger _buffer is registered with

    @property
    def device(self) -> str:
        """Where what is kept lives, in the ledger's terms."""
        return "host" if self.to_host else "device"

    def keep(self, x) -> Kept:
        """Keep x (any shape and dtype; its copy, or this rank's share of it)."""
        share = self._share(x)
        if self.slots is not None:
            slot = self._take_slot(share.nbytes)
            self._account()
            target = self._view(slot, share.shape, share.dtype)
        elif self.to_host:
            target = backend.pinned_empty(share.shape, share.dtype)
        else:
            target = share  # x itself (nothing changes it), or a partition's share: a copy
        copying = None
        if self.to_host:
            copying = backend.HostCopy(share, target)
        elif target is not share:
            target[...] = share
        if self.slots is not None:
            self._used[slot] = (share.nbytes, copying)
            return Kept(None, x.shape, x.dtype, slot, copying)
        ACTIVATIONS.hold((target,), "saved_input", self.device)
        return Kept(target, x.shape, x.dtype, None, copying)

    def restore(self, kept: Kept):
        """The input `kept` was made from, on the device (a view of the kept memory when it
        is neither partitioned nor on the host)."""
        share = kept.data
        if kept.copying is not None:
            share = kept.copying.wait()
        if kept.slot is not None:
            shape = (self._share_size(kept.shape),)
            share = self._view(kept.slot, shape if self.partition else kept.shape, kept.dtype)
        if self.to_host:
            share = backend.to_device(share)
        if self.partition is None:
            return share
        group = self.partition
        full = backend.empty(share.size * group.size, kept.dtype)
        full[group.rank * share.size:(group.rank + 1) * share.size] = share
        group.allgather_inplace(full.view(np.uint8))  # as bytes: any dtype travels
        return full[:int(np.prod(kept.shape, dtype=np.int64))].reshape(kept.shape)

    def release(self, kept: Kept) -> None:
        """What `kept` holds is no longer needed: its slot is free (a kept array is released
        from the ledger with the cache that holds it). A copy to the host still in flight is
        waited for first: its memory must not be reused under it."""
        if kept.copying is not None:
            kept.copying.wait()
        if kept.slot is not None:
            del self._used[kept.slot]

    @contextmanager
    def boundary(self, recompute_of: int | None = None):
        """Around a checkpointed unit's forward, or the recompute of unit `recompute_of` (its
        layers' caches counted as "recompute", timed with `profile`)."""
        if self.synchronize or self.profile:
            backend.synchronize()
        start = time.perf_counter()
        if recompute_of is None:
            yield
        else:
            with ACTIVATIONS.recomputing():
                yield
        if self.synchronize or self.profile:
            backend.synchronize()
        if self.profile and recompute_of is not None:
            seconds = self.recompute_seconds.get(recompute_of, 0.0)
            self.recompute_seconds[recompute_of] = seconds + time.perf_counter() - start

    # -- mechanism ---------------------------------------------------------------------------
    def _share_size(self, shape) -> int:
        n = int(np.prod(shape, dtype=np.int64))
        return n if self.partition is None else -(-n // self.partition.size)

    def _share(self, x):
        """x itself, or a copy of this rank's share of it (flattened, zero-padded)."""
        if self.partition is None:
            return x
        size = self._share_size(x.shape)
        flat = x.reshape(-1)[self.partition.rank * size:(self.partition.rank + 1) * size]
        share = backend.zeros((size,), x.dtype)
        share[:flat.size] = flat
        return share

    def _take_slot(self, nbytes: int) -> int:
        if nbytes > self._slot_bytes:
            self._grow(-(-nbytes // _ALIGN) * _ALIGN)
        free = next((s for s in range(self.slots) if s not in self._used), None)
        if free is None:
            raise RuntimeError(
                f"activation_checkpointing.number_checkpoints is {self.slots}, but more inputs "
                "are kept at once here (one per recomputed unit, or group of units, and "
                "micro-batch in flight): raise it")
        return free

    def _grow(self, slot_bytes: int) -> None:
        """A buffer of `slots` slots of `slot_bytes`, the live slots copied over (a slot is
        written before it is read: no zero-fill)."""
        make = backend.pinned_empty if self.to_host else backend.empty
        buffer = make((self.slots * slot_bytes,), np.uint8)
        for slot, (nbytes, copying) in self._used.items():
            if copying is not None:
                copying.wait()
            start = slot * slot_bytes
            buffer[start:start + nbytes] = self._buffer[slot * self._slot_bytes:][:nbytes]
        if self._ledger is not None:  # both exist for a moment
            self._ledger.register(buffer, "saved_input", self.device, _NAME)
            self._ledger.release(self._buffer)
        self._buffer, self._slot_bytes = buffer, slot_bytes

    def _account(self) -> None:
        """The buffer is counted in the ledger of the running engine, once."""
        ledger = ACTIVATIONS.ledger
        if ledger is None or ledger is self._ledger:
            return
        if self._ledger is not None:
            self._ledger.release(self._buffer)
        ledger.register(self._buffer, "saved_input", self.device, _NAME)
        self._ledger = ledger

    def _view(self, slot: int, shape, dtype):
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = slot * self._slot_bytes
        return self._buffer[start:start + nbytes].view(dtype).reshape(shape)

"""The collectives of a unit and of a bucket: gathering and releasing a unit's parameters,
reduce-scattering its gradients into the shard (and copying them to the host under offload),
allgathering updated shards into full parameters.

`UnitCollectives` is a mixin of `Strategy` (strategy.py), which holds the buffers and runs
every request through `_launch` (overlap_comm's in-flight limit). It reads `self.layout`,
`self.comm`, `self.params_shard`, `self.grads_shard`, `self._gathered`, `self._unit_grads`,
`self._host_copies`, `self._stale` and the offload flags; a policy may change how a unit is
gathered or reduced by overriding `iallgather_unit` and `ireduce_scatter` (zeropp.py).
"""
from __future__ import annotations

import numpy as np

from zmpi import backend
from zmpi.backend import HostCopy, array_module
from zmpi.kernels import host as host_kernels


def _add_(dst, src) -> None:
    """dst += src, quietly: an fp16 inf here is the loss scaler's overflow signal (host
    arrays through host_kernels.add_, NumPy's float16 add compiled)."""
    xp = array_module(dst)
    if xp is np:
        host_kernels.add_(dst, src)
    else:
        xp.add(dst, src, out=dst)


class UnitCollectives:
    """Gather, release, reduce-scatter and publish (a mixin of Strategy)."""

    def needs(self, u: int) -> tuple[int, ...]:
        """Units whose parameters unit u reads: itself and the units it shares weights with."""
        return (u,) + self._shared[u]

    def gather(self, u: int, wait: bool = True) -> None:
        """Allgather unit u's parameters from the shards into a full buffer (param sharding).
        With wait=False the allgather is only started (prefetch); a later gather() finishes it."""
        if u not in self._gathered:
            numel = self.layout.units[u].padded_numel
            buf = self.alloc(numel, self.dtype, "param", f"gathered{u}", zero=False)
            self._gathered[u] = [buf, self.iallgather_unit(u, buf)]
        entry = self._gathered[u]
        if wait and entry[1] is not None:
            entry[1].wait()
            entry[1] = None
            self._bind(u, "data", entry[0])

    def iallgather_unit(self, u: int, buf):
        """Start the collective that fills `buf` (unit u's padded parameters) from the shards:
        an allgather; a policy may gather another way (zeropp.py). Returns a request."""
        return self.iallgather_shard(u, buf)

    def iallgather_shard(self, u: int, buf):
        """Start the allgather of unit u's shard into `buf`: from params_shard, or with the
        shards on NVMe (`param_store`) from the file, read first (zmpi.offload.nvme_param)."""
        if self.param_store is not None:
            return self.param_store.iallgather(u, buf, self.comm)
        return self.comm.iallgather(self.params_shard[self.layout.shard_slice(u)], buf)

    def ireduce_scatter(self, units: range, full, part):
        """Start the reduction of reduce_scatter_to_shard: part <- this rank's block of the
        sum over ranks of `full` (`units`, packed); a policy may reduce another way
        (zeropp.py)."""
        return self.comm.ireduce_scatter(full, part)

    def release(self, u: int) -> None:
        """Free unit u's gathered parameters (param sharding)."""
        buf, request = self._gathered.pop(u)
        if request is not None:
            request.wait()
        self._bind(u, "data", None)
        self.ledger.release(buf)

    def ensure_unit_grads(self, u: int) -> None:
        """Give unit u (and the units it writes gradients into) a zeroed full grad buffer."""
        for w in self.needs(u):
            if w not in self._unit_grads:
                numel = self.layout.units[w].padded_numel
                buf = self.alloc(numel, self.dtype, "grad", f"grad{w}")
                self._unit_grads[w] = buf
                self._bind(w, "grad", buf, zeroed=True)

    def reduce_scatter_unit_grads(self, u: int) -> None:
        """Reduce-scatter unit u's full gradient, add this rank's shard into grads_shard and
        free the full buffer (gradient sharding: non-owned gradient memory is released)."""
        full = self._unit_grads.pop(u)
        self._bind(u, "grad", None)
        self.reduce_scatter_to_shard(range(u, u + 1), full, accumulate=True, free=(full,))

    def reduce_scatter_to_shard(self, units: range, full, accumulate: bool, free=()) -> None:
        """Reduce-scatter `full` (the packed whole gradient of a bucket of units, device) so
        that this rank's summed shard is added into its part of grads_shard (or written, if
        not `accumulate`). If grads_shard is on the host (optimizer offload) the shard is
        copied device -> host as soon as the reduction completes. Buffers in `free` are
        released when done. The first reduction of a step into a unit's part writes it even
        if `accumulate` (zero_grads left it stale, not zeroed)."""
        if accumulate and self._stale.issuperset(units):
            accumulate = False  # the step's first: nothing to add to
        if accumulate:
            self._zero_stale(units)
        self._stale.difference_update(units)
        dst = self.grads_shard[self._bucket_shard(units)]
        direct = not accumulate and not self.offload_optimizer
        part = dst if direct else self.alloc(dst.shape[0], self.dtype, "comm_buffer", "rs",
                                             zero=False)
        request = self.ireduce_scatter(units, full, part)

        def done():
            if self.offload_optimizer:  # to dst, or to a host buffer added on landing
                landing = self.alloc(dst.shape[0], self.dtype, "comm_buffer", "d2h", "host",
                                     self._pinned, zero=False) if accumulate else dst
                self._host_copies.append((HostCopy(part, landing), dst, part))
                self._land_host_copies(block=False)
            elif not direct:
                _add_(dst, part)
                self.ledger.release(part)
            for buf in free:
                self.ledger.release(buf)

        self._launch(request, done, (0 if direct else part.nbytes) + sum(b.nbytes for b in free))

    def _land_host_copies(self, block: bool) -> None:
        """Finish device -> host gradient copies in order: add each landed shard into its
        destination and free the buffers. Without `block`, stop at the first still in flight."""
        while self._host_copies:
            copy, dst, part = self._host_copies[0]
            if not (block or copy.ready()):
                return
            self._host_copies.pop(0)
            landed = copy.wait()
            if landed is not dst:
                _add_(dst, landed)
                self.ledger.release(landed)
            self.ledger.release(part)

    def publish_sharded_params(self) -> None:
        """Write each unit's updated master shard into params_full and allgather in place."""
        self.allgather_shard_into(self.params_full, self.master, self._take_written())

    def sharded_publish_targets(self):
        """publish_targets for publish_sharded_params: each unit's master shard -> its owned
        slice of params_full (a lone unit is then allgathered in place, with no copy)."""
        return self._hand_out((self.layout.shard_offsets[u],
                               self.params_full[self.layout.owned_slice(u, self.rank)])
                              for u in range(len(self.units)))

    def allgather_shard_into(self, full, shard, written=False) -> None:
        """Fill `full` (P) on every rank from each rank's `shard` (S), in buckets of
        `allgather_bucket_size` elements: a lone unit is allgathered in place in `full`; the
        units of a larger bucket are gathered packed into a comm_buffer and copied out.
        written: this rank's owned slices of `full` hold their shard already."""
        for units in self.buckets(self.config.allgather_bucket_size):
            mine = self._bucket_shard(units)
            n = mine.stop - mine.start
            packed = self.bucket_buffer(units, full)  # only this rank's part is written here
            if not (written and len(units) == 1):  # packed is full's, holding it already
                backend.copy_(packed[self.rank * n:(self.rank + 1) * n], shard[mine])

            def done(units=units, packed=packed):
                if len(units) > 1:
                    self.unpack(units, packed, full)
                    self.ledger.release(packed)

            self._launch(self.comm.iallgather_inplace(packed), done,
                         packed.nbytes if len(units) > 1 else 0)
        self.wait_pending()

"""Bucket planning: which consecutive units travel together in one collective, and where.

Small collectives cost latency, so the units are grouped into buckets of at most
`reduce_bucket_size` (gradients) or `allgather_bucket_size` (updated parameters) elements; a
unit of `solo_numel` elements or more goes alone and in place, because packing it would cost
copies (docs/stages.md). A bucket of several units is *packed* rank by rank, as reduce-scatter
splits and allgather concatenates: rank 0's shards of its units, then rank 1's, ...

`BucketPlanning` is a mixin of `Strategy` (strategy.py), which runs the collectives. It reads
`self.layout`, `self.world_size`, `self.config` and `self._reduce_buckets` (None until first
used), and allocates packed buffers with `self.alloc`.
"""
from __future__ import annotations


class BucketPlanning:
    # Elements from which a unit is sent alone, never packed into a bucket with others. At
    # 16 Ki float32 elements per unit an allgather packed costs what one per unit costs; at
    # 64 Ki, 2.2x (N = 2 over shared memory; experiments/bandwidth.py, packing.md).
    solo_numel = 1 << 14

    def buckets(self, limit: int) -> list[range]:
        """The units in order, grouped into runs of consecutive units of at most `limit`
        elements together (DeepSpeed's bucket sizes; a larger unit is a bucket of its own).
        A unit of `solo_numel` elements or more is always a bucket of its own: it is sent in
        place, where packing it with its neighbours would cost a copy of it (two for an
        allgather) to save one collective's latency."""
        out, start, size = [], 0, 0
        for u, unit in enumerate(self.layout.units):
            solo = unit.padded_numel >= self.solo_numel
            if u > start and (solo or size + unit.padded_numel > limit):
                out.append(range(start, u))
                start, size = u, 0
            size += unit.padded_numel
            if solo:
                out.append(range(u, u + 1))
                start, size = u + 1, 0
        return out + [range(start, len(self.layout.units))] \
            if start < len(self.layout.units) else out

    def reduce_bucket_from(self, u: int) -> range | None:
        """The gradient bucket (`reduce_bucket_size`) whose first unit is u, else None: its
        gradients are complete once u's backward ends (backward runs the units in reverse)."""
        if self._reduce_buckets is None:
            self._reduce_buckets = {b.start: b for b in self.buckets(
                self.config.reduce_bucket_size)}
        return self._reduce_buckets.get(u)

    def _bucket_full(self, units: range) -> slice:
        return slice(self.layout.full_offsets[units.start], self.layout.full_offsets[units.stop])

    def _bucket_shard(self, units: range) -> slice:
        return slice(self.layout.shard_offsets[units.start], self.layout.shard_offsets[units.stop])

    def _bucket_pieces(self, units: range):
        """(rank, slice of the full layout, slice of the packed bucket) of every owned piece:
        a packed bucket holds rank 0's shards of its units, then rank 1's, ... (what
        reduce-scatter splits and allgather concatenates)."""
        n = self.layout.shard_offsets[units.stop] - self.layout.shard_offsets[units.start]
        for r in range(self.world_size):
            at = r * n
            for u in units:
                piece = self.layout.owned_slice(u, r)
                yield r, piece, slice(at, at + piece.stop - piece.start)
                at += piece.stop - piece.start

    def bucket_buffer(self, units: range, full):
        """Where the bucket of `full` (P) travels in a collective: unit u's own slice when it
        is alone (it is already rank-major), else a new, unfilled comm_buffer in the packed
        order of `_bucket_pieces` (the caller releases it)."""
        if len(units) == 1:
            return full[self._bucket_full(units)]
        mine = self._bucket_shard(units)
        return self.alloc((mine.stop - mine.start) * self.world_size, full.dtype,
                          "comm_buffer", "bucket", zero=False)

    def pack(self, units: range, full):
        """The bucket of `full` (P) for a collective, filled from `full` (`bucket_buffer`)."""
        packed = self.bucket_buffer(units, full)
        if len(units) > 1:
            for _, piece, at in self._bucket_pieces(units):
                packed[at] = full[piece]
        return packed

    def unpack(self, units: range, packed, full) -> None:
        """Inverse of `pack`: copy a packed bucket's pieces into `full` (P)."""
        for _, piece, at in self._bucket_pieces(units):
            full[piece] = packed[at]

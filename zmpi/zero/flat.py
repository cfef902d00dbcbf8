"""Flat, padded, partitioned buffer layouts: where every parameter lives, described as data.

Each unit's parameters are laid out back to back in one flat buffer, sorted by name so every
rank agrees, and padded with zeros so the buffer splits into `world_size` equal shards
(ZeRO, SC'20, Sec. 5; FSDP's FlatParameter). The model's units are then concatenated into one
model-wide *full* buffer, and their shards into one model-wide *shard* buffer:

    full  : [ unit0 (padded) | unit1 (padded) | ... ]            numel = sum P_u
    shard : [ unit0 shard r  | unit1 shard r  | ... ]            numel = sum P_u / N

Parameters, gradients, fp32 master weights and Adam's m and v all use these two layouts, so
one offset function serves them all. The layout is plain data (`to_dict`) so checkpoints can
record it and reshape across world sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod


def shard_range(padded_numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s shard inside a buffer of `padded_numel` elements."""
    if padded_numel % world_size:
        raise ValueError(f"{padded_numel} elements do not split into {world_size} shards")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    n = padded_numel // world_size
    return rank * n, (rank + 1) * n


@dataclass(frozen=True)
class Slot:
    """One parameter inside a unit's flat buffer: elements [offset, offset + numel)."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    """The flat layout of one unit: its parameters (sorted by name) and padding."""

    slots: tuple[Slot, ...]
    numel: int  # real elements
    padded_numel: int  # numel rounded up to a multiple of world_size
    world_size: int

    @classmethod
    def build(cls, shapes: dict[str, tuple[int, ...]], world_size: int) -> UnitLayout:
        slots, offset = [], 0
        for name in sorted(shapes):
            slots.append(Slot(name, tuple(shapes[name]), offset))
            offset += slots[-1].numel
        padded = -(-offset // world_size) * world_size
        return cls(tuple(slots), offset, padded, world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return shard_range(self.padded_numel, self.world_size, rank)

    def views(self, flat) -> dict:
        """name -> view of `flat` (1-D, padded_numel) shaped like the parameter."""
        return {s.name: flat[s.offset : s.offset + s.numel].reshape(s.shape) for s in self.slots}


class ModelLayout:
    """All units' layouts, placed in the model-wide full and shard buffers."""

    def __init__(self, units: list[UnitLayout]):
        self.units = units
        self.full_offsets, self.shard_offsets = [0], [0]
        for u in units:
            self.full_offsets.append(self.full_offsets[-1] + u.padded_numel)
            self.shard_offsets.append(self.shard_offsets[-1] + u.shard_numel)
        self.world_size = units[0].world_size if units else 1

    @classmethod
    def of(cls, unit_params, world_size: int) -> ModelLayout:
        """The layout of `unit_params` (name -> Parameter, one dict per unit) split into
        `world_size` shards."""
        return cls([UnitLayout.build({n: p.data.shape for n, p in params.items()}, world_size)
                    for params in unit_params])

    def values_of(self, unit_params, dtype):
        """The parameters' values in the full layout (P, `dtype`, host NumPy; padding 0)."""
        import numpy as np

        from zmpi.backend import to_host

        full = np.zeros(self.full_numel, dtype)
        for u, params in enumerate(unit_params):
            views = self.units[u].views(full[self.full_slice(u)])
            for name, p in params.items():
                views[name][...] = to_host(p.data)
        return full

    @property
    def full_numel(self) -> int:
        return self.full_offsets[-1]

    @property
    def shard_numel(self) -> int:
        return self.shard_offsets[-1]

    @property
    def num_params(self) -> int:
        """Real (unpadded) parameter count: the papers' Psi."""
        return sum(u.numel for u in self.units)

    @property
    def padding(self) -> int:
        return self.full_numel - self.num_params

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape by name, in layout order."""
        return {s.name: s.shape for u in self.units for s in u.slots}

    def full_slice(self, u: int) -> slice:
        return slice(self.full_offsets[u], self.full_offsets[u + 1])

    def shard_slice(self, u: int) -> slice:
        return slice(self.shard_offsets[u], self.shard_offsets[u + 1])

    def owned_slice(self, u: int, rank: int) -> slice:
        """This rank's shard of unit u, as a slice of the model-wide full buffer."""
        start, stop = self.units[u].shard_range(rank)
        base = self.full_offsets[u]
        return slice(base + start, base + stop)

    def owned_pieces(self, rank: int):
        """Every parameter piece of `rank`'s owned shard: (name, start in the parameter's flat
        elements, start in the rank's shard array, length), in shard order."""
        for u, unit in enumerate(self.units):
            lo, hi = unit.shard_range(rank)
            base = self.shard_offsets[u] - lo
            for slot in unit.slots:
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    yield slot.name, a - slot.offset, base + a, b - a

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "units": [
                {
                    "padded_numel": u.padded_numel,
                    "params": [{"name": s.name, "shape": list(s.shape), "offset": s.offset}
                               for s in u.slots],
                }
                for u in self.units
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ModelLayout:
        """Inverse of `to_dict`."""
        units = []
        for u in d["units"]:
            slots = tuple(Slot(p["name"], tuple(p["shape"]), p["offset"]) for p in u["params"])
            units.append(UnitLayout(slots, sum(s.numel for s in slots), u["padded_numel"],
                                    d["world_size"]))
        return cls(units)

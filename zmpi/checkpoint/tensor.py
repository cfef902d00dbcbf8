"""How a checkpoint's parameters are split over the tensor ranks, and the index arithmetic
that reads one split into any other (tensor parallelism saved at tp = T, loaded at tp = T').

Under tensor parallelism (zmpi.parallel.tensor) each rank holds a slice of some parameters
along one axis (`tp_split`): the columns or rows it keeps (`tp_index`, in the whole
parameter), with the vocabulary padded to a multiple of T (`tp_full` real entries; the
padding is zero and never trained). Every tensor rank's local layout has the same names and
shapes, so a checkpoint stores each tensor rank's owned shards as at tp = 1, in files of its
own, and the manifest records the split:

    "tensor": {"size": T, "splits": {name: {"axis": a, "full": F,
                                            "index": [runs of tensor rank 0, ...]}}}

`index` lists, per tensor rank, the [start, stop) runs of whole-parameter positions along
`axis` that its slice holds, in order. A parameter not named is whole on every tensor rank
(LayerNorms, row-parallel biases, the position embedding); it is read from tensor rank 0.

Loading maps each element of the loading rank's owned piece to its *whole* flat index (the
parameter with the split axis at its unpadded length F), finds which saved tensor rank holds
that whole index and where in its local slice, and reads those ranges. An element of padding
(whole position >= F) is zero. Where the slices match (the same split, same tensor rank) the
piece is read as it lies, as at tp = 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_CHUNK = 1 << 20  # elements mapped at a time: bounds the index arrays of a large piece


def runs_of(index) -> list[list[int]]:
    """[start, stop) runs of a sorted integer index array."""
    index = np.asarray(index, dtype=np.int64)
    if index.size == 0:
        return []
    if np.any(np.diff(index) <= 0):
        raise ValueError("a tensor-parallel slice's positions must be strictly increasing")
    breaks = np.flatnonzero(np.diff(index) != 1) + 1
    return [[int(run[0]), int(run[-1]) + 1] for run in np.split(index, breaks)]


def _positions(runs) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in runs] or [np.zeros(0, np.int64)])


@dataclass(frozen=True)
class Split:
    """One parameter's split: along `axis`, `full` real positions, each tensor rank's runs."""

    axis: int
    full: int
    index: tuple  # per tensor rank: tuple of (start, stop) runs

    def to_dict(self) -> dict:
        return {"axis": self.axis, "full": self.full,
                "index": [[list(r) for r in runs] for runs in self.index]}

    @classmethod
    def from_dict(cls, d: dict) -> Split:
        return cls(d["axis"], d["full"], tuple(tuple(tuple(r) for r in runs)
                                               for runs in d["index"]))


class TensorSplits:
    """Every split parameter of a model (or checkpoint) over `size` tensor ranks."""

    def __init__(self, size: int = 1, splits: dict | None = None):
        self.size, self.splits = size, dict(splits or {})
        self._located = {}  # name -> (owner, position) arrays over the whole axis

    @classmethod
    def of_model(cls, unit_params, tp, mark: str = "tp") -> TensorSplits:
        """The splits of a built model's parameters (`unit_params`: name -> Parameter per
        unit) over the Comm `tp` (a collective over it when tp.size > 1). At tp.size 1 only
        the padded ones (a vocabulary padded to aligned GEMMs, `tp_full` real rows of more):
        a split over one rank whose "full" drops the padding, so a padded checkpoint loads
        into an unpadded model, or any other split, and back. `mark` names the attributes
        read (`{mark}_split`, `{mark}_index`, `{mark}_full`): "ep" for the experts an
        expert-parallel rank holds (zmpi.parallel.expert), split over the Comm `tp` = ep's."""
        mine = {}
        for params in unit_params:
            for name, p in params.items():
                axis, full = getattr(p, f"{mark}_split", None), getattr(p, f"{mark}_full", None)
                if axis is not None and (tp.size > 1 or full not in (None, p.shape[axis])):
                    mine[name] = (axis, full, runs_of(getattr(p, f"{mark}_index")))
        if not mine:
            return cls()
        every = [mine] if tp.size == 1 else tp.allgather_object(mine)
        splits = {}
        for name, (axis, full, _) in mine.items():
            index = tuple(tuple(map(tuple, ranks[name][2])) for ranks in every)
            held = sum(b - a for runs in index for a, b in runs)
            splits[name] = Split(axis, held if full is None else full, index)
        return cls(tp.size, splits)

    def to_dict(self) -> dict:
        return {"size": self.size,
                "splits": {name: s.to_dict() for name, s in sorted(self.splits.items())}}

    @classmethod
    def from_dict(cls, d: dict | None) -> TensorSplits:
        """From a manifest's "tensor" entry (None: a checkpoint saved without tensor
        parallelism). ValueError if it is not a sound description. An expert section split
        over both the ep and the tensor ranks ({size, ep, tp}) gives an ExpertSplits."""
        if d is None:
            return cls()
        if "ep" in d:
            return ExpertSplits.from_dict(d)
        size, splits = d.get("size"), d.get("splits")
        if type(size) is not int or size < 1 or type(splits) is not dict:
            raise ValueError("tensor is not {size >= 1, splits}")
        out = {}
        for name, s in splits.items():
            try:
                split = Split.from_dict(s)
                ok = (type(split.axis) is int and split.axis >= 0 and type(split.full) is int
                      and len(split.index) == size
                      and all(type(a) is int and type(b) is int and 0 <= a < b
                              for runs in split.index for a, b in runs))
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"tensor.splits[{name[:60]!r}] is not {{axis, full, index "
                                 f"runs for {size} ranks}}")
            out[name] = split
        return cls(size, out)

    # ---- shapes -----------------------------------------------------------------------------
    def whole_shape(self, name: str, local_shape) -> tuple:
        """The whole parameter's shape (unpadded) of a local slice shaped `local_shape`."""
        split = self.splits.get(name)
        shape = list(local_shape)
        if split is not None:
            if split.axis >= len(shape):
                raise ValueError(f"{name}: split along axis {split.axis} of a {len(shape)}-d "
                                 "parameter")
            shape[split.axis] = split.full
        return tuple(shape)

    def whole_shapes(self, layout) -> dict:
        return {name: self.whole_shape(name, shape) for name, shape in layout.shapes().items()}

    def check_slices(self, layout) -> None:
        """ValueError unless every split names a parameter of `layout` and each tensor rank's
        runs fill its local axis and lie inside the (padded) whole one."""
        shapes = layout.shapes()
        for name, split in self.splits.items():
            if name not in shapes or split.axis >= len(shapes[name]):
                raise ValueError(f"tensor.splits names {name[:60]!r}, not a split axis of a "
                                 "parameter of the layout")
            local = shapes[name][split.axis]
            padded = max(-(-split.full // self.size) * self.size, local * self.size)
            for runs in split.index:
                if sum(b - a for a, b in runs) != local or any(b > padded for _, b in runs):
                    raise ValueError(f"tensor.splits[{name[:60]!r}]: a rank's runs do not "
                                     f"hold its {local} positions")

    # ---- index arithmetic -------------------------------------------------------------------
    def same_slice(self, name: str, other: TensorSplits, tp_rank: int) -> bool:
        """Whether tensor rank `tp_rank` holds the same elements of `name` here and in
        `other` (both whole, or the same runs of the same split)."""
        if not isinstance(other, TensorSplits):
            return False  # an ExpertSplits: read through the whole indices
        mine, theirs = self.splits.get(name), other.splits.get(name)
        if mine is None or theirs is None:
            return mine is theirs
        return (mine.axis == theirs.axis and mine.full == theirs.full
                and tp_rank < len(theirs.index) and mine.index[tp_rank] == theirs.index[tp_rank])

    def whole_indices(self, name: str, local_shape, tp_rank: int, start: int,
                      n: int) -> np.ndarray:
        """Whole flat indices of the local slice's flat elements [start, start + n) on tensor
        rank `tp_rank` (int64; -1 for padding)."""
        return self.whole_of(name, local_shape, tp_rank, np.arange(start, start + n,
                                                                   dtype=np.int64))

    def whole_of(self, name: str, local_shape, tp_rank: int, local: np.ndarray) -> np.ndarray:
        """`whole_indices` of the local slice's flat elements `local` (int64, none padding)."""
        split = self.splits.get(name)
        if split is None:
            return local
        coords = list(np.unravel_index(local, tuple(local_shape)))
        along = _positions(split.index[tp_rank])[coords[split.axis]]
        padding = along >= split.full
        coords[split.axis] = np.where(padding, 0, along)
        whole = np.ravel_multi_index(coords, self.whole_shape(name, local_shape))
        return np.where(padding, -1, whole)

    def locate(self, name: str, local_shape, whole: np.ndarray):
        """For whole flat indices (none padding): (tensor rank holding each, its flat index in
        that rank's local slice shaped `local_shape`)."""
        split = self.splits.get(name)
        if split is None:
            return np.zeros(len(whole), np.int64), whole
        if name not in self._located:
            owner = np.full(split.full, -1, np.int64)
            position = np.zeros(split.full, np.int64)
            for t, runs in enumerate(split.index):
                at = _positions(runs)
                real = at < split.full
                owner[at[real]], position[at[real]] = t, np.flatnonzero(real)
            if np.any(owner < 0):
                raise ValueError(f"{name}: no tensor rank holds some of its positions")
            self._located[name] = owner, position
        owner, position = self._located[name]
        coords = list(np.unravel_index(whole, self.whole_shape(name, local_shape)))
        tensor_rank = owner[coords[split.axis]]
        coords[split.axis] = position[coords[split.axis]]
        return tensor_rank, np.ravel_multi_index(coords, tuple(local_shape))


class ExpertSplits:
    """The expert section of a checkpoint saved at ep > 1 under tensor parallelism
    (zmpi.parallel.expert.tensor): each expert parameter split over the ep ranks on its expert
    axis (`ep`, a TensorSplits over the ep ranks, from the `ep_*` marks) and over the tensor
    ranks on its hidden axis (`tp`, a TensorSplits over the tensor ranks; proj_bias whole).
    Slice rank q = ep rank x tp + tensor rank, its files' place in the section, holds ep slice
    q // tp of tensor slice q % tp: a local slice sits in a "middle" shape (the expert axis
    whole, the hidden one this tensor rank's), which sits in the whole. The interface is
    TensorSplits' as read_resliced, read_owned and the manifest use it, so a section split both
    ways reads into any other split, and the other way round.

        manifest: {"size": ep x tp, "ep": {TensorSplits over ep}, "tp": {over tp}}
    """

    def __init__(self, ep: TensorSplits, tp: TensorSplits):
        self.ep, self.tp = ep, tp
        self.size = ep.size * tp.size
        self.splits = {**tp.splits, **ep.splits}  # every name split either way

    def to_dict(self) -> dict:
        return {"size": self.size, "ep": self.ep.to_dict(), "tp": self.tp.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> ExpertSplits:
        """ValueError unless d is {size, ep, tp} with size = ep's x tp's."""
        try:
            out = cls(TensorSplits.from_dict(d["ep"]), TensorSplits.from_dict(d["tp"]))
        except (KeyError, TypeError, AttributeError):
            raise ValueError("tensor is not {size, ep, tp}") from None
        if d.get("size") != out.size:
            raise ValueError(f"tensor.size {d.get('size')!r} is not ep x tp = {out.size}")
        return out

    def _middle(self, name: str, local_shape) -> tuple:
        return self.ep.whole_shape(name, local_shape)

    def whole_shape(self, name: str, local_shape) -> tuple:
        return self.tp.whole_shape(name, self._middle(name, local_shape))

    def whole_shapes(self, layout) -> dict:
        return {name: self.whole_shape(name, shape) for name, shape in layout.shapes().items()}

    def check_slices(self, layout) -> None:
        """TensorSplits.check_slices of each split: ep's on the local shapes, tp's on the
        middle ones."""
        self.ep.check_slices(layout)
        middle = {name: self._middle(name, shape) for name, shape in layout.shapes().items()}
        self.tp.check_slices(type("Shapes", (), {"shapes": lambda _: middle})())

    def same_slice(self, name: str, other, rank: int) -> bool:
        j, t = divmod(rank, self.tp.size)
        return (isinstance(other, ExpertSplits) and other.tp.size == self.tp.size
                and self.ep.same_slice(name, other.ep, j)
                and self.tp.same_slice(name, other.tp, t))

    def whole_indices(self, name: str, local_shape, rank: int, start: int,
                      n: int) -> np.ndarray:
        j, t = divmod(rank, self.tp.size)
        middle = self.ep.whole_indices(name, local_shape, j, start, n)  # no padding there
        return self.tp.whole_of(name, self._middle(name, local_shape), t, middle)

    def locate(self, name: str, local_shape, whole: np.ndarray):
        t, middle = self.tp.locate(name, self._middle(name, local_shape), whole)
        j, local = self.ep.locate(name, local_shape, middle)
        return j * self.tp.size + t, local


def read_resliced(reader, state: str, name: str, start: int, out: np.ndarray,
                  ours: TensorSplits, tp_rank: int, local_shape, saved: TensorSplits,
                  saved_shape) -> None:
    """Fill `out` with the flat elements [start, start + len(out)) of `name`'s `state` in
    this rank's local slice (`ours`, tensor rank `tp_rank`, shaped `local_shape`) from a
    checkpoint split as `saved` (local slices shaped `saved_shape`), through `reader`
    (store.ShardReader); padding is zero."""
    if ours.same_slice(name, saved, tp_rank):
        reader.read(state, name, start, out, tp_rank if name in saved.splits else 0)
        return
    for lo in range(0, len(out), _CHUNK):
        part = out[lo : lo + _CHUNK]
        whole = ours.whole_indices(name, local_shape, tp_rank, start + lo, len(part))
        real = np.flatnonzero(whole >= 0)
        part[whole < 0] = 0
        holder, at = saved.locate(name, saved_shape, whole[real])
        for t in np.unique(holder):
            mine = holder == t
            first, last = int(at[mine].min()), int(at[mine].max())
            buf = np.empty(last - first + 1, out.dtype)
            reader.read(state, name, first, buf, int(t))
            part[real[mine]] = buf[at[mine] - first]

"""What the engine does differently under tensor parallelism (the mesh's tp > 1).

Each parameter of a tensor-parallel model (zmpi.parallel.tensor) carries `tp_split`: the axis
it is split along over the tensor ranks (and `tp_index`, the entries it holds), or None where
every tensor rank holds it whole (LayerNorms, row-parallel biases, the embedding). ZeRO then
partitions each rank's local parameters over the data-parallel group as if they were a whole
model; what needs the split is:

    param_ranges(layout, unit_params, strategy, keep) where the parameters `keep` selects
                                                     sit in the optimizer's gradient buffer
    replicated_ranges(layout, unit_params, strategy)  ... the replicated parameters
    sequence_ranges(layout, unit_params, strategy)    ... those marked `sequence_parallel`
                                                     (gradients partial per tensor rank)
    sum_sequence_parallel_grads(engine, grads)       sum those over the tensor ranks, once a
                                                     step, after the data-parallel reduction
    tensor_norm_sq(engine, sumsq, grads, grad_scale) the global gradient norm squared: split
                                                     parameters summed over the tensor ranks,
                                                     replicated ones counted once
    gather_tensor_slices(value, parameter, tp)       a parameter's whole value from its slices
"""
from __future__ import annotations

import numpy as np

from zmpi.backend import array_module


def param_ranges(layout, unit_params, strategy, keep) -> list[slice]:
    """Slices of the optimizer's gradient buffer (this rank's shard when the strategy shards
    the optimizer, else the full layout) that hold the parameters `keep(parameter)` selects,
    in layout order."""
    params = {name: p for unit in unit_params for name, p in unit.items()}
    if strategy.shard_optimizer:
        pieces = ((name, at, n) for name, _, at, n in layout.owned_pieces(strategy.rank))
    else:
        pieces = ((slot.name, layout.full_offsets[u] + slot.offset, slot.numel)
                  for u, unit in enumerate(layout.units) for slot in unit.slots)
    return [slice(at, at + n) for name, at, n in pieces if keep(params[name])]


def replicated_ranges(layout, unit_params, strategy, skip=frozenset()) -> list[slice]:
    """The `param_ranges` of the tensor-replicated parameters, but those whose id is in
    `skip` (a pipeline stage's held copies, counted by their owner)."""
    return param_ranges(layout, unit_params, strategy, lambda p: id(p) not in skip
                        and getattr(p, "tp_split", None) is None)


def sequence_ranges(layout, unit_params, strategy) -> list[slice]:
    """The `param_ranges` of the parameters marked `sequence_parallel` (sequence parallelism:
    LayerNorms, the position embedding), whose gradient each tensor rank computes from its
    own sequence shard only."""
    return param_ranges(layout, unit_params, strategy,
                        lambda p: getattr(p, "tp_split", None) is None
                        and getattr(p, "sequence_parallel", False))


def sum_sequence_parallel_grads(engine, grads) -> None:
    """Sum, in place, the gradients of the `sequence_parallel` parameters (`engine.tp_sequence`
    slices of `grads`, the optimizer's gradients after the data-parallel reduction) over the
    tensor ranks: one `tp_comm.allreduce` of their concatenation, in the storage dtype, so the
    overflow check, the norm and Adam see whole, identical gradients on every tensor rank. The
    slices are the same on every tensor rank (their layouts are). Nothing without them."""
    allreduce_ranges(grads, engine.tp_sequence, engine.mesh.tp_comm)


def allreduce_ranges(grads, ranges: list[slice], comm) -> None:
    """Sum `grads[s]` for every slice s in `ranges` over `comm`, in place: one allreduce of
    their concatenation (the ranges have the same sizes, in the same order, on every rank of
    `comm`). Nothing for no ranges."""
    if not ranges:
        return
    xp = array_module(grads)
    buf = xp.concatenate([grads[s] for s in ranges])
    comm.allreduce(buf)
    at = 0
    for s in ranges:
        n = s.stop - s.start
        grads[s] = buf[at:at + n]
        at += n


def ranges_sumsq(grads, ranges: list[slice], dtype) -> float:
    """Sum of squares of `grads[s]` over the slices in `ranges`, computed in `dtype`."""
    xp = array_module(grads)
    return sum(float((xp.asarray(grads[s], dtype=dtype) ** 2).sum()) for s in ranges)


def tensor_norm_sq(engine, sumsq: float, grads, grad_scale: float) -> float:
    """The model-wide sum of squared (scaled) gradients from this rank's `sumsq` (over its
    optimizer gradients): summed over the data-parallel shards, then split parameters add up
    over the tensor ranks and replicated ones (identical on every tensor rank) count once."""
    replicated = ranges_sumsq(grads, engine.tp_replicated, engine.master_dtype) * grad_scale**2
    if engine.strategy.shard_optimizer:  # each shard group holds the local model once
        sumsq = engine.strategy.comm.allreduce_scalar(sumsq)
        replicated = engine.strategy.comm.allreduce_scalar(replicated)
    return engine.mesh.tp_comm.allreduce_scalar(sumsq - replicated) + replicated


def gather_tensor_slices(value, parameter, tp, mark: str = "tp") -> np.ndarray:
    """The whole value of `parameter` from every tensor rank's slice (`value`, host), its
    padding dropped (a padded vocabulary, at any tp), or a copy of `value` where it is not
    split (a collective over `tp` when it is and tp.size > 1). mark: the attributes that say
    how it is split, `<mark>_split` (the axis), `<mark>_index` (this rank's indices along
    it), `<mark>_full` (the unpadded length, if padded): "tp" (zmpi.parallel.tensor), or "ep"
    with `tp` the expert-parallel group (zmpi.parallel.expert: the experts' axis)."""
    axis = getattr(parameter, f"{mark}_split", None)
    if axis is None:
        return value.copy()
    mine = (np.asarray(getattr(parameter, f"{mark}_index")), np.ascontiguousarray(value))
    parts = [mine] if tp.size == 1 else tp.allgather_object(mine)
    shape = list(value.shape)
    shape[axis] = sum(len(index) for index, _ in parts)
    full = np.empty(shape, value.dtype)
    for index, part in parts:
        taken = [slice(None)] * full.ndim
        taken[axis] = index
        full[tuple(taken)] = part
    kept = [slice(None)] * full.ndim  # a padded split (the vocabulary) drops its padding
    kept[axis] = slice(getattr(parameter, f"{mark}_full", None))
    return full[tuple(kept)]

"""Tensor-parallel plans: a built module's layers replaced by their tensor-parallel slices.

A layer class names its plan as plain data, so zmpi.nn needs nothing of this package:

    class MLP(Module):
        tp_plan = {"fc": "colwise", "proj": "rowwise"}
    class CausalSelfAttention(Module):
        tp_plan = {"qkv": "colwise_heads", "proj": "rowwise"}

    parallelize(unit, tp)     # every module in `unit` whose class names a plan, in place
    parallelize(unit, tp, sequence_parallel=True)   # the same, with sequence parallelism

`parallelize` runs on one unit right after it is built (GPT does it unit by unit), so a rank
holds one unit's full weights for a moment and never the whole model. The styles:

    colwise        Linear -> ColumnParallelLinear: this rank's contiguous out/T columns
    rowwise        Linear -> RowParallelLinear: this rank's contiguous in/T rows
    colwise_heads  the fused [q | k | v] Linear of attention -> ColumnParallelLinear holding
                   this rank's heads of each of q, k and v (so the local qkv is again
                   [q | k | v] for n_head / T heads); the module's `n_head` becomes n_head / T
                   and its `head_offset` the first of them (rank x n_head / T)
    gqa_heads      grouped-query attention's q Linear (planned on q; k and v follow): q ->
                   ColumnParallelLinear of this rank's n_head / T query heads; k, v ->
                   ColumnParallelLinear of its n_kv_head / T key/value heads where T divides
                   n_kv_head, else (n_kv_head < T, T a multiple of it) ReplicatedHeadsLinear,
                   the whole k, v on every rank computing the one head its query heads read,
                   gradient summed over tp (Megatron's replicated key/value heads); the
                   module's `n_head`, `n_kv_head` become the local counts and its
                   `head_offset` its first query head (rank x n_head / T)
    sequence       a replicated module (a LayerNorm or RMSNorm) that runs on the sequence
                   shard under sequence parallelism: its Parameters are marked
                   `sequence_parallel = True` (`mark_sequence_parallel`); without sequence
                   parallelism, nothing

With sequence_parallel=True the column layers gather the sequence at their input and the row
layers reduce-scatter it at their output (linear.py, regions.py), so the activations between
the tensor-parallel regions are each rank's sequence shard (B, S/T, C). With tp.size == 1
nothing changes. A size T that does not divide a layer (features, heads) is a ValueError
naming it.
"""
from __future__ import annotations

import numpy

from zmpi.nn.layers import LayerNorm, Linear
from zmpi.nn.llama_layers import RMSNorm
from zmpi.parallel.tensor.linear import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    contiguous,
    split_size,
)


def _host(p):
    """The full values of a Parameter built on the host, in float64 (its slices are cast back
    to its dtype, so nothing is rounded twice)."""
    return None if p is None else numpy.asarray(p.data, dtype=numpy.float64)


def mark_sequence_parallel(*modules) -> None:
    """Mark every Parameter of `modules` (Modules or Parameters) `sequence_parallel = True`
    (Megatron's name): a parameter every tensor rank holds whole, whose gradient each rank
    computes from its own sequence shard only, so the engine sums it over the tensor ranks
    (zmpi/engine/tensor.py) before the optimizer reads it."""
    for m in modules:
        for p in [m] if not hasattr(m, "parameters") else m.parameters():
            p.sequence_parallel = True


def _colwise(module, name, tp, sequence_parallel):
    layer = getattr(module, name)
    return ColumnParallelLinear.from_full(
        _host(layer.weight), _host(layer.bias), tp,
        contiguous(layer.weight.shape[1], tp, f"{name} out_features"), layer.weight.dtype,
        sequence_parallel=sequence_parallel)


def _rowwise(module, name, tp, sequence_parallel):
    layer = getattr(module, name)
    return RowParallelLinear.from_full(
        _host(layer.weight), _host(layer.bias), tp,
        contiguous(layer.weight.shape[0], tp, f"{name} in_features"), layer.weight.dtype,
        sequence_parallel=sequence_parallel)


def _sequence(module, name, tp, sequence_parallel):
    layer = getattr(module, name)
    if sequence_parallel:
        mark_sequence_parallel(layer)
    return layer


def _colwise_heads(module, name, tp, sequence_parallel):
    layer = getattr(module, name)
    C = layer.weight.shape[1] // 3
    heads = split_size(module.n_head, tp, "n_head")
    hd = C // module.n_head
    mine = numpy.arange(tp.rank * heads * hd, (tp.rank + 1) * heads * hd)  # within q, k or v
    columns = numpy.concatenate([part * C + mine for part in range(3)])
    module.n_head, module.head_offset = heads, tp.rank * heads  # the model's heads it keeps
    return ColumnParallelLinear.from_full(_host(layer.weight), _host(layer.bias), tp, columns,
                                          layer.weight.dtype, sequence_parallel=sequence_parallel)


def _gqa_heads(module, name, tp, sequence_parallel):
    heads = split_size(module.n_head, tp, "n_head")
    nkv = module.n_kv_head
    if nkv % tp.size and tp.size % nkv:
        raise ValueError(f"n_kv_head={nkv} and the tensor-parallel size {tp.size}: one must "
                         "divide the other (key/value heads split over the tensor ranks, or "
                         "each replicated over tp / n_kv_head of them)")
    for kv in ("k", "v"):
        layer = getattr(module, kv)
        if type(layer) is not Linear:
            raise TypeError(f"{type(module).__name__}.{kv}: gqa_heads splits a zmpi.nn.Linear, "
                            f"not {type(layer).__name__}")
        hd = layer.weight.shape[1] // nkv
        if nkv >= tp.size:
            part = ColumnParallelLinear.from_full(
                _host(layer.weight), None, tp, contiguous(nkv * hd, tp, f"{kv} out_features"),
                layer.weight.dtype, sequence_parallel=sequence_parallel)
        else:  # this rank's query heads all read key/value head rank // (tp / n_kv_head)
            head = tp.rank // (tp.size // nkv)
            part = ReplicatedHeadsLinear(_host(layer.weight), tp,
                                         numpy.arange(head * hd, (head + 1) * hd),
                                         layer.weight.dtype, sequence_parallel)
        setattr(module, kv, part)
    module.n_head, module.n_kv_head = heads, max(nkv // tp.size, 1)
    module.head_offset = tp.rank * heads  # the model's query heads it keeps
    return _colwise(module, name, tp, sequence_parallel)


STYLES = {"colwise": _colwise, "rowwise": _rowwise, "colwise_heads": _colwise_heads,
          "gqa_heads": _gqa_heads, "sequence": _sequence}


def parallelize(unit, tp, sequence_parallel: bool = False):
    """Apply every plan in `unit` (its own and its submodules') over the Comm `tp`, in place;
    returns `unit`. Each attribute planned to be split must be a zmpi.nn.Linear built on the
    host, each one planned "sequence" a zmpi.nn.LayerNorm or RMSNorm."""
    if tp is None or tp.size == 1:
        return unit
    for module in list(unit.modules()):
        for name, style in getattr(type(module), "tp_plan", {}).items():
            layer = getattr(module, name)
            kinds = (LayerNorm, RMSNorm) if style == "sequence" else (Linear,)
            if type(layer) not in kinds:  # (a ColumnParallelLinear is split already)
                raise TypeError(f"{type(module).__name__}.{name}: a tensor-parallel plan "
                                f"{'marks' if style == 'sequence' else 'splits'} a "
                                f"{' or '.join('zmpi.nn.' + k.__name__ for k in kinds)}, not "
                                f"{type(layer).__name__}")
            if style not in STYLES:
                raise ValueError(f"{type(module).__name__}.tp_plan: unknown style {style!r}; "
                                 f"styles: {', '.join(STYLES)}")
            setattr(module, name, STYLES[style](module, name, tp, sequence_parallel))
    return unit

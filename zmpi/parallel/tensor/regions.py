"""Where a tensor-parallel region begins and ends: Megatron-LM's conjugate operators f and g
(Shoeybi et al. 2019, section 3), as Modules with explicit forward and backward.

    f = CopyToTensorRegion(tp)      forward: identity       backward: allreduce(dy) over tp
    g = ReduceFromTensorRegion(tp)  forward: allreduce(x)   backward: identity

f sits where a replicated activation enters a region whose ranks each compute a part of the
result from it (ColumnParallelLinear's input): each rank's backward yields only its part of
the input gradient, and f sums them. g sits where the region ends in a sum of per-rank partial
results (RowParallelLinear's output). f's forward is g's backward and the other way round.

Sequence parallelism (Korthikanti et al. 2022) keeps the activations between the regions split
along the sequence, each rank holding (B, T/tp, ...), positions [r T/tp, (r+1) T/tp) on rank r.
Then f and g become

    g-bar = GatherFromSequenceRegion(tp)       forward: allgather along the sequence
                                               backward: reduce-scatter along the sequence
    g     = ReduceScatterToSequenceRegion(tp)  forward: reduce-scatter along the sequence
                                               backward: allgather along the sequence

A region whose result is whole on every rank, with its input gradient summed inside (an MoE
layer under tensor parallelism), runs on the gathered sequence between GatherWholeSequence
(forward: allgather; backward: this rank's shard of the whole gradient) and
ShardWholeSequence (forward: this rank's shard; backward: allgather).

The sequence is axis 1 of (B, T, ...) and Comm's collectives take contiguous buffers split
along their first axis, so each of them moves a sequence-major copy, (T, B, ...) or
(T/tp, B, ...), and returns a fresh C-contiguous (B, ...) array: one copy on each side of the
collective (`gather_sequence`, `reduce_scatter_sequence`). A length T that tp does not divide
is a ValueError (`sequence_shard`), raised alike on every rank before any collective.

`tp` is a zmpi Comm (`mesh.tp_comm`); every allreduce is one `tp.allreduce` of a contiguous
buffer, so it is counted in that Comm's counters. With tp.size == 1 both are identities and
never communicate. The sum runs in the activations' compute dtype (`compute_dtype`: float32
for float16/bfloat16 activations on the host, float64 stays float64).

`inplace=True` lets the operator reduce the array it is handed (when it is already contiguous
and in the compute dtype) instead of a copy: for a caller that has just made that array and
does not read it again (the parallel linear layers pass their fresh matmul results).
"""

from zmpi.backend import array_module, compute_dtype
from zmpi.nn.base import Module


def sequence_shard(length: int, tp) -> int:
    """length / tp.size, the positions each rank holds under sequence parallelism; ValueError
    unless tp.size divides `length`."""
    if length % tp.size:
        raise ValueError(f"sequence length {length} is not divisible by the tensor-parallel "
                         f"size {tp.size}: sequence parallelism gives every rank an equal "
                         f"share of the positions")
    return length // tp.size


def allreduce_sum(tp, a, inplace: bool = False):
    """The elementwise sum of `a` over the ranks of `tp`, in `compute_dtype(a)`: one
    `tp.allreduce` of a contiguous buffer (`a` itself when `inplace` allows it, else a copy).
    With tp.size == 1: `a` in the compute dtype, without communicating."""
    dtype = compute_dtype(a)
    if tp.size == 1:
        return a.astype(dtype, copy=False)
    if inplace and a.dtype == dtype and a.flags.c_contiguous:
        buf = a
    else:
        buf = array_module(a).array(a, dtype=dtype, order="C", copy=True)
    return tp.allreduce(buf)


class CopyToTensorRegion(Module):
    """Megatron's f: forward returns x unchanged; backward returns the sum of dy over the
    ranks of `tp` (one allreduce of dy's size)."""

    def __init__(self, tp, inplace: bool = False):
        self.tp = tp
        self.inplace = inplace

    def forward(self, x):
        self._save(True)  # nothing to keep; marks that a backward may follow
        return x

    def backward(self, dy):
        self._pop()
        return allreduce_sum(self.tp, dy, self.inplace)


class ReduceFromTensorRegion(Module):
    """Megatron's g: forward returns the sum of x over the ranks of `tp` (one allreduce of
    x's size); backward returns dy unchanged."""

    def __init__(self, tp, inplace: bool = False):
        self.tp = tp
        self.inplace = inplace

    def forward(self, x):
        self._save(True)
        return allreduce_sum(self.tp, x, self.inplace)

    def backward(self, dy):
        self._pop()
        return dy


def gather_sequence(tp, x):
    """(B, T, ...) on every rank from each rank's (B, T/tp, ...) shard `x`, the shards in rank
    order along axis 1, in `compute_dtype(x)`: one `tp.allgather` of a sequence-major copy
    (T/tp, B, ...) into a new (T, B, ...) buffer, returned as a fresh C-contiguous (B, T, ...)
    array. With tp.size == 1: `x` in the compute dtype, without communicating."""
    dtype = compute_dtype(x)
    if tp.size == 1:
        return x.astype(dtype, copy=False)
    xp = array_module(x)
    send = xp.ascontiguousarray(xp.swapaxes(x, 0, 1), dtype=dtype)  # (T/tp, B, ...)
    recv = xp.empty((tp.size * send.shape[0], *send.shape[1:]), dtype)
    tp.allgather(send, recv)
    return xp.ascontiguousarray(xp.swapaxes(recv, 0, 1))


def reduce_scatter_sequence(tp, x):
    """This rank's shard (B, T/tp, ...) of the sum over the ranks of `tp` of `x` (B, T, ...), in
    `compute_dtype(x)`: one `tp.reduce_scatter` of a sequence-major copy (T, B, ...), returned
    as a fresh C-contiguous array. ValueError unless tp.size divides T. With tp.size == 1: `x`
    in the compute dtype, without communicating."""
    dtype = compute_dtype(x)
    if tp.size == 1:
        return x.astype(dtype, copy=False)
    xp = array_module(x)
    local = sequence_shard(x.shape[1], tp)
    send = xp.ascontiguousarray(xp.swapaxes(x, 0, 1), dtype=dtype)  # (T, B, ...)
    recv = xp.empty((local, *send.shape[1:]), dtype)
    tp.reduce_scatter(send, recv)
    return xp.ascontiguousarray(xp.swapaxes(recv, 0, 1))


class GatherFromSequenceRegion(Module):
    """Korthikanti et al.'s g-bar, sequence parallelism's f: forward gathers the sequence,
    x (B, T/tp, C) -> (B, T, C), the same on every rank (`gather_sequence`); backward returns
    this rank's shard of the sum of dy (B, T, C) over the ranks (`reduce_scatter_sequence`).
    Each direction is one collective of B T C elements."""

    def __init__(self, tp):
        self.tp = tp

    def forward(self, x):
        self._save(True)  # nothing to keep; marks that a backward may follow
        return gather_sequence(self.tp, x)

    def backward(self, dy):
        self._pop()
        return reduce_scatter_sequence(self.tp, dy)


class ReduceScatterToSequenceRegion(Module):
    """Sequence parallelism's g: forward returns this rank's shard (B, T/tp, C) of the sum of
    the per-rank partial results x (B, T, C) (`reduce_scatter_sequence`); backward gathers dy
    (B, T/tp, C) -> (B, T, C) (`gather_sequence`). Each direction is one collective of B T C
    elements."""

    def __init__(self, tp):
        self.tp = tp

    def forward(self, x):
        self._save(True)
        return reduce_scatter_sequence(self.tp, x)

    def backward(self, dy):
        self._pop()
        return gather_sequence(self.tp, dy)


def sequence_slice(tp, x):
    """This rank's sequence shard (B, T/tp, ...) of `x` (B, T, ...), a fresh C-contiguous copy,
    without communicating. ValueError unless tp.size divides T."""
    local = sequence_shard(x.shape[1], tp)
    return array_module(x).ascontiguousarray(x[:, tp.rank * local:(tp.rank + 1) * local])


class GatherWholeSequence(Module):
    """The entry of a region that computes the whole sequence's result, the same on every rank,
    and whose input gradient comes out whole, summed over tp inside it (an MoE layer under
    tensor parallelism: zmpi.parallel.expert.tensor). forward gathers the sequence, x
    (B, T/tp, C) -> (B, T, C) (`gather_sequence`); backward returns this rank's shard of dy
    (`sequence_slice`): already the whole gradient, so nothing is summed. One allgather
    forward."""

    def __init__(self, tp):
        self.tp = tp

    def forward(self, x):
        self._save(True)
        return gather_sequence(self.tp, x)

    def backward(self, dy):
        self._pop()
        return sequence_slice(self.tp, dy)


class ShardWholeSequence(Module):
    """GatherWholeSequence's exit: forward keeps this rank's shard (B, T/tp, C) of a result that
    is whole and the same on every rank (`sequence_slice`); backward gathers dy, each rank's
    shard of it, into the whole (B, T, C) gradient (`gather_sequence`). One allgather
    backward."""

    def __init__(self, tp):
        self.tp = tp

    def forward(self, x):
        self._save(True)
        return sequence_slice(self.tp, x)

    def backward(self, dy):
        self._pop()
        return gather_sequence(self.tp, dy)

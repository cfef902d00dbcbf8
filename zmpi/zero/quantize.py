"""Block-wise symmetric quantization to int8 or int4: the wire format of ZeRO++'s quantized
collectives (Wang et al., 2023; zeropp.py).

A *row* of L float elements (any float dtype, NumPy or CuPy: the array module of the input)
is cut into *segments* at `cuts` (their starts, the first 0: a caller cuts where one tensor
ends and the next begins, so that no scale spans two tensors of different magnitudes), and
each segment into blocks of `block` consecutive elements (its last one shorter when `block`
does not divide it). Each block b gets one float32 scale s_b = max|x| over the block / qmax
(qmax = 127 for int8, 7 for int4), and each element the integer q = rint(x / s_b) in [-qmax,
qmax]; an all-zero block has s_b = 0 and q = 0. Dequantized, x' = q s_b, so |x - x'| <= s_b /
2 = max|x| / (2 qmax) within the block (plus float32 rounding). A block holding an inf or a
NaN gets a non-finite scale, so its dequantized values are non-finite too: the loss scaler
still sees an fp16 overflow through a quantized reduction.

One row on the wire is `row_nbytes(L, bits, block, cuts)` bytes, in one uint8 buffer:

    [n_blocks(L, block, cuts) float32 scales][values: L bytes (int8) or ceil(L / 2) (int4)]

int8 values are two's complement bytes; int4 values are stored as q + 8 in a nibble, two per
byte, the element of even index in the low nibble (an odd L leaves the last high nibble 0).
A batch of rows (all cut alike) is a 2-D (rows, row_nbytes) buffer: row r is what rank r
sends or receives. The arithmetic allocates float32 temporaries of the rows' size (not in the
ledger: they live only during the call); the wire buffers are the caller's. Each segment is a
few array operations: a unit of a dozen tensors costs a few dozen kernels on a GPU.
"""
from __future__ import annotations

from itertools import pairwise

import numpy as np

from zmpi.backend import array_module

QMAX = {8: 127, 4: 7}  # the largest |q| of each width (symmetric: -qmax..qmax)


def segments(numel: int, cuts=(0,)) -> list[tuple[int, int]]:
    """[start, stop) of each segment of a row of `numel` elements cut at `cuts`."""
    if not cuts or cuts[0] != 0 or any(b <= a for a, b in pairwise(cuts)) or \
            cuts[-1] >= max(numel, 1):
        raise ValueError(f"cuts {list(cuts)} must rise from 0 inside a row of {numel} elements")
    return list(pairwise([*cuts, numel]))


def n_blocks(numel: int, block: int, cuts=(0,)) -> int:
    """Blocks (scales) of a row of `numel` elements cut at `cuts`."""
    return sum(-(-(b - a) // block) for a, b in segments(numel, cuts))


def row_nbytes(numel: int, bits: int, block: int, cuts=(0,)) -> int:
    """Bytes of one quantized row of `numel` elements: its scales, then its values."""
    _check(bits, block)
    return 4 * n_blocks(numel, block, cuts) + (numel * bits + 7) // 8


def _check(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"quantization to {bits} bits: only 8 and 4 are supported")
    if block < 2 or block % 2:
        raise ValueError(f"quantization block of {block} elements: must be even and >= 2")


def _blocked(x, block):
    """x (rows, L) as float32 (rows, blocks, block), zero-padded: a new array."""
    xp = array_module(x)
    rows, numel = x.shape
    nb = -(-numel // block)
    wide = xp.zeros((rows, nb * block), xp.float32)
    wide[:, :numel] = x
    return wide.reshape(rows, nb, block)


def quantize(x, bits: int, block: int, cuts=(0,), out=None):
    """x (rows, L) float -> (rows, row_nbytes(L, bits, block, cuts)) uint8, written into
    `out` if given (same array module), else a new array. The caller owns both."""
    _check(bits, block)
    xp = array_module(x)
    rows, numel = x.shape
    qmax = QMAX[bits]
    q = xp.empty((rows, numel), xp.float32)
    scales = []
    for a, b in segments(numel, cuts):
        blocks = _blocked(x[:, a:b], block)
        scale = (xp.abs(blocks).max(axis=2) / np.float32(qmax)).astype(xp.float32)
        safe = xp.where((scale > 0) & xp.isfinite(scale), scale, xp.float32(1))
        part = xp.clip(xp.rint(blocks / safe[:, :, None]), -qmax, qmax)
        part = xp.where(xp.isfinite(part), part, 0)  # NaN: the block's scale carries it
        q[:, a:b] = part.reshape(rows, -1)[:, :b - a]
        scales.append(scale)
    nb = n_blocks(numel, block, cuts)
    if out is None:
        out = xp.empty((rows, row_nbytes(numel, bits, block, cuts)), xp.uint8)
    out[:, :4 * nb] = xp.concatenate(scales, axis=1).view(xp.uint8)
    if bits == 8:
        out[:, 4 * nb:] = q.astype(xp.int8).view(xp.uint8)
    else:
        nibbles = xp.zeros((rows, numel + numel % 2), xp.uint8)
        nibbles[:, :numel] = q + 8
        out[:, 4 * nb:] = nibbles[:, 0::2] | nibbles[:, 1::2] * 16
    return out


def dequantize(wire, numel: int, bits: int, block: int, cuts=(0,)):
    """(rows, row_nbytes(numel, bits, block, cuts)) uint8 -> (rows, numel) float32, new."""
    _check(bits, block)
    xp = array_module(wire)
    rows, nb = wire.shape[0], n_blocks(numel, block, cuts)
    if wire.shape[1] != row_nbytes(numel, bits, block, cuts):
        raise ValueError(f"dequantize: rows of {wire.shape[1]} bytes, but {numel} elements in "
                         f"int{bits} with blocks of {block} take "
                         f"{row_nbytes(numel, bits, block, cuts)}")
    scale = xp.ascontiguousarray(wire[:, :4 * nb]).view(xp.float32)  # (rows, nb), aligned
    values = wire[:, 4 * nb:]
    if bits == 8:
        q = values.astype(xp.int8)  # the bytes read back as signed
    else:
        q = xp.stack([values % 16, values // 16], axis=2).reshape(rows, -1)[:, :numel]
    out, first = xp.empty((rows, numel), xp.float32), 0
    for a, b in segments(numel, cuts):
        blocks = _blocked(q[:, a:b], block)
        if bits == 4:
            blocks -= 8  # the padding's -8 is cut off below
        last = first + blocks.shape[1]
        with np.errstate(invalid="ignore"):  # 0 x inf: a non-finite block stays non-finite
            blocks *= scale[:, first:last, None]
        out[:, a:b] = blocks.reshape(rows, -1)[:, :b - a]
        first = last
    return out

"""The error-compensated 1-bit allreduce: 1-bit Adam's exchange of the momentum (Tang et al.,
*1-bit Adam*, ICML'21, Algorithm 1; DeepSpeed's `compressed_allreduce`,
deepspeed/runtime/comm/nccl.py), over a `Comm`, on NumPy or CuPy arrays.

    average = CompressedAllreduce(comm, numel, np.float32, ledger, xp)
    average(m)              # m (numel,) <- the compressed average of every rank's m, in place
    average.sent_bytes()    # what one call sends from this rank, as Comm counts it
    average.reset()         # forget the errors (1-bit Adam does on a checkpoint load)

The buffer is padded with zeros to n elements, a multiple of 8 N, so that each rank's chunk
of c = n / N elements packs into c / 8 whole bytes. A sign bit is 1 for x >= 0 (-0.0 too) and
stands for +1, 0 for -1; a scale s stands for the L2 norm of what it compresses over the
square root of its length (the RMS), so that s (2 bit - 1) has the norm of the original.

    worker (every rank)    x = [m, 0...] + worker_error (n); s = ||x|| / sqrt(n)
                           worker_error <- x - s sign(x); chunk j of sign bits goes to rank j
    phase 1                alltoall of the packed bits (n / 8 bytes), allgather of s
    server (chunk r)       y = sum over ranks i in rank order of (s_i / N) sign_i + server_error
                           t = ||y|| / sqrt(c); server_error <- y - t sign(y)
    phase 2                allgather of the server's packed bits (c / 8 bytes each) and of t
    every rank             m <- chunk j: t_j sign_j, for every j (the padding dropped)

Exactly DeepSpeed's algorithm: one worker scale for the whole buffer, one server scale per
chunk, the errors kept per rank between calls (zeroed when first used and by `reset`). On one
rank there is nothing to average and `m` is left as it is, as DeepSpeed does.

Bytes sent per call by each rank, as Comm counts them (`sent_bytes`), with s the scales'
itemsize: (N - 1) c / 8 (alltoall: every chunk but its own) + (N - 1) s (allgather of the
worker scales) + (N - 1) c / 8 (allgather of the server bits) + (N - 1) s (server scales):
2 (N - 1) / N x n / 8 + 2 (N - 1) s. An allreduce of the same n elements sends 2 (N - 1) / N x
n x itemsize: 1/16 of that in fp16, 1/32 in fp32, plus the scales.

Buffers: the worker error (n) and the server error (c), in the buffer's dtype, are held from
the first call until `reset` (ledger category `comm_buffer`); the packed bits and the scales
are allocated per call through the ledger and released before it returns. The arithmetic's
transients (a boolean and a float array of at most n elements) are not in the ledger.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["CompressedAllreduce", "padded_numel"]


def padded_numel(numel: int, world_size: int) -> int:
    """numel rounded up to a multiple of 8 x world_size (each chunk packs into whole bytes)."""
    unit = 8 * world_size
    return -(-numel // unit) * unit


class CompressedAllreduce:
    """The 1-bit average of a flat (numel,) buffer of `dtype` (float32 or float64) over
    `comm`, with error feedback; buffers through `ledger` (a zmpi.memory.MemoryLedger) on the
    array module `xp`."""

    def __init__(self, comm, numel: int, dtype, ledger, xp=np):
        self.comm, self.numel, self.dtype = comm, int(numel), np.dtype(dtype)
        self.ledger, self.xp = ledger, xp
        self.padded = padded_numel(self.numel, comm.size)  # n
        self.chunk = self.padded // comm.size  # c
        self.worker_error = self.server_error = None

    def sent_bytes(self) -> int:
        """Bytes this rank sends in one call (Comm's counters: alltoall and allgathers)."""
        n_ranks = self.comm.size
        return (n_ranks - 1) * (self.chunk // 4 + 2 * self.dtype.itemsize)

    def reset(self) -> None:
        """Drop both errors (released from the ledger); the next call starts from zero."""
        for buf in (self.worker_error, self.server_error):
            if buf is not None:
                self.ledger.release(buf)
        self.worker_error = self.server_error = None

    def __call__(self, buf):
        """buf (numel,) of `dtype`, every rank's own: replaced by the compressed average."""
        if buf.shape != (self.numel,) or buf.dtype != self.dtype:
            raise ValueError(f"compressed allreduce of {self.dtype} x {self.numel}: got "
                             f"{buf.dtype} x {buf.shape}")
        if self.comm.size == 1:
            return buf
        if self.worker_error is None:
            self.worker_error = self._alloc(self.padded, self.dtype, "onebit_worker_error", True)
            self.server_error = self._alloc(self.chunk, self.dtype, "onebit_server_error", True)
        held = []
        try:
            self._exchange(buf, held)
        finally:
            for b in held:
                self.ledger.release(b)
        return buf

    # ---- the algorithm

    def _exchange(self, buf, held) -> None:
        n_ranks, c = self.comm.size, self.chunk
        packed = c // 8  # bytes of one chunk's signs

        def alloc(numel, dtype, name):
            b = self._alloc(numel, dtype, name, False)
            held.append(b)
            return b

        x = self.worker_error
        x[:self.numel] += buf  # x = m + worker error (the padding: its error only)
        bits, scale = alloc(self.padded // 8, np.uint8, "onebit_bits"), \
            alloc(1, self.dtype, "onebit_scale")
        self._compress_(x, bits, scale)  # x <- the worker error this compression leaves
        # phase 1: chunk j of every rank's signs to rank j; every rank's scale to all
        received = alloc(self.padded // 8, np.uint8, "onebit_received")
        scales = alloc(n_ranks, self.dtype, "onebit_scales")
        self.comm.alltoall(bits, received)
        self.comm.allgather(scale, scales)
        # server of chunk `rank`: the mean of what the ranks sent, plus the server error
        y = self.server_error
        mean = alloc(c, self.dtype, "onebit_mean")
        mean.fill(0)
        for i in range(n_ranks):
            mean += self._signs(received[i * packed:(i + 1) * packed]) * (scales[i] / n_ranks)
        y += mean
        server_bits, server_scale = alloc(packed, np.uint8, "onebit_server_bits"), \
            alloc(1, self.dtype, "onebit_server_scale")
        self._compress_(y, server_bits, server_scale)  # y <- the new server error
        # phase 2: every server's compressed chunk to every rank
        gathered = alloc(self.padded // 8, np.uint8, "onebit_gathered")
        server_scales = alloc(n_ranks, self.dtype, "onebit_server_scales")
        self.comm.allgather(server_bits, gathered)
        self.comm.allgather(server_scale, server_scales)
        for j in range(n_ranks):  # chunk j, less the padding
            lo, hi = j * c, min((j + 1) * c, self.numel)
            if lo < hi:
                buf[lo:hi] = (self._signs(gathered[j * packed:(j + 1) * packed])[:hi - lo]
                              * server_scales[j])

    def _compress_(self, x, bits, scale) -> None:
        """bits <- the packed signs of x, scale[0] <- ||x|| / sqrt(len(x)); x <- x - scale
        sign(x), the error this compression leaves (in place)."""
        xp = self.xp
        scale[0] = xp.sqrt(xp.dot(x, x)) / self.dtype.type(math.sqrt(x.shape[0]))
        positive = x >= 0
        bits[...] = xp.packbits(positive)
        signs = positive.astype(self.dtype)
        signs *= 2
        signs -= 1
        signs *= scale[0]
        x -= signs

    def _signs(self, packed):
        """+1.0 / -1.0 in `dtype` for the bits of `packed` (uint8)."""
        signs = self.xp.unpackbits(packed).astype(self.dtype)
        signs *= 2
        signs -= 1
        return signs

    def _alloc(self, numel, dtype, name, zero):
        return self.ledger.allocate((numel,), dtype, "comm_buffer", "device", name, xp=self.xp,
                                    zero=zero)

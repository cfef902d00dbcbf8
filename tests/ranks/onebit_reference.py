"""A NumPy reference of 1-bit Adam for tests/test_onebit.py: one process simulates N ranks.

Written from the algorithm (Tang et al., ICML'21, Algorithm 1; DeepSpeed's
`compressed_allreduce` and `OnebitAdam`), not from zmpi's code: whole arrays, one formula per
line, every rank's worker and server in a loop. The arithmetic is in the arrays' dtype, with
the scalars rounded to it once and each formula evaluated in the order docs/onebit.md states,
so on NumPy zmpi must equal it bit for bit (float32), or to rounding where its inputs come
from another computation (fp64 gradients of the model).
"""
import numpy as np


def padded(numel, n_ranks):
    """numel rounded up to a multiple of 8 N: every rank's chunk packs into whole bytes."""
    return -(-numel // (8 * n_ranks)) * 8 * n_ranks


def signs(x):
    """+1 where x >= 0 (and -0.0), -1 elsewhere, in x's dtype."""
    return np.where(x >= 0, 1, -1).astype(x.dtype)


def compress(x):
    """(scale, signs, error) of x: scale = ||x|| / sqrt(len), error = x - scale signs."""
    scale = np.linalg.norm(x) / x.dtype.type(np.sqrt(x.shape[0]))
    s = signs(x)
    return scale, s, x - scale * s


class CompressedAverage:
    """The error-compensated 1-bit average of N ranks' buffers of `numel` elements."""

    def __init__(self, n_ranks, numel, dtype=np.float32):
        self.n_ranks, self.numel = n_ranks, numel
        self.n = padded(numel, n_ranks)
        self.c = self.n // n_ranks
        self.worker_error = [np.zeros(self.n, dtype) for _ in range(n_ranks)]
        self.server_error = [np.zeros(self.c, dtype) for _ in range(n_ranks)]

    def __call__(self, buffers):
        """buffers: one (numel,) array per rank; returns the average every rank receives."""
        n_ranks, c = self.n_ranks, self.c
        if n_ranks == 1:
            return buffers[0].copy()
        scales, sent = [], []
        for i, m in enumerate(buffers):  # worker i
            x = self.worker_error[i].copy()
            x[:self.numel] = x[:self.numel] + m
            scale, s, self.worker_error[i] = compress(x)
            scales.append(scale)
            sent.append(s)
        out = []
        for j in range(n_ranks):  # the server of chunk j
            y = np.zeros(c, buffers[0].dtype)
            for i in range(n_ranks):
                y = y + sent[i][j * c:(j + 1) * c] * (scales[i] / n_ranks)
            y = y + self.server_error[j]
            scale, s, self.server_error[j] = compress(y)
            out.append(scale * s)
        return np.concatenate(out)[:self.numel]


class OneBitAdam:
    """1-bit Adam on N simulated ranks sharing flat parameters `p` (numel,): Adam without bias
    correction on the averaged gradient for `freeze_step` steps, then each rank's momentum
    from its own gradient, averaged by CompressedAverage, with v frozen and the momentum of
    the elements whose gradient never rose above eps (sqrt(v) <= eps) set to 0."""

    def __init__(self, p, n_ranks, lr, freeze_step, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        self.p = p.copy()
        self.dtype = p.dtype.type
        self.m, self.v = np.zeros_like(p), np.zeros_like(p)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.freeze_step, self.t = freeze_step, 0
        self.average = CompressedAverage(n_ranks, p.shape[0], p.dtype)

    def warm(self):
        return self.t < self.freeze_step

    def step(self, grads, scales):
        """grads: the summed gradient (warm-up) or one gradient per rank; scales: the factor
        each is read with (one float, or one per rank)."""
        f = self.dtype
        b1, b2 = self.betas
        self.t += 1
        if self.t <= self.freeze_step:
            g = grads * f(scales)
            self.m = self.m * f(b1) + g * f(1 - b1)
            self.v = self.v * f(b2) + (g * g) * f(1 - b2)
        else:
            masked = np.sqrt(self.v) <= f(self.eps)  # no gradient above eps: no momentum
            local = [self.m * f(b1) + (g * f(s)) * f(1 - b1)
                     for g, s in zip(grads, scales, strict=True)]
            for m in local:
                m[masked] = 0
            self.m = self.average(local)
            self.m[masked] = 0
        self.p = self.p * f(1 - self.lr * self.wd) - (self.m / (np.sqrt(self.v) + f(self.eps))
                                                     ) * f(self.lr)
        return self.p

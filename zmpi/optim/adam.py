"""Adam and AdamW on flat arrays, in place (Kingma & Ba 2015; Loshchilov & Hutter 2019).

    opt = HostAdam(lr=1e-3, weight_decay=0.1)             # NumPy shards (host, or CPU run)
    finite, sumsq = opt.grad_stats(grads, grad_scale)     # before the step: overflow, norm
    opt.step_(param, grads, m, v, grad_scale, clip_coef)  # param, m, v updated in place
    opt.step_(..., publish=[(0, params)])                 # and params[...] = param, cast,
                                                          # chunk by chunk while in cache
    opt.step_count += 1; opt.update_(p[a:b], g[a:b], ...)  # one step, block by block (NVMe)

One update rule, `adam_chunk_`, serves every optimizer here. `Adam` applies it to the whole
shard at once: on CuPy that is a handful of device kernels. `HostAdam` (the ZeRO-Offload
host optimizer, Ren et al., ATC'21, Sec. 5.1) applies it to cache-sized chunks, so the
temporaries are two chunk-sized scratch arrays per thread instead of arrays the size of the
shard, and spreads the chunks over threads (NumPy ufuncs release the GIL). Because the rule is
elementwise and the gradient statistics are summed chunk by chunk in a fixed order, results do
not depend on the number of threads, and `HostAdam` on a host shard equals `HostAdam` on the
same shard in "device" memory on a CPU run bit for bit: offload changes where, not what.

Gradients are read, never written: they may be fp16/bf16 (the storage dtype) and are
converted chunk by chunk to the master dtype and multiplied by `grad_scale` (loss scale,
averaging) and `clip_coef`. `param`, `m` and `v` share the master dtype (fp32, or fp64).
"""
from __future__ import annotations

import math
from bisect import bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from zmpi import backend, kernels
from zmpi.backend import array_module, host_cores
from zmpi.kernels import host as host_kernels

HOST_CHUNK = 65536  # elements; p, m, v and two fp32 scratch chunks stay within L2/L3


def adam_chunk_(param, grads, m, v, scratch, step, lr, betas, eps, weight_decay, decoupled,
                grad_scale=1.0, clip_coef=1.0, bias_correction=True) -> None:
    """One Adam(W) update of a contiguous chunk, in place. `grads` (any float dtype) is read
    only; `scratch` is two arrays of the master dtype, each at least len(param) long.

    On NumPy arrays with the `fast` extra this is one compiled loop (host_kernels.adam), else
    ufuncs; both do the same operations on the same scalars, so they give the same bits."""
    n = param.shape[0]
    k = AdamCoefficients.of(param.dtype, step, lr, betas, eps, weight_decay, decoupled,
                            grad_scale * clip_coef, bias_correction)
    if host_kernels.adam is not None and array_module(param) is np:
        if grads.dtype != param.dtype:  # numba has no float16/bfloat16: convert first
            grads = host_kernels.cast_(scratch[0][:n], grads)
        host_kernels.adam(param, grads, m, v, *k)
    else:
        _adam_ufuncs_(param, grads, m, v, scratch[0][:n], scratch[1][:n], k)


class AdamCoefficients(tuple):
    """The update's scalars, computed in float64 and rounded once to the master dtype:
    (scale, l2, beta1, 1 - beta1, beta2, 1 - beta2, eps_hat, decay, step_size), with
    scale = grad_scale x clip_coef, l2 the L2 weight decay (0 for AdamW), eps_hat = eps
    sqrt(1 - beta2^t), decay = 1 - lr wd for AdamW (else 1), step_size = lr
    sqrt(1 - beta2^t) / (1 - beta1^t): so that p -= step_size m / (sqrt(v) + eps_hat) is
    p -= lr m_hat / (sqrt(v_hat) + eps) without dividing m and v. Without bias_correction
    (1-bit Adam, as DeepSpeed's OnebitAdam: zmpi.optim.onebit) eps_hat = eps, step_size = lr."""

    @classmethod
    def of(cls, dtype, step, lr, betas, eps, weight_decay, decoupled, scale,
           bias_correction=True):
        beta1, beta2 = betas
        bias1, bias2_sqrt = ((1 - beta1**step, math.sqrt(1 - beta2**step)) if bias_correction
                             else (1.0, 1.0))
        decay = 1 - lr * weight_decay if weight_decay and decoupled else 1.0
        l2 = weight_decay if weight_decay and not decoupled else 0.0
        values = (scale, l2, beta1, 1 - beta1, beta2, 1 - beta2, eps * bias2_sqrt, decay,
                  lr * bias2_sqrt / bias1)
        return cls(np.dtype(dtype).type(x) for x in values)


def _adam_ufuncs_(param, grads, m, v, g, t, k) -> None:
    """adam_chunk_ as ufuncs on any array module; g, t: scratch of the chunk's length."""
    xp = array_module(param)
    scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps_hat, decay, step_size = k
    _scaled_(g, grads, scale)                              # g = grad / (loss scale x ranks x
                                                           #     accumulation) x clip coef
    if l2:
        xp.multiply(param, l2, out=t)
        g += t                                             # g = g + wd p        (L2, Adam)
    m *= beta1
    xp.multiply(g, one_minus_beta1, out=t)
    m += t                                                 # m = b1 m + (1 - b1) g
    v *= beta2
    xp.multiply(g, g, out=t)
    t *= one_minus_beta2
    v += t                                                 # v = b2 v + (1 - b2) g^2
    xp.sqrt(v, out=t)
    t += eps_hat                                           # (sqrt(v_hat) + eps) * sqrt(bias2)
    if decay != 1:
        param *= decay                                     # p = p - lr wd p     (AdamW)
    xp.divide(m, t, out=t)
    t *= step_size
    param -= t                                             # p = p - lr m_hat / (sqrt(v_hat) + eps)


def _scaled_(out, grads, scale) -> None:
    """out = grads * scale in out's dtype: one pass when the dtypes agree, else convert first
    (a mixed-dtype multiply with a Python float would compute in the narrower dtype)."""
    xp = array_module(out)
    if grads.dtype == out.dtype:
        xp.multiply(grads, scale, out=out)
        return
    host_kernels.cast_(out, grads)
    if scale != 1.0:
        out *= scale


def _sumsq_chunk(grads, scratch, grad_scale) -> float:
    """The sum of squares of host grads * grad_scale, in the scratch dtype."""
    g = scratch[0][: grads.shape[0]]
    _scaled_(g, grads, grad_scale)
    return float(np.dot(g, g))


def _adam_twin(param, grads, m, v, k) -> None:
    """adam_chunk_ of a whole device shard as the twin of the fused `adam` kernel: on the host
    (the stand-in) the compiled loop or ufuncs; on a device, op by op, with two temporaries of
    the shard's size (the "composed" kernels)."""
    xp = array_module(param)
    if host_kernels.adam is not None and xp is np:
        host_kernels.adam(param, host_kernels.astype(grads, param.dtype), m, v, *k)
    else:
        _adam_ufuncs_(param, grads, m, v, xp.empty_like(param), xp.empty_like(param), k)


def _sum_of_squares_twin(grads, scale, dtype):
    """sum((grads * scale)^2) computed in `dtype`, a 0-d array where grads live."""
    g = grads.astype(dtype)  # a copy we may scale
    if scale != 1.0:
        g *= dtype.type(scale)
    return array_module(g).dot(g, g)


_adam_device = kernels.fused(_adam_twin, kernels.cuda_adam, in_place=True)
_sum_of_squares_device = kernels.fused(_sum_of_squares_twin, kernels.cuda_sum_of_squares,
                                        launches=2)  # the kernel, the sum of its partials


def _check_shapes(param, grads, m, v) -> None:
    if not param.shape == grads.shape == m.shape == v.shape:
        raise ValueError(f"shapes differ: param {param.shape}, grads {grads.shape}, "
                         f"m {m.shape}, v {v.shape}")


def _publish_pieces(publish, param) -> tuple | None:
    """step_'s `publish` for `param` checked and sorted: (starts, [(start, dst), ...]), or
    None. Only a host `param` publishes chunk by chunk."""
    if not publish:
        return None
    n = param.shape[0]
    pieces = sorted(((int(start), dst) for start, dst in publish), key=lambda p: p[0])
    end = 0
    for start, dst in pieces:
        if dst.ndim != 1 or start < end or start + dst.shape[0] > n:
            raise ValueError(f"publish: 1-D, disjoint pieces of [0, {n}) expected, got one of "
                             f"shape {dst.shape} at {start} (the one before ends at {end})")
        end = start + dst.shape[0]
    if backend.is_device_array(param):
        raise ValueError("publish: the parameters are written chunk by chunk on the host "
                         "only; a device shard is published by the strategy")
    return [start for start, _ in pieces], pieces


def _publish_chunk_(pieces, param, c) -> None:
    """dst[...] = the part of param[c] each publish piece stands for, cast to dst's dtype."""
    starts, pieces = pieces
    for start, dst in pieces[max(bisect_right(starts, c.start) - 1, 0):]:
        if start >= c.stop:
            return
        lo, hi = max(c.start, start), min(c.stop, start + dst.shape[0])
        if lo < hi:
            host_kernels.cast_(dst[lo - start:hi - start], param[lo:hi])


@dataclass
class Adam:
    """Hyper-parameters and the step count; the state (m, v) lives in the caller's buffers.

    decoupled=True is AdamW (weight decay applied to the weights, not through the gradient),
    matching torch.optim.AdamW; decoupled=False matches torch.optim.Adam's L2 weight decay.
    `chunk` is the number of elements updated per pass (None: the whole array).
    bias_correction=False drops Adam's bias correction (1-bit Adam, zmpi.optim.onebit).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    step_count: int = 0
    chunk: int | None = None
    threads: int = 1
    bias_correction: bool = True
    _scratch: dict = field(default_factory=dict, repr=False, compare=False)
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False, compare=False)

    # Whether the next step reads the gradients summed over the data-parallel ranks (the
    # engine reduces them then); 1-bit Adam after its warm-up reads each rank's own.
    reduces_gradients = True

    def __post_init__(self):
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 or None, got {self.chunk}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])

    def grad_stats(self, grads, grad_scale=1.0, master_dtype=np.float32) -> tuple[bool, float]:
        """(every element of grads * grad_scale is finite, their sum of squares) as Python
        values: `sum_of_squares` read back, and `all_finite` when the sum is not finite."""
        (sumsq,) = backend.read_scalars(self.sum_of_squares(grads, grad_scale, master_dtype))
        return math.isfinite(sumsq) or self.all_finite(grads), sumsq

    def sum_of_squares(self, grads, grad_scale=1.0, master_dtype=np.float32):
        """The sum of squares of grads * grad_scale, computed in `master_dtype`: inf or NaN
        when an element is (or the sum overflows: `all_finite` tells which). Host grads: a
        float, chunk by chunk and summed in chunk order (the same on any thread count).
        Device grads: a 0-d device array from one fused kernel (zmpi.kernels), not read back
        (the engine reads it with the loss, in one transfer)."""
        if backend.is_device_array(grads):
            return _sum_of_squares_device(grads, grad_scale, np.dtype(master_dtype))
        parts = self._map(lambda c, s: _sumsq_chunk(grads[c], s, grad_scale),
                          grads.shape[0], master_dtype, np, "stats")
        return math.fsum(parts)

    @staticmethod
    def all_finite(grads) -> bool:
        """Whether every element of grads is finite (a device -> host transfer on a GPU)."""
        return bool(array_module(grads).isfinite(grads).all())

    def step_(self, param, grads, m, v, grad_scale=1.0, clip_coef=1.0, publish=None) -> None:
        """One update of `param` (1-D) and its moments `m`, `v` from `grads` (same length).

        publish: None, or [(start, dst), ...], 1-D arrays each standing for
        param[start:start + len(dst)] (disjoint, in any dtype): each chunk, once updated, is
        also cast into them, while it is still in cache (the parameters in their storage
        dtype, written as the separate copy after the step would write them)."""
        _check_shapes(param, grads, m, v)
        self.step_count += 1
        self.update_(param, grads, m, v, grad_scale, clip_coef, publish)

    def update_(self, param, grads, m, v, grad_scale=1.0, clip_coef=1.0, publish=None) -> None:
        """step_'s update at the current step_count, which it does not advance: for a caller
        that streams one step's state in blocks (zmpi.offload.nvme), one call per block after
        counting the step. The rule is elementwise, so blocks change no bit."""
        _check_shapes(param, grads, m, v)
        pieces = _publish_pieces(publish, param)
        hyper = (self.step_count, self.lr, self.betas, self.eps, self.weight_decay,
                 self.decoupled, grad_scale, clip_coef, self.bias_correction)
        if backend.is_device_array(param):  # one fused kernel over the shard, no scratch
            _adam_device(param, grads, m, v, AdamCoefficients.of(
                param.dtype, *hyper[:-3], grad_scale * clip_coef, self.bias_correction))
            return

        def update(c, s):
            adam_chunk_(param[c], grads[c], m[c], v[c], s, *hyper)
            if pieces:
                _publish_chunk_(pieces, param, c)

        self._map(update, param.shape[0], param.dtype, array_module(param), "step")

    def close(self) -> None:
        """Stop the worker threads (a later step starts them again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _map(self, fn, n, dtype, xp, purpose) -> list:
        """fn(slice, scratch) over consecutive chunks of [0, n); results in chunk order.
        Thread k takes every chunk c with c % threads == k and uses its own scratch, one set
        per `purpose`: with the delayed update, `grad_stats` of one step runs while `step_`
        of the previous one is still running in the background."""
        size = max(1, n if self.chunk is None else min(self.chunk, n))
        chunks = [slice(i, min(i + size, n)) for i in range(0, n, size)]
        threads = min(self.threads, len(chunks))

        def worker(k):
            scratch = self._scratch_for((purpose, k), size, dtype, xp)
            return [fn(c, scratch) for c in chunks[k::threads]]

        if threads <= 1:
            return worker(0)
        if self._pool is None or self._pool._max_workers < threads:
            self.close()
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="zmpi-adam")
        per_thread = list(self._pool.map(worker, range(threads)))
        return [per_thread[i % threads][i // threads] for i in range(len(chunks))]

    def _scratch_for(self, k, size, dtype, xp):
        """Two scratch arrays: kept between calls when chunked (they are small), else
        temporaries of the array's size that are freed after the call."""
        if self.chunk is None:
            return xp.empty(size, dtype), xp.empty(size, dtype)
        key = (k, np.dtype(dtype), xp.__name__)
        bufs = self._scratch.get(key)
        if bufs is None or bufs[0].shape[0] < size:
            bufs = self._scratch[key] = (xp.empty(size, dtype), xp.empty(size, dtype))
        return bufs


def host_threads(ranks_on_node: int = 1) -> int:
    """Cores this process may use, shared among the node's ranks (at least 1)."""
    return max(1, host_cores() // max(1, ranks_on_node))


class HostAdam(Adam):
    """Adam on NumPy arrays in cache-sized chunks, on `threads` threads (default: this rank's
    share of the node's cores). What ZeRO-Offload runs on the host, and what a CPU run uses."""

    def __init__(self, *args, chunk: int | None = HOST_CHUNK, threads: int | None = None,
                 **kwargs):
        super().__init__(*args, chunk=chunk, threads=threads or host_threads(), **kwargs)

"""Fused flash-style causal attention over a block layout, forward and backward: one CUDA kernel
forward, two backward, for dense causal attention (the lower-triangular layout of FLASH_BLOCK
blocks, a ragged last block allowed) and for block-sparse layouts (zmpi.nn.sparsity, T a
multiple of the block). Opt-in on a GPU: the config's "attention_kernel": "flash" (`set_kernel`);
CausalSelfAttention then calls `flash_attention_forward` / `flash_attention_backward` on device
arrays. The CPU keeps zmpi.nn.attention and zmpi.nn.sparse_attention.

    y, cache = flash_attention_forward(qkv, n_head)                   # dense causal
    y, cache = flash_attention_forward(qkv, n_head, layout, block)    # a causal block layout
    y, cache = flash_attention_forward(qkv, n_head, n_kv_head=2)      # grouped-query
    dqkv = flash_attention_backward(dy, cache)

Grouped-query attention (a Llama's, zmpi.nn.gqa): qkv (B, T, (n_head + 2 n_kv_head) hd)
[q | k | v], n_kv_head dividing n_head; query head h reads key/value head h // (n_head /
n_kv_head) by index, never a repeated copy; the backward of keys runs a block per key tile
and (batch, key/value head) that sums dk and dv over its group's query heads in shared
memory (docs/gpu.md says why). n_kv_head = n_head is multi-head attention, unchanged.

The algorithm (Dao et al., FlashAttention-2): each block of query rows runs an online softmax
over the key blocks its layout row keeps, in ascending order, keeping a running max m and sum l
and rescaling the output by exp(m_old - m_new) as it goes; it writes y and the row
log-sum-exp lse = m + log l, never a T x T matrix. Backward recomputes p = exp(s - lse) from q,
k and lse: delta = rowsum(dy y); per query block dq = scale sum ds k with ds = p (dy v^T -
delta); per key block, over the query blocks whose layout keeps it (the transposed layout), dk =
sum ds^T q' and dv = sum p^T dy. Every sum runs in float32 (float64 for float64 inputs); q is
scaled by 1 / sqrt(hd) as it is read; y and dqkv are in qkv's dtype, lse in the accumulator's.

A fused op in zmpi.kernels' sense: its twin (`_forward_twin`, `_backward_twin`) is the same
blocked algorithm in NumPy, block by block (the CUDA kernels go in tiles of S rows, S a divisor
of the block: the same sums in another order); the stand-in runs the twin counted as the
kernels' launches, a GPU runs flash.cu (beside this file) through CuPy's RawModule, compiled
per dtype with zmpi.kernels.source's options: SIMT kernels, or for float16 and bfloat16 on
compute capability 8.0 and later the same kernels with their products on tensor cores
(flash_tc.cu; `tensor_cores` says when), which round p and ds to the 16-bit type before their
products, as FlashAttention does.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import numpy as np

from zmpi import backend, kernels
from zmpi.kernels.source import FAMILIES, FLASH, FLASH_TC

KERNELS = ("blocked", "flash")  # the config's attention_kernel
FLASH_BLOCK = 64  # the block of dense causal attention's layout
SHARED_BYTES = 48 << 10  # dynamic shared memory a block may take without opting in
_kernel = ["blocked"]


def set_kernel(name: str) -> None:
    """The config's attention_kernel: "blocked" (zmpi.nn.attention's and sparse_attention's
    array operations, the default) or "flash" (the fused kernels here, on CuPy arrays).
    Process-wide, like zmpi.kernels.set_mode. ConfigError for "flash" on NumPy: the fused
    kernels run on a GPU only; the CPU computes attention the blocked way."""
    from zmpi.config import ConfigError

    if name not in KERNELS:
        raise ConfigError("attention_kernel", f"{name!r}: use one of {', '.join(KERNELS)}")
    if name == "flash" and not backend.is_gpu:
        raise ConfigError("attention_kernel", "\"flash\" runs fused CUDA kernels, which need "
                                              "CuPy on an NVIDIA GPU; this process computes "
                                              "with NumPy (use \"blocked\")")
    _kernel[0] = name


def enabled_for(qkv) -> bool:
    """Whether attention on `qkv` takes the flash kernels: "flash" set and a device array."""
    return _kernel[0] == "flash" and backend.is_device_array(qkv)


class Layout:
    """A causal block layout in CSR, made once per layout (`dense_layout`, `sparse_layout`):
    row_ptr (heads, nb + 1) and cols, the key blocks each query block keeps, ascending; col_ptr
    and rows, the transpose (the query blocks that keep each key block, ascending); int32 host
    arrays, copied to the device once, on first use (`device`). heads: 1 (every head) or n_head.
    """

    def __init__(self, kept: np.ndarray, block: int):
        self.heads, self.nb = kept.shape[0], kept.shape[1]
        self.block = block
        self.row_ptr, self.cols = _csr(kept)
        self.col_ptr, self.rows = _csr(kept.transpose(0, 2, 1))
        self._device = {}  # array module -> the CSR arrays in its memory

    def keys(self, head: int, i: int) -> np.ndarray:
        """The key blocks query block i of head `head` keeps, ascending."""
        p = self.row_ptr[0 if self.heads == 1 else head]
        return self.cols[p[i]:p[i + 1]]

    def device(self):
        """(row_ptr, cols, col_ptr, rows) in the memory of backend.xp (copied once per module)."""
        xp = backend.xp
        if xp not in self._device:
            self._device[xp] = tuple(xp.asarray(a) for a in
                                     (self.row_ptr, self.cols, self.col_ptr, self.rows))
        return self._device[xp]


def _csr(kept):
    """(ptr (heads, nb + 1), indices) int32 of the True entries of each row of kept (heads, nb,
    nb); ptr offsets are global (head l's row i: ptr[l, i] .. ptr[l, i + 1])."""
    counts = kept.sum(axis=-1).ravel()
    ends = np.cumsum(counts)
    starts = ends - counts
    heads, nb = kept.shape[:2]
    ptr = np.concatenate([starts.reshape(heads, nb), ends.reshape(heads, nb)[:, -1:]], axis=1)
    return ptr.astype(np.int32), np.nonzero(kept)[2].astype(np.int32)


@functools.lru_cache(maxsize=16)
def dense_layout(T: int, block: int = FLASH_BLOCK) -> Layout:
    """Dense causal attention over T positions: the lower-triangular layout of ceil(T / block)
    blocks, one for every head."""
    nb = -(-T // block)
    return Layout(np.tri(nb, dtype=bool)[None], block)


def sparse_layout(layout, block: int) -> Layout:
    """The Layout of a causal block layout (heads, nb, nb) (zmpi.nn.sparsity.model_layout's:
    intersected with the causal mask and checked), cached per layout."""
    kept = np.asarray(layout, bool)
    return _sparse_layout(kept.tobytes(), kept.shape, block)


@functools.lru_cache(maxsize=16)
def _sparse_layout(kept_bytes: bytes, shape, block: int) -> Layout:
    return Layout(np.frombuffer(kept_bytes, bool).reshape(shape), block)


class FlashCache(NamedTuple):
    """What backward needs: qkv (B, T, (nh + 2 nkv) hd) and y (B, T, nh hd) in their dtype, lse
    (B, nh, T) in the accumulator's, the layout and the head counts."""
    qkv: object
    y: object
    lse: object
    layout: Layout
    n_head: int
    n_kv_head: int


def head_size(qkv, n_head: int, n_kv_head: int) -> int:
    """hd of a packed qkv (B, T, (n_head + 2 n_kv_head) hd); ValueError unless n_kv_head (an
    integer >= 1) divides n_head and the width is a multiple of n_head + 2 n_kv_head."""
    width = qkv.shape[-1]
    if (type(n_kv_head) is not int or n_kv_head < 1 or n_head % n_kv_head
            or width % (n_head + 2 * n_kv_head)):
        raise ValueError(f"attention: qkv of width {width} for n_head {n_head} and n_kv_head "
                         f"{n_kv_head} (n_kv_head must divide n_head, the width be (n_head + "
                         "2 n_kv_head) x the head size)")
    return width // (n_head + 2 * n_kv_head)


def flash_attention_forward(qkv, n_head: int, layout=None, block: int | None = None,
                            n_kv_head: int | None = None):
    """Causal attention of qkv (B, T, (nh + 2 nkv) hd) [q | k | v] -> (y (B, T, nh hd),
    FlashCache): dense causal (layout None; T any length), or over a causal block layout (n_head
    or 1, T / block, T / block) (T a multiple of block: ValueError otherwise). n_kv_head (None:
    n_head, multi-head attention, qkv (B, T, 3C)) key/value heads, dividing n_head: query head
    h reads key/value head h // (n_head / n_kv_head) (grouped-query attention; 1: multi-query).
    Computes what zmpi.nn.attention.attention_forward, zmpi.nn.gqa.gqa_attention_forward and
    zmpi.nn.sparse_attention.sparse_attention_forward compute, to round-off."""
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    head_size(qkv, n_head, n_kv_head)
    B, T, _ = qkv.shape
    if layout is None:
        plan = dense_layout(T)
    else:
        if T % block or np.shape(layout)[1:] != (T // block, T // block):
            raise ValueError(f"flash attention: a layout of shape {np.shape(layout)} at block "
                             f"{block} for sequence length {T}")
        plan = sparse_layout(layout, block)
    if plan.heads not in (1, n_head):
        raise ValueError(f"flash attention: a layout of {plan.heads} heads for n_head {n_head}")
    y, lse = _forward(qkv, plan, n_head, n_kv_head)
    return y, FlashCache(qkv, y, lse, plan, n_head, n_kv_head)


def flash_attention_backward(dy, cache: FlashCache):
    """dy (B, T, nh hd) -> dqkv (B, T, (nh + 2 nkv) hd) in qkv's dtype: dk and dv of each
    key/value head summed over the query heads of its group."""
    return _backward(dy, cache.qkv, cache.y, cache.lse, cache.layout, cache.n_head,
                     cache.n_kv_head)


# -- the twins: the blocked algorithm with array operations ------------------------------------

def _heads(x, n_head: int, hd: int, acc, nb: int, block: int):
    """x (B, T, n nh hd) -> (n, B, nh, nb, block, hd) in acc, zero past T."""
    B, T, nC = x.shape
    n = nC // (n_head * hd)
    out = np.zeros((n, B, n_head, nb * block, hd), acc)
    out[..., :T, :] = x.reshape(B, T, n, n_head, hd).transpose(2, 0, 3, 1, 4)
    return out.reshape(n, B, n_head, nb, block, hd)


def _qkv_heads(qkv, n_head: int, n_kv_head: int, acc, nb: int, block: int):
    """qkv (B, T, (nh + 2 nkv) hd) -> (q (B, nh, nb, block, hd) scaled by 1 / sqrt(hd), k, v
    (B, nkv, nb, block, hd)) in acc, zero past T; and hd."""
    hd = head_size(qkv, n_head, n_kv_head)
    q = _heads(qkv[..., :n_head * hd], n_head, hd, acc, nb, block)[0]
    q *= acc.type(1.0 / math.sqrt(hd))
    k, v = _heads(qkv[..., n_head * hd:], n_kv_head, hd, acc, nb, block)
    return q, k, v, hd


def _merged(x, T: int):
    """Heads (B, n, nb, block, hd) -> (B, T, n hd), the rows before T."""
    B, n, nb, block, hd = x.shape
    return x.reshape(B, n, nb * block, hd)[:, :, :T].transpose(0, 2, 1, 3).reshape(B, T, n * hd)


def _steps(layout: Layout, n_head: int, i: int, T: int):
    """For query block i: (j, valid) per step, j (nh,) the key block each head takes (0 past the
    end of its list) and valid (nh, block, block) where its scores count (kept, key <= query,
    both before T), the heads' lists walked side by side in ascending order."""
    block = layout.block
    lists = [layout.keys(h, i) for h in range(n_head)]
    rows = i * block + np.arange(block)
    for s in range(max(len(c) for c in lists)):
        j = np.array([c[s] if s < len(c) else -1 for c in lists])
        keys = np.maximum(j, 0)[:, None] * block + np.arange(block)  # (nh, block)
        valid = ((keys[:, None, :] <= rows[None, :, None]) & (keys < T)[:, None, :]
                 & (rows < T)[None, :, None] & (j >= 0)[:, None, None])
        yield np.maximum(j, 0), valid


def _forward_twin(qkv, layout: Layout, n_head: int, n_kv_head: int):
    B, T, _ = qkv.shape
    acc, block, nb = kernels.acc_dtype(qkv.dtype), layout.block, layout.nb
    q, k, v, hd = _qkv_heads(qkv, n_head, n_kv_head, acc, nb, block)
    y = np.empty((B, n_head, nb, block, hd), acc)
    lse = np.empty((B, n_head, nb, block), acc)
    heads = np.arange(n_head) // (n_head // n_kv_head)  # the key/value head of each query head
    for i in range(nb):
        m = np.full((B, n_head, block, 1), -np.inf, acc)
        total = np.zeros((B, n_head, block, 1), acc)
        o = np.zeros((B, n_head, block, hd), acc)
        for j, valid in _steps(layout, n_head, i, T):
            s = np.where(valid, q[:, :, i] @ k[:, heads, j].swapaxes(-1, -2), -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            m_use = np.where(m_new == -np.inf, 0, m_new).astype(acc)  # all masked so far
            p = np.exp(s - m_use)
            alpha = np.exp(m - m_use)
            total = total * alpha + p.sum(axis=-1, keepdims=True)
            o = o * alpha + p @ v[:, heads, j]
            m = m_new
        with np.errstate(divide="ignore", invalid="ignore"):  # rows past T: none counted
            y[:, :, i] = o / total
            lse[:, :, i] = (m + np.log(total))[..., 0]
    return (_merged(y, T).astype(qkv.dtype),
            np.ascontiguousarray(lse.reshape(B, n_head, nb * block)[..., :T]))


def _backward_twin(dy, qkv, y, lse, layout: Layout, n_head: int, n_kv_head: int):
    B, T, _ = qkv.shape
    acc, block, nb = kernels.acc_dtype(qkv.dtype), layout.block, layout.nb
    q, k, v, hd = _qkv_heads(qkv, n_head, n_kv_head, acc, nb, block)
    scale = acc.type(1.0 / math.sqrt(hd))
    dyh, yh = _heads(np.concatenate([dy, y], axis=-1), n_head, hd, acc, nb,
                     block)
    delta = (dyh * yh).sum(axis=-1)  # (B, nh, nb, block)
    lse_b = np.zeros((B, n_head, nb * block), acc)
    lse_b[..., :T] = lse
    lse_b = lse_b.reshape(B, n_head, nb, block)
    dq = np.zeros((B, n_head, nb, block, hd), acc)
    dk, dv = np.zeros((2, B, n_kv_head, nb, block, hd), acc)
    heads = np.arange(n_head) // (n_head // n_kv_head)  # the key/value head of each query head
    for i in range(nb):
        for j, valid in _steps(layout, n_head, i, T):
            k_j, v_j = k[:, heads, j], v[:, heads, j]
            s = np.where(valid, q[:, :, i] @ k_j.swapaxes(-1, -2), -np.inf)
            p = np.exp(s - lse_b[:, :, i, :, None])
            ds = p * (dyh[:, :, i] @ v_j.swapaxes(-1, -2) - delta[:, :, i, :, None])
            dq[:, :, i] += ds @ k_j
            # summed over the query heads of a group (a (head, block) pair may repeat)
            np.add.at(dk, (slice(None), heads, j), ds.swapaxes(-1, -2) @ q[:, :, i])
            np.add.at(dv, (slice(None), heads, j), p.swapaxes(-1, -2) @ dyh[:, :, i])
    dq *= scale
    return np.concatenate([_merged(dq, T), _merged(dk, T), _merged(dv, T)],
                          axis=-1).astype(qkv.dtype)


# -- the CUDA launchers ---------------------------------------------------------------------------

# Each kernel's shared memory at tiles of s rows, heads of hd: SIMT (flash.cu) tiles of
# (s, hd + 1), (s, s) and (s,) in ACC; tensor-core (flash_tc.cu) tiles of (s, hd + 8) and
# (s, s + 8) in the 16-bit T, (s, max(s, hd) + 4), (s, hd + 4) and (s,) in float.
_SIMT_TILES = {"flash_forward": (4, 1, 3), "flash_backward_dq": (5, 1, 2),
               "flash_backward_dkv": (6, 2, 2)}
_TC_TILES = {"flash_forward": (5, 1, 1, 1, 3), "flash_backward_dq": (6, 1, 2, 1, 2),
             "flash_backward_dkv": (6, 2, 2, 2, 4)}


def tensor_cores(dtype, hd: int, block: int) -> bool:
    """Whether the kernels for `dtype` arrays run on tensor cores (flash_tc.cu): 16-bit
    arrays (float16, bfloat16), heads of a multiple of 16 that fit a tile, a layout block of a
    multiple of 16, a GPU of compute capability 8.0 or later, and a CUDA install whose <mma.h>
    compiles (it includes crt/mma.h, which zmpi.kernels.source.crt_include_dir finds for NVRTC;
    a warning, once, where it does not); else the SIMT kernels."""
    return _tensor_cores(np.dtype(dtype), hd, block, backend.xp.cuda.Device().compute_capability)


@functools.cache
def _tensor_cores(dtype: np.dtype, hd: int, block: int, capability: str) -> bool:
    return (dtype.itemsize == 2 and hd % 16 == 0 and block % 16 == 0
            and int(capability) >= 80
            and all(_tile_rows(k, block, hd, None, True, _shared_limit(capability))
                    for k in _TC_TILES)
            and _tensor_core_module_builds(kernels._C_TYPES[dtype]))


def shared_limit() -> int:
    """The dynamic shared memory a flash block may take on this process's GPU: the device's
    opt-in limit (CUDA's MaxSharedMemoryPerBlockOptin: 227 KiB on H100 and H200, 163 KiB on
    A100), to which the launcher opts a kernel in (CuPy's Function.max_dynamic_shared_size_bytes)
    when its tiles pass SHARED_BYTES. Cached per compute capability."""
    return _shared_limit(backend.xp.cuda.Device().compute_capability)


@functools.cache
def _shared_limit(capability: str) -> int:
    attributes = backend.xp.cuda.Device().attributes
    return max(SHARED_BYTES, int(attributes.get("MaxSharedMemoryPerBlockOptin", SHARED_BYTES)))


@functools.cache
def _tensor_core_module_builds(t: str) -> bool:
    try:
        _function("flash_tc_forward", t, "float")
    except Exception as e:  # CuPy's CompileException, or a missing header: any means "no"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        warnings.warn(f"flash attention: the tensor-core kernels do not compile here ({first}); "
                      "the SIMT kernels run instead", RuntimeWarning, stacklevel=2)
        return False
    return True


def tile_rows(kernel: str, block: int, hd: int, acc, tc: bool = False,
              limit: int = SHARED_BYTES) -> int:
    """S, the rows of a tile of `kernel` (flash_forward, flash_backward_dq, flash_backward_dkv;
    on tensor cores when `tc`): the largest of 64, 32, ..., 1 (multiples of 16 on tensor cores)
    that divides block and whose tiles fit `limit` bytes of shared memory (the launcher gives
    the device's `shared_limit`)."""
    s = _tile_rows(kernel, block, hd, acc, tc, limit)
    if s is None:
        raise ValueError(f"flash attention: heads of size {hd} do not fit a {kernel} tile in "
                         f"{limit} bytes of shared memory")
    return s


@functools.cache
def _tile_rows(kernel: str, block: int, hd: int, acc, tc: bool, limit: int) -> int | None:
    for s in (64, 32, 16) if tc else (64, 32, 16, 8, 4, 2, 1):
        if block % s == 0 and _shared_bytes(kernel, s, hd, acc, tc) <= limit:
            return s
    return None


def _shared_bytes(kernel: str, s: int, hd: int, acc, tc: bool = False) -> int:
    """The dynamic shared memory of `kernel` at tiles of s rows (the sources' layouts)."""
    if tc:
        qkv, squares, scores, outputs, rows = _TC_TILES[kernel]
        return ((qkv * s * (hd + 8) + squares * s * (s + 8)) * 2
                + (scores * s * (max(s, hd) + 4) + outputs * s * (hd + 4) + rows * s) * 4)
    tiles, squares, rows = _SIMT_TILES[kernel]
    return (tiles * s * (hd + 1) + squares * s * s + rows * s) * np.dtype(acc).itemsize


@functools.cache
def _function(kernel: str, t: str, acc: str):
    """`kernel` of the module compiled for C types (t, acc), the tensor-core one for the
    flash_tc_ kernels: one module per pair and kind (zmpi.kernels._modules)."""
    return kernels._modules(t, acc, families(kernel.startswith("flash_tc_"))).get_function(kernel)


def families(tc: bool) -> tuple[str, ...]:
    """The .cu files of a flash module after common.cuh: the fused ops', flash.cu, and
    flash_tc.cu for the tensor-core kernels (16-bit T only), a module of its own so that the SIMT
    kernels run where <mma.h> does not compile."""
    return (*FAMILIES, FLASH, *((FLASH_TC,) if tc else ()))


def _launch(kernel: str, qkv, layout: Layout, n_head: int, n_kv_head: int, args):
    """Run `kernel` (its tensor-core twin where `tensor_cores` says) on tiles of S rows over the
    layout's nb blocks for every (batch, query head) of qkv (B, T, (nh + 2 nkv) hd), or for the
    keys' backward every (batch, key/value head), which sums over its group's query heads in
    the kernel; args: the kernel's up to its `seq`, the shape arguments added here."""
    B, T, _ = qkv.shape
    hd = head_size(qkv, n_head, n_kv_head)
    acc = kernels.acc_dtype(qkv.dtype)
    tc = tensor_cores(qkv.dtype, hd, layout.block)
    s = tile_rows(kernel, layout.block, hd, acc, tc, shared_limit())
    heads = n_kv_head if kernel == "flash_backward_dkv" else n_head
    grid = (layout.nb * layout.block // s, B * heads)
    if 0 in grid or T == 0:
        return
    name = kernel.replace("flash_", "flash_tc_") if tc else kernel
    function = _function(name, kernels._C_TYPES[np.dtype(qkv.dtype)], kernels._C_TYPES[acc])
    shared = _shared_bytes(kernel, s, hd, acc, tc)
    if shared > SHARED_BYTES and function.max_dynamic_shared_size_bytes < shared:
        function.max_dynamic_shared_size_bytes = shared  # the opt-in, once per kernel and size
    function(grid, (2 * s if tc else kernels.THREADS,),  # tensor cores: a warp per 16 rows
             (*args, np.int32(T), np.int32(n_head), np.int32(n_kv_head), np.int32(hd),
              np.int32(layout.block),
              np.int32(layout.heads), np.int32(s), acc.type(1.0 / math.sqrt(hd))),
             shared_mem=shared)


def cuda_flash_forward(qkv, layout: Layout, n_head: int, n_kv_head: int):
    xp, (B, T, _) = backend.xp, qkv.shape
    y = xp.empty((B, T, n_head * head_size(qkv, n_head, n_kv_head)), qkv.dtype)
    lse = xp.empty((B, n_head, T), kernels.acc_dtype(qkv.dtype))
    row_ptr, cols, _, _ = layout.device()
    _launch("flash_forward", qkv, layout, n_head, n_kv_head, (qkv, row_ptr, cols, y, lse))
    return y, lse


def cuda_flash_backward(dy, qkv, y, lse, layout: Layout, n_head: int, n_kv_head: int):
    xp = backend.xp
    dqkv = xp.empty_like(qkv)
    delta = xp.empty_like(lse)
    row_ptr, cols, col_ptr, rows = layout.device()
    _launch("flash_backward_dq", qkv, layout, n_head, n_kv_head,
            (qkv, y, dy, lse, row_ptr, cols, dqkv, delta))
    _launch("flash_backward_dkv", qkv, layout, n_head, n_kv_head,
            (qkv, dy, lse, delta, col_ptr, rows, dqkv))
    return dqkv


_forward = kernels.fused(_forward_twin, cuda_flash_forward)
_backward = kernels.fused(_backward_twin, cuda_flash_backward, launches=2)

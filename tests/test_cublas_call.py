"""zmpi.kernels.matmul's cuBLAS call (cuda_matmul) on the CPU, against cuBLAS's own definition
of gemmStridedBatchedEx: a fake `cupy_backends.cuda.libs.cublas` that does what NVIDIA's
documentation says the call does, on the memory the pointers address (column-major matrices,
op(A) m x k and op(B) k x n, leading dimensions and batch strides in elements, and the
INVALID_VALUE checks a leading dimension must pass). Row-major operands, transposed and
sliced views, batch axes, outputs written in place: each must give NumPy's matmul, or the
call's arguments are wrong (a GPU would give a wrong product, or refuse it). What it cannot
see: cuBLAS's own rounding and its choice of kernel (the GPU test compares with the twin)."""
import ctypes
import sys
import types

import numpy as np
import pytest

from zmpi import backend, kernels

CUDA_R = {2: np.dtype(np.float16), 14: backend.BFLOAT16, 0: np.dtype(np.float32)}
OP_N, OP_T = 0, 1


class DeviceArray(np.ndarray):
    """A NumPy array with CuPy's `data.ptr`, its first element's address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


ALLOCATIONS = []  # every array the test makes, its "device memory", kept alive until its end


def allocate(a: np.ndarray) -> DeviceArray:
    """`a` (C-contiguous) as device memory: the fake reads and writes only inside such."""
    ALLOCATIONS.append(a)
    return a.view(DeviceArray)


def _column_major(ptr, dtype, rows, cols, ld, what):
    """The rows x cols column-major matrix at address ptr, columns ld elements apart; an
    error where it is not inside one allocation (a GPU would read or write past an array)."""
    if ld < max(1, rows):
        raise ValueError(f"CUBLAS_STATUS_INVALID_VALUE: {what} {ld} < {rows} rows")
    n = (cols - 1) * ld + rows
    if not any(a.ctypes.data <= ptr and ptr + n * dtype.itemsize <= a.ctypes.data + a.nbytes
               for a in ALLOCATIONS):
        raise ValueError(f"the matrix of {what} {ld} at {ptr:#x} is outside every array")
    flat = np.frombuffer((ctypes.c_char * (n * dtype.itemsize)).from_address(ptr), dtype)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dtype.itemsize,
                                                                 ld * dtype.itemsize))


def gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, a_type, lda, stride_a,
                            B, b_type, ldb, stride_b, beta, C, c_type, ldc, stride_c, batch,
                            compute, algo):
    """C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch (cuBLAS's documentation):
    X_i at X + i stride_x elements; op(A) m x k (A stored m x k, or k x m transposed), op(B)
    k x n, C m x n; alpha and beta host float32 (CUBLAS_COMPUTE_32F); products accumulated in
    float32 and rounded to C's type once; C not read when beta is 0."""
    assert a_type == b_type == c_type and compute == FAKE.CUBLAS_COMPUTE_32F
    dtype = CUDA_R[a_type]
    scale = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
    size = dtype.itemsize
    for i in range(batch):
        a = _column_major(A + i * stride_a * size, dtype, *((m, k) if transa == OP_N
                                                              else (k, m)), lda, "lda")
        b = _column_major(B + i * stride_b * size, dtype, *((k, n) if transb == OP_N
                                                              else (n, k)), ldb, "ldb")
        c = _column_major(C + i * stride_c * size, dtype, m, n, ldc, "ldc")
        a, b = (x.astype(np.float32) for x in (a, b))
        product = (a if transa == OP_N else a.T) @ (b if transb == OP_N else b.T)
        result = scale[0] * product
        if scale[1]:  # with beta 0, C is not read (it may hold anything: cuBLAS's rule)
            result += scale[1] * c.astype(np.float32)
        c[...] = result.astype(dtype)


FAKE = types.SimpleNamespace(gemmStridedBatchedEx=gemm_strided_batched_ex,
                             CUBLAS_COMPUTE_32F=68, CUBLAS_COMPUTE_32F_FAST_TF32=77,
                             CUBLAS_GEMM_DEFAULT=-1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def fake_cublas(monkeypatch):
    """zmpi.kernels.matmul on DeviceArrays through the fake cuBLAS."""
    for name in ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", FAKE)
    xp = types.SimpleNamespace(
        empty=lambda shape, dtype: allocate(np.empty(shape, dtype)),
        ascontiguousarray=lambda a: allocate(np.array(a, order="C")),
        cuda=types.SimpleNamespace(
            runtime=types.SimpleNamespace(CUDA_R_16F=2, CUDA_R_16BF=14, CUDA_R_32F=0),
            device=types.SimpleNamespace(get_cublas_handle=lambda: 1)))
    monkeypatch.setattr(backend, "xp", xp)
    monkeypatch.setattr(backend, "is_device_array", lambda a: isinstance(a, DeviceArray))
    yield
    ALLOCATIONS.clear()


def device(rng, shape, dtype):
    return allocate(rng.standard_normal(shape).astype(dtype))


DTYPES = [np.float16, backend.BFLOAT16, np.float32]
TOLERANCE = {np.dtype(np.float16): 2e-3, backend.BFLOAT16: 2e-2, np.dtype(np.float32): 1e-6}


def _expected(a, b):
    return np.matmul(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _check(got, a, b):
    tol = TOLERANCE[np.dtype(a.dtype)]
    np.testing.assert_allclose(np.asarray(got, np.float32), _expected(a, b), rtol=tol,
                               atol=tol * np.sqrt(a.shape[-1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("M, K, N", [(5, 7, 3), (1, 4, 6), (6, 1, 2), (3, 5, 1)])
def test_products_of_row_major_and_transposed_operands(rng, fake_cublas, dtype, M, K, N):
    """a @ b, a @ b^T (b's transposed view, column-major: read as it lies, no copy), a^T @ b,
    over batch axes (2, 3), at edge sizes (a row, a column, K of 1)."""
    a, b = device(rng, (2, 3, M, K), dtype), device(rng, (2, 3, K, N), dtype)
    bt = device(rng, (2, 3, N, K), dtype).swapaxes(-1, -2)  # (K, N) column-major
    at = device(rng, (2, 3, K, M), dtype).swapaxes(-1, -2)
    for x, y in ((a, b), (a, bt), (at, b), (at, bt)):
        _check(kernels.matmul(x, y), x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_attention_shaped_products_into_sliced_outputs(rng, fake_cublas, dtype):
    """What attention does: q k^T with k a transposed view, and p v written into y[:, :, i]
    (a sliced output whose batches are one stride apart: cuBLAS writes it in place), and into
    an output it cannot write (transposed: computed apart, then copied)."""
    B, nh, T, hd, nb = 2, 3, 8, 4, 2
    q, k, v = (device(rng, (B, nh, T, hd), dtype) for _ in range(3))
    scores = kernels.matmul(q, k.swapaxes(-1, -2))
    _check(scores, q, k.swapaxes(-1, -2))
    y = allocate(np.full((B, nh, nb, T, hd), np.nan, dtype))
    for i in range(nb):
        kernels.matmul(scores, v, out=y[:, :, i])
        _check(y[:, :, i], scores, v)
    out = allocate(np.full((B, nh, hd, T), np.nan, dtype)).swapaxes(-1, -2)
    kernels.matmul(scores, v, out=out)
    _check(out, scores, v)


def test_a_leading_dimension_too_small_is_what_cublas_refuses(fake_cublas):
    """The fake refuses what cuBLAS does, so that a wrong leading dimension fails here."""
    a = allocate(np.zeros((1, 4, 4), np.float32))
    with pytest.raises(ValueError, match="INVALID_VALUE: lda 2 < 4 rows"):
        one, zero = np.ones((), np.float32), np.zeros((), np.float32)
        gemm_strided_batched_ex(1, OP_N, OP_N, 4, 4, 4, one.ctypes.data, a.data.ptr, 0, 2, 16,
                                a.data.ptr, 0, 4, 16, zero.ctypes.data, a.data.ptr, 0, 4, 16, 1,
                                68, -1)

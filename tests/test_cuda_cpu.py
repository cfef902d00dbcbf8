"""tests/cuda_cpu.py, the CPU executor of zmpi's CUDA kernels that tests/test_kernels.py and
tests/test_flash_attention.py run them on: it runs block reductions and warp shuffles as a GPU
does, and each check it makes of a launch fails when it should (a write out of bounds or to a
const array, divergent barriers, an argument of the wrong type, overlapping arrays, dynamic
shared memory past the kernel's limit or an opt-in past the device's); its shuffled schedule
shows a race between blocks or between a block's threads, and -ftz=true flushes denormals;
bias_grad's last-block counter gives the same bits whichever block arrives last."""
import cuda_cpu
import numpy as np
import pytest

if cuda_cpu.COMPILER is None:
    pytest.skip("no C++ compiler", allow_module_level=True)

SOURCE = r"""
typedef ZMPI_T T;

// out[blockIdx.x] = the sum of x's row blockIdx.x (n per row): warp shuffles, then a warp's
// partial sums in shared memory
extern "C" __global__ void row_sums(const T* x, T* out, const int n) {
    __shared__ T partial[32];
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[blockIdx.x * n + i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        T t = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += partial[w];
        out[blockIdx.x] = t;
    }
}

extern "C" __global__ void write_past_end(T* out, const int n) {
    out[n + threadIdx.x] = 1;
}

extern "C" __global__ void write_const(const T* x) {
    ((T*)x)[threadIdx.x] = 1;
}

// half of each warp waits at __syncthreads(), the other half at a shuffle of the whole warp
extern "C" __global__ void divergent(T* out) {
    if ((threadIdx.x & 31) < 16) __syncthreads();
    else for (int o = 16; o > 0; o >>= 1) out[0] += __shfl_xor_sync(0xffffffffu, out[0], o);
}

extern "C" __global__ void partial_warp_barrier(T* out) {
    __syncwarp(0xffffu);
    out[threadIdx.x] = 0;
}

extern "C" __global__ void dynamic_shared(T* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* s = reinterpret_cast<T*>(smem);
    s[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def module():
    return cuda_cpu.RawModule(code=SOURCE, options=("--fmad=false", "-DZMPI_T=double"))


def test_reductions_and_shared_memory_run_as_on_a_gpu(module):
    x = np.random.default_rng(0).standard_normal((5, 300))
    out = cuda_cpu.DEVICE.empty(5, np.float64)
    module.get_function("row_sums")((5,), (128,), (x, out, np.int32(300)))
    np.testing.assert_allclose(out, x.sum(axis=1), rtol=1e-13)
    out = cuda_cpu.DEVICE.empty(3 * 64, np.float64)
    module.get_function("dynamic_shared")((3,), (64,), (out,), shared_mem=64 * 8)
    np.testing.assert_array_equal(out, np.tile(np.arange(63, -1, -1), 3))


def test_a_write_out_of_bounds_or_to_a_const_array_is_an_error(module):
    with pytest.raises(RuntimeError, match="written outside the array"):
        module.get_function("write_past_end")((1,), (32,), (np.zeros(8), np.int32(8)))
    with pytest.raises(RuntimeError, match="wrote to const T\\* x"):
        module.get_function("write_const")((1,), (32,), (np.zeros(32),))


def test_divergent_barriers_are_an_error(module):
    with pytest.raises(RuntimeError, match="divergent barriers"):
        module.get_function("divergent")((1,), (64,), (np.zeros(1),))
    with pytest.raises(RuntimeError, match="__syncwarp with a partial mask"):  # not a barrier's
        module.get_function("partial_warp_barrier")((1,), (32,), (np.zeros(32),))


def test_arguments_are_checked_against_the_declarations(module):
    row_sums = module.get_function("row_sums")
    x, out = np.zeros((2, 4)), np.zeros(2)
    with pytest.raises(TypeError, match="wants a NumPy int32 scalar, got int"):
        row_sums((2,), (32,), (x, out, 4))
    with pytest.raises(TypeError, match="wants a C-contiguous float64 array, got a float32"):
        row_sums((2,), (32,), (x.astype(np.float32), out, np.int32(4)))
    with pytest.raises(TypeError, match="not contiguous"):
        row_sums((2,), (32,), (np.zeros((4, 2)).T, out, np.int32(4)))
    with pytest.raises(TypeError, match="3 arguments for"):
        module.get_function("write_const")((1,), (32,), (x, out, np.int32(4)))
    with pytest.raises(ValueError, match="share memory"):
        row_sums((2,), (32,), (x, x[0], np.int32(4)))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        row_sums((2,), (48,), (x, out, np.int32(4)))
    with pytest.raises(RuntimeError, match="z at most 64"):
        row_sums((2,), (1, 1, 128), (x, out, np.int32(4)))
    with pytest.raises(RuntimeError, match="CUDA's limits are 2"):
        module.get_function("dynamic_shared")((1, 65536), (32,), (np.zeros(32),))
    with pytest.raises(RuntimeError, match="49153 bytes of dynamic shared memory"):
        module.get_function("dynamic_shared")((1,), (32,), (np.zeros(32),), shared_mem=49153)


WMMA_SOURCE = r"""
#include <mma.h>

// c (16, 16) = a (16, 16) b (16, 16), a and b staged in shared memory `offset` halves past its
// start with rows `ld` halves apart: CUDA wants the tiles 32-byte aligned, ld 16 bytes
extern "C" __global__ void wmma_product(const __half* a, const __half* b, float* c,
                                        const int offset, const int ld) {
    extern __shared__ __align__(32) unsigned char smem[];
    __half* sa = reinterpret_cast<__half*>(smem) + offset;
    __half* sb = sa + 16 * ld;
    for (int e = threadIdx.x; e < 256; e += blockDim.x) {
        sa[(e / 16) * ld + e % 16] = a[e];
        sb[(e / 16) * ld + e % 16] = b[e];
    }
    __syncthreads();
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> fa;
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::row_major> fb;
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> fc;
    nvcuda::wmma::fill_fragment(fc, 0.0f);
    nvcuda::wmma::load_matrix_sync(fa, sa, ld);
    nvcuda::wmma::load_matrix_sync(fb, sb, ld);
    nvcuda::wmma::mma_sync(fc, fa, fb, fc);
    nvcuda::wmma::store_matrix_sync(c, fc, 16, nvcuda::wmma::mem_row_major);
}
"""


def test_wmma_tiles_must_be_aligned_as_cuda_says():
    """A fragment's load or store from a tile not 32-byte aligned, or with a leading dimension
    that is not a multiple of 16 bytes, is an error (undefined on a GPU); aligned, the product
    is a b in float."""
    module = cuda_cpu.RawModule(code=WMMA_SOURCE, options=("--fmad=false",))
    product = module.get_function("wmma_product")
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((16, 16)).astype(np.float16) for _ in range(2))

    def run(offset, ld):
        c = cuda_cpu.DEVICE.empty((16, 16), np.float32)
        product((1,), (32,), (a, b, c, np.int32(offset), np.int32(ld)),
                shared_mem=(offset + 32 * ld) * 2)
        return c

    np.testing.assert_allclose(run(16, 24), a.astype(np.float32) @ b.astype(np.float32),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="shared offset 16 with ldm 24 .*32-byte aligned"):
        run(8, 24)  # 16 bytes in
    with pytest.raises(RuntimeError, match="ldm 20 .*multiple of 16 bytes"):
        run(0, 20)  # 40-byte rows


SCHEDULE_SOURCE = r"""
typedef ZMPI_T T;

// out[b] = the order in which block b ran (a race between blocks, on purpose)
extern "C" __global__ void block_order(unsigned int* counter, unsigned int* out) {
    if (threadIdx.x == 0) out[blockIdx.x] = atomicAdd(counter, 1u);
}

// each thread reads its lower neighbour's element of shared memory, after a barrier or
// without one (a race between threads, on purpose)
extern "C" __global__ void neighbour(T* out, const int barrier) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* s = reinterpret_cast<T*>(smem);
    const int t = threadIdx.y * blockDim.x + threadIdx.x;
    s[t] = t;
    if (barrier) __syncthreads();
    out[blockIdx.x * blockDim.x * blockDim.y + t] = t > 0 ? s[t - 1] : -1;
}

extern "C" __global__ void product(const float* x, float* out, const float k) {
    out[threadIdx.x] = x[threadIdx.x] * k;
}

extern "C" __global__ void big_shared(T* out) {
    extern __shared__ __align__(16) unsigned char smem[];
    reinterpret_cast<T*>(smem)[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = reinterpret_cast<T*>(smem)[31 - threadIdx.x];
}
"""


@pytest.fixture
def schedule(monkeypatch):
    """SCHEDULE_SOURCE's module, the executor's schedule and device restored after the test."""
    monkeypatch.setattr(cuda_cpu.DEVICE, "shuffle_seed", None)
    monkeypatch.setattr(cuda_cpu.DEVICE, "compute_capability", "90")
    return cuda_cpu.RawModule(code=SCHEDULE_SOURCE, options=("-DZMPI_T=double",))


def test_shuffled_blocks_run_in_an_order_of_the_seed(schedule):
    """Ordered, blocks run in grid order; shuffled, in an order drawn from the seed (the same
    seed, the same order), so a result that depends on which block runs first changes."""
    def order(seed):
        cuda_cpu.DEVICE.shuffle_seed = seed
        counter, out = np.zeros(1, np.uint32), cuda_cpu.DEVICE.empty(64, np.uint32)
        cuda_cpu.DEVICE.launches = 0  # the seed of each launch: the base seed and its number
        schedule.get_function("block_order")((64,), (32,), (counter, out))
        assert counter[0] == 64 and sorted(out) == list(range(64))
        return out.tolist()

    assert order(None) == list(range(64))
    assert order(1) != list(range(64)) and order(1) == order(1) != order(2)


def test_shuffled_threads_show_a_race_between_barriers(schedule):
    """Reading another thread's shared-memory write without a barrier between them is right
    when the threads run in ascending order, and fails under a shuffled order; with the
    barrier both are right (2-D blocks included)."""
    neighbour = schedule.get_function("neighbour")
    want = np.tile(np.arange(-1, 127, dtype=np.float64), 3)
    for seed, barrier in ((None, 0), (None, 1), (7, 1)):
        cuda_cpu.DEVICE.shuffle_seed = seed
        out = cuda_cpu.DEVICE.empty(3 * 128, np.float64)
        neighbour((3,), (32, 4), (out, np.int32(barrier)), shared_mem=128 * 8)
        np.testing.assert_array_equal(out, want)
    cuda_cpu.DEVICE.shuffle_seed = 7
    out = cuda_cpu.DEVICE.empty(3 * 128, np.float64)
    neighbour((3,), (32, 4), (out, np.int32(0)), shared_mem=128 * 8)
    assert np.isnan(out).any()  # a neighbour that had not written yet: the NaN bytes


def test_flush_to_zero_as_cupy_compiles(schedule):
    """-ftz=true (CuPy adds it to every module, and so does DEVICE.RawModule) flushes a
    denormal result and a denormal input to zero in the module's launches, and only there."""
    x = np.array([1e-30] * 16 + [1e-40] * 16, np.float32)
    k = np.float32(1e-10)
    with np.errstate(under="ignore"):
        exact = x * np.float32(1e-10), x * np.float32(1)
    assert (exact[0][:16] != 0).all() and (exact[1][16:] != 0).all()  # denormals on the host
    flushed = cuda_cpu.DEVICE.RawModule(code=SCHEDULE_SOURCE, options=("-DZMPI_T=double",))
    assert flushed.flush_to_zero and not schedule.flush_to_zero
    for module, denormals in ((schedule, True), (flushed, False)):
        for scale, want in ((k, exact[0]), (np.float32(1), exact[1])):
            out = cuda_cpu.DEVICE.empty(32, np.float32)
            module.get_function("product")((1,), (32,), (x, out, scale))
            np.testing.assert_array_equal(out, want if denormals else np.where(
                np.abs(want) < np.finfo(np.float32).tiny, 0, want))
    with np.errstate(under="ignore"):
        assert x[16] * np.float32(1) != 0  # the host's own flags restored


def test_dynamic_shared_memory_past_48_kib_needs_the_opt_in(schedule):
    """48 KiB a launch unless the kernel's max_dynamic_shared_size_bytes is raised (CuPy's
    RawKernel attribute; kept by the module, as CUDA keeps it on the function), which the
    device refuses past its opt-in limit: 227 KiB on compute capability 9.0, 163 on 8.0."""
    out = np.zeros(32)
    kernel = schedule.get_function("big_shared")
    assert kernel.max_dynamic_shared_size_bytes == 48 << 10
    with pytest.raises(RuntimeError, match="65536 bytes of dynamic shared memory: the kernel's "
                                           "limit is 49152"):
        kernel((1,), (32,), (out,), shared_mem=64 << 10)
    kernel.max_dynamic_shared_size_bytes = 227 << 10
    assert schedule.get_function("big_shared").max_dynamic_shared_size_bytes == 227 << 10
    schedule.get_function("big_shared")((1,), (32,), (out,), shared_mem=227 << 10)
    np.testing.assert_array_equal(out, np.arange(31, -1, -1))
    with pytest.raises(RuntimeError, match="232449 bytes"):
        kernel((1,), (32,), (out,), shared_mem=(227 << 10) + 1)
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE .*at most 232448 bytes"):
        kernel.max_dynamic_shared_size_bytes = (227 << 10) + 1
    cuda_cpu.DEVICE.compute_capability = "80"
    assert cuda_cpu.DEVICE.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"] == 163 << 10
    with pytest.raises(RuntimeError, match="at most 166912 bytes"):
        kernel.max_dynamic_shared_size_bytes = 164 << 10
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        kernel.max_dynamic_shared_size_bytes = -1


def test_bias_grad_is_the_same_whichever_block_arrives_last(cuda_device, monkeypatch):
    """bias_grad's last-block counter (zmpi.kernels): the block of a column tile that arrives
    last sums every block's partial in a fixed order, so db is the same bits whichever block
    that is (on the CPU: blocks in grid order and in three shuffled orders; on a GPU: whatever
    order its blocks run in, five times), and the counters are back at zero after each."""
    from zmpi import kernels

    dy = cuda_device.asarray(np.random.default_rng(0).standard_normal((5000, 70), np.float32))
    seeds = [None, 1, 2, 3] if cuda_device is cuda_cpu.DEVICE else [None] * 5
    results = []
    for seed in seeds:
        monkeypatch.setattr(cuda_cpu.DEVICE, "shuffle_seed", seed)
        results.append(cuda_device.asnumpy(kernels.cuda_bias_grad(dy, None)))
        assert not cuda_device.asnumpy(kernels._arrived[0]).any()
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    np.testing.assert_allclose(results[0], cuda_device.asnumpy(dy).sum(0, dtype=np.float64),
                               rtol=1e-5, atol=1e-4)

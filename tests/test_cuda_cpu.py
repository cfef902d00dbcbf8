"""tests/cuda_cpu.py, the CPU executor of zmpi's CUDA kernels that tests/test_kernels.py and
tests/test_flash_attention.py run them on: it runs block reductions and warp shuffles as a GPU
does, and each check it makes of a launch fails when it should (a write out of bounds or to a
const array, divergent barriers, an argument of the wrong type, overlapping arrays)."""
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

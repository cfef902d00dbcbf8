// A bias's gradient, the column sums of dy: zmpi.kernels.cuda_bias_grad, the twin
// zmpi.nn.functional._bias_grad_twin (zmpi.kernels.OPS).

// db (C,) = the column sums of dy (rows, C), a bias's gradient, in one launch. Block (x, y)
// takes the 32 columns from 32 x and its warps the rows y w', y w' + W', ... (w' its warp's
// index among all W' = gridDim.y warps per column tile): coalesced reads, every SM busy. Each
// block sums its warps in warp order into partial[y] (gridDim.y, C); the block of a tile that
// arrives last (arrived[x], reset to 0 by it) sums the partials in y order and writes db: the
// same bits whichever block is last. blockDim.x <= 256 (8 warps).
extern "C" __global__ void bias_grad(const T* dy, ACC* partial, unsigned int* arrived, T* db,
                                     const long long rows, const int C) {
    __shared__ ACC warp_sums[8][32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    ACC s = 0;
    if (c < C)
        for (long long r = (long long)blockIdx.y * warps + warp; r < rows;
             r += (long long)gridDim.y * warps)
            s += to_acc(dy[r * C + c]);
    warp_sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < C) {
        ACC t = 0;
        for (int w = 0; w < warps; ++w) t += warp_sums[w][lane];
        partial[(long long)blockIdx.y * C + c] = t;
        __threadfence();  // the partial is visible to every block before this one is counted
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrived + blockIdx.x, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    if (warp == 0 && c < C) {
        __threadfence();
        ACC t = 0;
        for (int y = 0; y < (int)gridDim.y; ++y)
            t += ((volatile ACC*)partial)[(long long)y * C + c];
        store(db + c, t);
    }
    if (threadIdx.x == 0) arrived[blockIdx.x] = 0;  // ready for the next launch
}

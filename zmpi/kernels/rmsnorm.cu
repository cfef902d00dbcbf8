// RMSNorm, forward and backward: zmpi.kernels.llama.cuda_rmsnorm_forward / _backward, the twins
// zmpi.nn.llama_functional._rmsnorm_forward_twin / _rmsnorm_backward_twin (zmpi.kernels.OPS).

// y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps). x, y (rows, C) T; w (C,) T; xhat = x rstd
// (rows, C), rstd (rows,) ACC (what backward reuses)
extern "C" __global__ void rmsnorm_forward(const T* x, const T* w, T* y, ACC* xhat, ACC* rstd,
                                           const int C, const ACC eps) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)C;
    ACC s2 = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC v = to_acc(x[o + c]);
        s2 += v * v;
    }
    const ACC r = (ACC)1 / acc_sqrt(block_reduce(s2, shared, false) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC h = to_acc(x[o + c]) * r;
        xhat[o + c] = h;
        store(y + o + c, h * to_acc(w[c]));
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx = rstd (g - xhat mean(g xhat)), g = dy w (no mean to subtract, unlike LayerNorm's).
// dy, dx (rows, C) T
extern "C" __global__ void rmsnorm_backward(const T* dy, const ACC* xhat, const ACC* rstd,
                                            const T* w, T* dx, const int C) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)C;
    ACC sgx = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x)
        sgx += to_acc(dy[o + c]) * to_acc(w[c]) * xhat[o + c];
    const ACC mgx = block_reduce(sgx, shared, false) / C;
    const ACC r = rstd[blockIdx.x];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC g = to_acc(dy[o + c]) * to_acc(w[c]);
        store(dx + o + c, (g - xhat[o + c] * mgx) * r);
    }
}

// partial (1, gridDim.y, C): column sums of dy xhat (common.cuh's column_partials)
extern "C" __global__ void rmsnorm_dw_partials(const T* dy, const ACC* xhat, ACC* partial,
                                               const long long rows, const int C) {
    column_partials<false>(dy, xhat, partial, rows, C);
}

// dw[c]: the sum of rmsnorm_dw_partials' partials (1, parts, C), rounded once as written
extern "C" __global__ void rmsnorm_dw_total(const ACC* partial, T* dw, const int parts,
                                            const int C) {
    column_totals<false>(partial, dw, nullptr, parts, C);
}

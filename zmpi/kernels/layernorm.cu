// LayerNorm, forward and backward: zmpi.kernels.cuda_layernorm_forward / _backward, the twins
// zmpi.nn.functional._layernorm_forward_twin / _layernorm_backward_twin (zmpi.kernels.OPS).

// x, y (rows, C) T; w, b (C,) T; xhat (rows, C), rstd (rows,) ACC
extern "C" __global__ void layernorm_forward(const T* x, const T* w, const T* b, T* y,
                                             ACC* xhat, ACC* rstd, const int C, const ACC eps) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)C;
    ACC s = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += to_acc(x[o + c]);
    const ACC mean = block_reduce(s, shared, false) / C;
    ACC s2 = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC d = to_acc(x[o + c]) - mean;
        s2 += d * d;
    }
    const ACC r = (ACC)1 / acc_sqrt(block_reduce(s2, shared, false) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC h = (to_acc(x[o + c]) - mean) * r;
        xhat[o + c] = h;
        store(y + o + c, h * to_acc(w[c]) + to_acc(b[c]));
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w. dy, dx (rows, C) T
extern "C" __global__ void layernorm_backward(const T* dy, const ACC* xhat, const ACC* rstd,
                                              const T* w, T* dx, const int C) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)C;
    ACC sg = 0, sgx = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC g = to_acc(dy[o + c]) * to_acc(w[c]);
        sg += g;
        sgx += g * xhat[o + c];
    }
    const ACC mg = block_reduce(sg, shared, false) / C;
    const ACC mgx = block_reduce(sgx, shared, false) / C;
    const ACC r = rstd[blockIdx.x];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC g = to_acc(dy[o + c]) * to_acc(w[c]);
        store(dx + o + c, (g - mg - xhat[o + c] * mgx) * r);
    }
}

// partial (2, gridDim.y, C): column sums of dy xhat and of dy (common.cuh's column_partials)
extern "C" __global__ void column_sums(const T* dy, const ACC* xhat, ACC* partial,
                                       const long long rows, const int C) {
    column_partials<true>(dy, xhat, partial, rows, C);
}

// dw[c], db[c]: the sums of column_sums' partials (2, parts, C), rounded once as written
extern "C" __global__ void column_sums_total(const ACC* partial, T* dw, T* db, const int parts,
                                             const int C) {
    column_totals<true>(partial, dw, db, parts, C);
}

// Adam(W) and the sum of squares of the gradient clipping: zmpi.kernels.cuda_adam and
// cuda_sum_of_squares, the twins zmpi.optim.adam._adam_twin and _sum_of_squares_twin
// (zmpi.kernels.OPS).

// Adam(W) in place: param, m, v ACC (the master dtype); grads T. The operations and their
// order are host.py's _adam's (zmpi.optim.adam.AdamCoefficients names the scalars).
extern "C" __global__ void adam(ACC* param, const T* grads, ACC* m, ACC* v, const long long n,
                                const ACC scale, const ACC l2, const ACC beta1,
                                const ACC one_minus_beta1, const ACC beta2,
                                const ACC one_minus_beta2, const ACC eps_hat, const ACC decay,
                                const ACC step_size) {
    GRID_STRIDE(i, n) {
        ACC g = (ACC)to_acc(grads[i]) * scale;
        if (l2 != (ACC)0) g = g + param[i] * l2;
        const ACC mi = m[i] * beta1 + g * one_minus_beta1;
        const ACC vi = v[i] * beta2 + g * g * one_minus_beta2;
        m[i] = mi;
        v[i] = vi;
        param[i] = param[i] * decay - mi / (acc_sqrt(vi) + eps_hat) * step_size;
    }
}

// partial[block] = sum of (x scale)^2 over the block's grid-stride share of x
extern "C" __global__ void sum_of_squares(const T* x, ACC* partial, const long long n,
                                          const ACC scale) {
    __shared__ ACC shared[32];
    ACC s = 0;
    GRID_STRIDE(i, n) {
        const ACC g = (ACC)to_acc(x[i]) * scale;
        s += g * g;
    }
    s = block_reduce(s, shared, false);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// SwiGLU's gating, silu(g) * u, forward and backward (the gate, up and down matmuls are
// cuBLAS's): zmpi.kernels.llama.cuda_swiglu_forward / _backward, the twins
// zmpi.nn.llama_functional._swiglu_forward_twin / _swiglu_backward_twin (zmpi.kernels.OPS).

// sigmoid(v) as 0.5 (1 + tanh(v / 2)), the twins' form: no overflow for any finite v
__device__ __forceinline__ ACC swiglu_sigmoid(const ACC v) {
    return (acc_tanh(v * (ACC)0.5) + (ACC)1) * (ACC)0.5;
}

// y = sigmoid(g) g u; g, u, y (n,) T. Products in the twin's order.
extern "C" __global__ void swiglu_forward(const T* g, const T* u, T* y, const long long n) {
    GRID_STRIDE(i, n) {
        const ACC v = to_acc(g[i]);
        store(y + i, swiglu_sigmoid(v) * v * to_acc(u[i]));
    }
}

// du = dy silu(g), dg = dy u silu'(g), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g); all (n,) T
extern "C" __global__ void swiglu_backward(const T* dy, const T* g, const T* u, T* dg, T* du,
                                           const long long n) {
    GRID_STRIDE(i, n) {
        const ACC v = to_acc(g[i]), d = to_acc(dy[i]), s = swiglu_sigmoid(v);
        store(du + i, d * v * s);
        store(dg + i, (((ACC)1 - s) * v + (ACC)1) * s * d * to_acc(u[i]));
    }
}

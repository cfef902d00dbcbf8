// GELU (tanh approximation), forward and backward: zmpi.kernels.cuda_gelu_forward / _backward,
// the twins zmpi.nn.functional._gelu_forward_twin / _gelu_backward_twin (zmpi.kernels.OPS).

#define GELU_S 0.7978845608028654  // sqrt(2 / pi)

// y = 0.5 x (1 + t), t = tanh(sqrt(2/pi) x (1 + 0.044715 x^2)). Both kernels take the
// products in the twins' order (x x first, then times the constant), so each rounds as theirs.
extern "C" __global__ void gelu_forward(const T* x, T* y, ACC* t, const long long n) {
    GRID_STRIDE(i, n) {
        const ACC v = to_acc(x[i]);
        const ACC th = acc_tanh(v * (v * v * (ACC)0.044715 + (ACC)1) * (ACC)GELU_S);
        t[i] = th;
        store(y + i, (th + (ACC)1) * v * (ACC)0.5);
    }
}

extern "C" __global__ void gelu_backward(const T* dy, const T* x, const ACC* t, T* dx,
                                         const long long n) {
    GRID_STRIDE(i, n) {
        const ACC v = to_acc(x[i]), th = t[i];
        const ACC g = (v * v * (ACC)(3 * 0.044715) + (ACC)1) * (ACC)(0.5 * GELU_S) * v
                      * ((ACC)1 - th * th) + (ACC)0.5 + th * (ACC)0.5;
        store(dx + i, g * to_acc(dy[i]));
    }
}

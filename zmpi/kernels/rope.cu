// Rotary position embeddings, forward and backward (the rotation by the opposite angles):
// zmpi.kernels.llama.cuda_rope_forward / _backward, the twins
// zmpi.nn.llama_functional._rope_forward_twin / _rope_backward_twin (zmpi.kernels.OPS).
// The tables cos, sin (T, h) of the angles (rope_theta and the frequency scaling are the host's,
// zmpi.nn.llama_functional.rope_inv_freq) come in T; the rotation is computed in ACC.
//
// x and y are (A, B, T, 2h) read and written through strides (in elements; the last axis is
// unit-stride): xs = (xA, xB, xT), ys = (yA, yB, yT), so a head layout (B, n, T, hd) taken as a
// transposed view of (B, T, n, hd) is rotated where it lies. Transformers' rotate_half layout:
// channel j < h pairs with j + h,
//   y[j] = x[j] cos - x[j + h] sin s,   y[j + h] = x[j + h] cos + x[j] sin s
// with s = 1 (forward) or -1 (backward, the inverse rotation).
__device__ __forceinline__ void rope_rotate(
        const T* x, const T* cos_t, const T* sin_t, T* y, const int A, const int B, const int T_,
        const int h, const long long xA, const long long xB, const long long xT,
        const long long yA, const long long yB, const long long yT, const ACC s) {
    const long long n = (long long)A * B * T_ * h;
    GRID_STRIDE(i, n) {
        const int j = (int)(i % h);
        const long long row = i / h;  // a * B * T + b * T + t
        const int t = (int)(row % T_), b = (int)(row / T_ % B), a = (int)(row / T_ / B);
        const long long xo = a * xA + b * xB + t * xT + j, yo = a * yA + b * yB + t * yT + j;
        const ACC c = to_acc(cos_t[(long long)t * h + j]);
        const ACC sn = to_acc(sin_t[(long long)t * h + j]) * s;
        const ACC x1 = to_acc(x[xo]), x2 = to_acc(x[xo + h]);
        store(y + yo, x1 * c - x2 * sn);
        store(y + yo + h, x2 * c + x1 * sn);
    }
}

extern "C" __global__ void rope_forward(
        const T* x, const T* cos_t, const T* sin_t, T* y, const int A, const int B, const int T_,
        const int h, const long long xA, const long long xB, const long long xT,
        const long long yA, const long long yB, const long long yT) {
    rope_rotate(x, cos_t, sin_t, y, A, B, T_, h, xA, xB, xT, yA, yB, yT, (ACC)1);
}

extern "C" __global__ void rope_backward(
        const T* dy, const T* cos_t, const T* sin_t, T* dx, const int A, const int B,
        const int T_, const int h, const long long yA, const long long yB, const long long yT,
        const long long xA, const long long xB, const long long xT) {
    rope_rotate(dy, cos_t, sin_t, dx, A, B, T_, h, yA, yB, yT, xA, xB, xT, (ACC)-1);
}

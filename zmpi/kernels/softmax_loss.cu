// Softmax (attention's causal one, and its backward) and the cross-entropy loss:
// zmpi.kernels.cuda_causal_softmax, cuda_softmax_backward, cuda_cross_entropy_rows,
// cuda_cross_entropy_grad; the twins in zmpi.nn.attention and zmpi.nn.functional
// (zmpi.kernels.OPS).

// m = max of row[0, n), z = sum of exp(row[c] - m) over it, in every thread of the block
__device__ void row_max_sum_exp(const T* row, const int n, ACC* shared, ACC& m, ACC& z) {
    m = neg_inf((ACC)0);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const ACC v = to_acc(row[c]);
        m = v > m ? v : m;
    }
    m = block_reduce(m, shared, true);
    z = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) z += acc_exp(to_acc(row[c]) - m);
    z = block_reduce(z, shared, false);
}

// probs (rows, S) of scores (rows, S), both T (computed in ACC): softmax over the keys a query
// may see. Row r is query start + r % R; its keys 0 .. start + r % R; the later ones get
// probability 0.
extern "C" __global__ void causal_softmax(const T* scores, T* probs, const int R, const int S,
                                          const int start) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)S;
    const int seen = min(start + (int)(blockIdx.x % R) + 1, S);
    ACC m, z;
    row_max_sum_exp(scores + o, seen, shared, m, z);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        store(probs + o + c, c < seen ? acc_exp(to_acc(scores[o + c]) - m) / z : (ACC)0);
}

// dscores = probs (dprobs - sum(dprobs probs)), per row; all T, computed in ACC
extern "C" __global__ void softmax_backward(const T* dprobs, const T* probs, T* dscores,
                                            const int S) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)S;
    ACC dot = 0;
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        dot += to_acc(dprobs[o + c]) * to_acc(probs[o + c]);
    dot = block_reduce(dot, shared, false);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        store(dscores + o + c, (to_acc(dprobs[o + c]) - dot) * to_acc(probs[o + c]));
}

// loss[r] = (lse - logits[r, t]) inv_normalizer (0 where t == ignore), lse[r] = log sum exp
extern "C" __global__ void cross_entropy_forward(const T* logits, const long long* targets,
                                                 ACC* loss, ACC* lse, const int V,
                                                 const int has_ignore, const long long ignore,
                                                 const ACC inv_normalizer) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)V;
    ACC m, s;
    row_max_sum_exp(logits + o, V, shared, m, s);
    if (threadIdx.x == 0) {
        const long long t = targets[blockIdx.x];
        const bool ignored = has_ignore && t == ignore;
        const ACC l = acc_log(s);
        lse[blockIdx.x] = l + m;
        loss[blockIdx.x] = ignored ? (ACC)0 : (l - (to_acc(logits[o + t]) - m)) * inv_normalizer;
    }
}

// dlogits = (exp(logits - lse) - onehot(t)) scale, 0 on ignored rows
extern "C" __global__ void cross_entropy_backward(const T* logits, const ACC* lse,
                                                  const long long* targets, T* dlogits,
                                                  const int V, const int has_ignore,
                                                  const long long ignore, const ACC scale) {
    const long long o = blockIdx.x * (long long)V, t = targets[blockIdx.x];
    const bool ignored = has_ignore && t == ignore;
    const ACC l = lse[blockIdx.x];
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const ACC p = acc_exp(to_acc(logits[o + c]) - l) - (c == t ? (ACC)1 : (ACC)0);
        store(dlogits + o + c, ignored ? (ACC)0 : p * scale);
    }
}

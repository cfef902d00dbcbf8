"""The Llama family's fused ops: RMSNorm, rotary embeddings and SwiGLU's gating
(zmpi/kernels/rmsnorm.cu, rope.cu, swiglu.cu; launchers in zmpi.kernels.llama, twins in
zmpi.nn.llama_functional). Each CUDA launcher against its NumPy twin on the CPU executor
(tests/cuda_cpu.py, blocks and threads ordered and shuffled) and on a GPU; the Llama layers
dispatching to them (the GPT's switch, `kernels`) on the CuPy stand-in and on a GPU; bad
shapes one line each. The ops' fused-against-composed bits and launch counts on the stand-in,
their NVRTC compiles in both wheel layouts and each launcher's arguments against its kernel's
signature are in tests/test_kernels.py and tests/test_kernels_compile.py, with the other ops'.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi_util import REPO_ROOT, STANDIN, child_env

from zmpi import backend
from zmpi.kernels import llama as K
from zmpi.nn import llama_functional as L

# float32 accumulation: 1e-5 relative in fp32, two roundings of the output in fp16 and bf16
# (tests/test_kernels.py's); the rotation's twin rounds each product and sum in 16 bits, the
# kernel once, which stays within these too
TOLERANCE = {np.float16: 2e-3, backend.BFLOAT16: 1.6e-2, np.float32: 1e-5, np.float64: 1e-12}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, backend.BFLOAT16, np.float64])
def test_each_llama_kernel_matches_its_twin(cuda_device, dtype):
    """RMSNorm forward (y, x-hat, 1/rms) and backward (dx, and dw into a gradient or a new
    array) over rows of 40 and of 300 (more than a block's threads) and 130 rows (more than
    the 64 row parts of dw's column sums); SwiGLU's gating forward and backward; RoPE forward
    and backward on heads laid out as GQA lays them (a transposed view read where it lies,
    written into a transposed view of the merged layout), on a sliced input and into a strided
    out (copied through a C-contiguous one) and on six axes: each against its twin."""
    cupy = cuda_device
    rng = np.random.default_rng(0)
    tol = TOLERANCE[dtype]

    def same(fused, twin):
        for a, b in zip(fused, twin, strict=True):  # lists of arrays (device's, NumPy's)
            a = cupy.asnumpy(a).astype(np.float64)
            np.testing.assert_allclose(a, np.asarray(b, np.float64), rtol=tol, atol=tol)

    def draw(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(dtype)

    for shape, scale in (((6, 7, 40), 1.0), ((1, 300), 300.0), ((130, 24), 1.0)):
        x, w, dy = draw(*shape, scale=scale), draw(shape[-1]), draw(*shape)
        y, cache = K.cuda_rmsnorm_forward(cupy.asarray(x), cupy.asarray(w), 1e-6)
        ty, tcache = L._rmsnorm_forward_twin(x, w, 1e-6)
        same([y, *cache[:2]], [ty, *tcache[:2]])
        dw = cupy.zeros(shape[-1], dtype)
        for into in (None, dw):
            same(K.cuda_rmsnorm_backward(cupy.asarray(dy), cache, into),
                 L._rmsnorm_backward_twin(dy, tcache, None))
        same([dw], [L._rmsnorm_backward_twin(dy, tcache, None)[1]])

    g, u, dy = draw(5, 70, scale=4.0), draw(5, 70), draw(5, 70)
    y, cache = K.cuda_swiglu_forward(cupy.asarray(g), cupy.asarray(u))
    same([y], [L._swiglu_forward_twin(g, u)[0]])
    same(K.cuda_swiglu_backward(cupy.asarray(dy), cache), L._swiglu_backward_twin(dy, (g, u)))

    B, T, n, hd = 2, 5, 3, 8
    cos, sin = (t.astype(dtype) for t in L.rope_tables(L.rope_inv_freq(hd, 500.0), T, 9))
    q = draw(B, T, n * hd)
    heads = q.reshape(B, T, n, hd).transpose(0, 2, 1, 3)
    y = K.cuda_rope_forward(cupy.asarray(q).reshape(B, T, n, hd).transpose(0, 2, 1, 3),
                            cupy.asarray(cos), cupy.asarray(sin))
    assert y.flags.c_contiguous and y.shape == (B, n, T, hd)
    same([y], [L._rope_forward_twin(heads, cos, sin, None)])
    dh = draw(B, n, T, hd)
    merged, want = cupy.zeros((B, T, n, hd), dtype), np.zeros((B, T, n, hd), dtype)
    K.cuda_rope_backward(cupy.asarray(dh), cupy.asarray(cos), cupy.asarray(sin),
                         merged.transpose(0, 2, 1, 3))
    L._rope_backward_twin(dh, cos, sin, want.transpose(0, 2, 1, 3))
    same([merged], [want])
    wide = draw(3, T, 2 * hd)  # every other channel: no C-contiguous block, copied
    outs = cupy.zeros((3, T, 2 * hd), dtype), np.zeros((3, T, 2 * hd), dtype)
    K.cuda_rope_forward(cupy.asarray(wide)[..., ::2], cupy.asarray(cos), cupy.asarray(sin),
                        outs[0][..., ::2])
    L._rope_forward_twin(wide[..., ::2], cos, sin, outs[1][..., ::2])
    same([outs[0]], [outs[1]])
    six = draw(2, 1, 2, 3, T, hd)
    same([K.cuda_rope_backward(cupy.asarray(six), cupy.asarray(cos), cupy.asarray(sin))],
         [L._rope_backward_twin(six, cos, sin, None)])


# A Llama block's layers (RMSNorm, grouped-query attention with RoPE, SwiGLU) forward and
# backward on device arrays under each mode: what each returns, and the launches it took.
LAYERS = """
import json
import numpy as np, cupy
from zmpi import backend, kernels
from zmpi.nn.llama_layers import GroupedQueryAttention, RMSNorm, RotaryEmbedding, SwiGLU

LAUNCHES = cupy.LAUNCHES if getattr(cupy, "STANDIN", False) else [0]
rope = RotaryEmbedding(8, 500.0, {"rope_type": "linear", "factor": 2.0})
out = {}
for dtype in (np.float32, np.float16, backend.BFLOAT16):
    rng = np.random.default_rng(0)
    x, dy = (cupy.asarray(rng.standard_normal((2, 6, 32)).astype(dtype)) for _ in range(2))
    for mode in ("fused", "composed"):
        kernels.set_mode(mode)
        for name, layer in (("rmsnorm", RMSNorm(32, dtype=dtype)),
                            ("swiglu", SwiGLU(32, 48, rng=0, dtype=dtype)),
                            ("gqa", GroupedQueryAttention(32, 4, 2, rope, rng=0, dtype=dtype))):
            for p in layer.parameters():
                p.data, p.grad = cupy.asarray(p.data), cupy.zeros(p.data.shape, p.data.dtype)
                p.grad_zeroed = p.grad  # known zeros: written by the kernels (grad_out)
            before = LAUNCHES[0]
            y = layer.forward(x)
            forward = LAUNCHES[0] - before
            dx = layer.backward(dy)
            out[f"{np.dtype(dtype).name} {mode} {name}"] = [
                forward, LAUNCHES[0] - before - forward,
                [a.get().astype(np.float64).ravel().tolist()
                 for a in (y, dx, *(p.grad for p in layer.parameters()))]]
print(json.dumps(out))
"""

# a layer's launches under "fused" on the stand-in, (forward, backward), where they are the
# kernels' alone: RMSNorm one kernel forward, three backward (dw written into the zeroed
# gradient). SwiGLU and GQA add their matmuls (the test asks for fewer launches than composed)
FUSED_LAUNCHES = {"rmsnorm": (1, 3)}


def _layers(env):
    return json.loads(subprocess.run([sys.executable, "-c", LAYERS], env=env, cwd=REPO_ROOT,
                                     capture_output=True, text=True, check=True,
                                     timeout=300).stdout)


def test_llama_layers_dispatch_to_the_kernels_on_the_standin():
    """On the stand-in, each layer under "fused" gives the bits of "composed" (the twin is the
    same program) in fewer launches, in fp32, fp16 and bf16: RMSNorm in one kernel forward
    and three backward, and GQA and SwiGLU at least four fewer kernels each way (a rotation of
    q and of k, SwiGLU's gating: several array operations each when composed)."""
    out = _layers(STANDIN)
    for key, (forward, backward, result) in out.items():
        dtype, mode, name = key.split()
        if mode == "composed":
            continue
        c_forward, c_backward, composed = out[f"{dtype} composed {name}"]
        assert result == composed, key
        if name in FUSED_LAUNCHES:
            assert (forward, backward) == FUSED_LAUNCHES[name], (key, forward, backward)
        assert c_forward >= forward + 4 and c_backward >= backward + 4, (key, out[key][:2],
                                                                         (c_forward, c_backward))


@pytest.mark.gpu
def test_llama_layers_fused_match_composed_on_a_gpu():
    """On a GPU (CuPy >= 14 for bf16): each layer's output, input gradient and parameter
    gradients under "fused" (the kernels) against "composed" (the twins' array operations),
    within a few roundings of the dtype (the matmuls around the kernels round their
    differences again)."""
    cupy = pytest.importorskip("cupy")
    if getattr(cupy, "STANDIN", False) or cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("needs a CUDA device")
    out = _layers(child_env(ZMPI_BACKEND="cupy"))
    tol = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2}
    for key, (_, _, result) in out.items():
        dtype, mode, name = key.split()
        if mode == "fused":
            for a, b in zip(result, out[f"{dtype} composed {name}"][2], strict=True):
                np.testing.assert_allclose(a, b, rtol=tol[dtype], atol=tol[dtype], err_msg=key)


def test_bad_shapes_are_one_line_errors():
    x = np.zeros((2, 5, 8))
    cos, sin = L.rope_tables(L.rope_inv_freq(8), 5)
    for call, match in (
            (lambda: L.rope_forward(x, cos[:4], sin[:4]), "tables cos, sin"),
            (lambda: L.rope_backward(x, cos, sin[:, :2]), "tables cos, sin"),
            (lambda: L.rope_forward(np.zeros((5, 7)), cos, sin), "hd even"),
            (lambda: L.rope_forward(x, cos, sin, np.zeros((2, 5, 4))), "an out of x's shape"),
            (lambda: L.swiglu_forward(np.zeros((3, 4)), np.zeros((4,))), "of one shape")):
        with pytest.raises(ValueError, match=match) as info:
            call()
        assert "\n" not in str(info.value)

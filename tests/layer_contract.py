"""The layer contract as the engine exercises it (shared test helper): parameters rebound to
views of flat buffers, as the engine's flat buffers hold them (docs/architecture.md)."""
import numpy as np


def rebind_to_flat(module, padding=0):
    """Copy each parameter of `module` into one flat data buffer (its dtype, `padding` spare
    elements at the end, as a shard's padding) and rebind `.data` and `.grad` to views of
    it and of a zeroed flat gradient buffer, in `parameters()` order. Returns (flat_data,
    flat_grad, n): n the parameters' element count."""
    params = list(module.parameters())
    n = sum(p.size for p in params)
    dtype = params[0].data.dtype
    flat_data, flat_grad = np.zeros(n + padding, dtype), np.zeros(n + padding, dtype)
    off = 0
    for p in params:
        flat_data[off:off + p.size] = p.data.ravel()
        p.data = flat_data[off:off + p.size].reshape(p.shape)
        p.grad = flat_grad[off:off + p.size].reshape(p.shape)
        off += p.size
    return flat_data, flat_grad, n


def check_grads_accumulate(module, x, dy):
    """The contract's accumulation: a second forward and backward of (x, dy) doubles every
    parameter's gradient (backward adds to `.grad`), and zero_grad() clears them all."""
    module.forward(x)
    module.backward(dy)
    once = [p.grad.copy() for p in module.parameters()]
    module.forward(x)
    module.backward(dy)
    for g, p in zip(once, module.parameters(), strict=True):
        np.testing.assert_allclose(p.grad, 2 * g, rtol=1e-12)
    module.zero_grad()
    assert not any(p.grad.any() for p in module.parameters())

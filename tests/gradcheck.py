"""Finite-difference gradient checks in float64 (shared test helper).

Two checks, both by central differences with step `eps`:
  - directional (Chainer-style): for random directions d, compare (f(x + eps d) - f(x - eps d))
    / 2 eps with <grad, d>. One check covers every element at once, so it scales to big tensors.
  - elementwise: the full numerical gradient, for small tensors.
Tolerance: |num - ana| <= ATOL + RTOL * max(|num|, |ana|), RTOL = 1e-6, ATOL = 1e-9. In float64
with eps = 1e-5 the truncation error is ~eps^2 = 1e-10 and the rounding error ~1e-16 / eps =
1e-11 (relative), well inside.

Arrays are perturbed in place (so a Parameter's `.data` is exercised exactly as the layer reads
it) and restored afterwards.
"""

import numpy as np

RTOL = 1e-6
ATOL = 1e-9
EPS = 1e-5


def _close(num, ana, rtol, atol):
    return np.abs(num - ana) <= atol + rtol * np.maximum(np.abs(num), np.abs(ana))


def directional_check(f, x, grad, rng, n_dirs=2, eps=EPS, rtol=RTOL, atol=ATOL, name="x"):
    """Assert <grad, d> matches the central difference of f along random directions d.

    f: () -> float, reading `x` (float64, perturbed in place). grad: the analytic df/dx.
    """
    assert x.dtype == np.float64 and grad.shape == x.shape, (name, x.dtype, grad.shape, x.shape)
    x0 = x.copy()
    for _ in range(n_dirs):
        d = rng.standard_normal(x.shape)
        x[...] = x0 + eps * d
        fp = f()
        x[...] = x0 - eps * d
        fm = f()
        x[...] = x0
        num, ana = (fp - fm) / (2 * eps), float((grad * d).sum())
        assert _close(num, ana, rtol, atol), f"{name}: directional {num!r} vs analytic {ana!r}"


def numerical_grad(f, x, eps=EPS):
    """Elementwise central-difference gradient of f () -> float w.r.t. x (perturbed in place)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        v = flat[i]
        flat[i] = v + eps
        fp = f()
        flat[i] = v - eps
        fm = f()
        flat[i] = v
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def elementwise_check(f, x, grad, eps=EPS, rtol=RTOL, atol=ATOL, name="x"):
    """Assert the analytic grad matches the elementwise numerical gradient (small x only)."""
    num = numerical_grad(f, x, eps)
    bad = ~_close(num, grad, rtol, atol)
    assert not bad.any(), f"{name}: {bad.sum()} mismatches, max |diff| {np.abs(num - grad).max()}"


def check(f, x, grad, rng, name="x", max_elementwise=256):
    """Directional check, plus the elementwise one when x has at most `max_elementwise` entries."""
    directional_check(f, x, grad, rng, name=name)
    if x.size <= max_elementwise:
        elementwise_check(f, x, grad, name=name)


def check_module(module, x, rng, max_elementwise=256):
    """Check a layer's input gradient and every parameter gradient (float64 everywhere).

    Uses f = sum(forward(x) * dy) for a fixed random dy, so df/dx = backward(dy).
    Returns the list of checked names.
    """
    y = module.forward(x)
    dy = rng.standard_normal(y.shape)
    module.zero_grad()
    dx = module.backward(dy)
    grads = {name: p.grad.copy() for name, p in module.named_parameters()}

    def f():
        return float((module.forward(x) * dy).sum())

    checked = []
    if dx is not None:
        check(f, x, dx, rng, "input", max_elementwise)
        checked.append("input")
    for name, p in module.named_parameters():
        check(f, p.data, grads[name], rng, name, max_elementwise)
        checked.append(name)
    module.clear_cache()
    return checked


def check_model_loss(model, inputs, targets, rng, max_elementwise=0, elementwise=()):
    """Check d model.loss(inputs, targets) / d p for every parameter (directionally; also
    elementwise for names in `elementwise` or tensors up to `max_elementwise` entries)."""
    model.zero_grad()
    model.loss(inputs, targets)
    model.backward_loss()

    def f():
        return model.loss(inputs, targets)

    names = []
    for name, p in model.named_parameters():
        grad = p.grad.copy()
        limit = p.size if name in elementwise else max_elementwise
        check(f, p.data, grad, rng, name, limit)
        names.append(name)
    model.clear_cache()
    return names

"""Rank side of tests/test_tensor_parallel.py: Megatron's MLP block (ColumnParallelLinear ->
GELU -> RowParallelLinear) against the serial Linear -> GELU -> Linear from the same seeds, a
collective finite-difference gradient check, the allreduce traffic, and the refusal of a
feature count tp does not divide. At every tp in {2, 4} that divides the world (a tp smaller
than the world runs in dp groups: mesh.tp_comm is then a split Comm).

    mpiexec -n 2 python tests/ranks/tensor_checks.py     # or -n 4
"""
import sys
from pathlib import Path

import numpy as np
from _report import report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: gradcheck
from gradcheck import ATOL, EPS, RTOL, _close, directional_check  # noqa: E402

from zmpi.comm import Comm  # noqa: E402
from zmpi.nn import GELU, Linear  # noqa: E402
from zmpi.parallel.mesh import Mesh  # noqa: E402
from zmpi.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402

B, T, C_IN, HIDDEN, C_OUT = 2, 3, 6, 16, 5  # C_IN != C_OUT: f's and g's allreduces differ


class Serial:
    def __init__(self, seed, dtype):
        rng = np.random.default_rng(seed)
        self.fc = Linear(C_IN, HIDDEN, rng=rng, dtype=dtype)
        self.act = GELU()
        self.proj = Linear(HIDDEN, C_OUT, rng=rng, dtype=dtype, std=0.3)
        self.layers = [self.fc, self.act, self.proj]

    def forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def backward(self, dy):
        for layer in reversed(self.layers):
            dy = layer.backward(dy)
        return dy


class Parallel(Serial):
    def __init__(self, seed, dtype, tp):
        rng = np.random.default_rng(seed)
        self.fc = ColumnParallelLinear(C_IN, HIDDEN, tp, rng=rng, dtype=dtype)
        self.act = GELU()
        self.proj = RowParallelLinear(HIDDEN, C_OUT, tp, rng=rng, dtype=dtype, std=0.3)
        self.layers = [self.fc, self.act, self.proj]


def data(dtype=np.float64):
    rng = np.random.default_rng(7)  # the same on every rank: x and dy are replicated
    return (rng.standard_normal((B, T, C_IN)).astype(dtype),
            rng.standard_normal((B, T, C_OUT)).astype(dtype))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def against_serial(tp):
    """(a): outputs, input gradient and the local slices of every parameter gradient."""
    x, dy = data()
    serial, par = Serial(3, np.float64), Parallel(3, np.float64, tp)
    y, yp = serial.forward(x), par.forward(x)
    dx, dxp = serial.backward(dy), par.backward(dy)
    n = HIDDEN // tp.size
    cols = rows = slice(tp.rank * n, (tp.rank + 1) * n)  # fc's output = proj's input features
    return {
        "y": max_err(y, yp), "dx": max_err(dx, dxp),
        "fc.weight": max_err(serial.fc.weight.data[:, cols], par.fc.weight.data),
        "fc.weight.grad": max_err(serial.fc.weight.grad[:, cols], par.fc.weight.grad),
        "fc.bias.grad": max_err(serial.fc.bias.grad[cols], par.fc.bias.grad),
        "proj.weight": max_err(serial.proj.weight.data[rows], par.proj.weight.data),
        "proj.weight.grad": max_err(serial.proj.weight.grad[rows], par.proj.weight.grad),
        "proj.bias.grad": max_err(serial.proj.bias.grad, par.proj.bias.grad),
        "shapes": {name: list(p.shape) for name, p in
                   [("fc.weight", par.fc.weight), ("fc.bias", par.fc.bias),
                    ("proj.weight", par.proj.weight), ("proj.bias", par.proj.bias)]},
        "tp_split": [par.fc.weight.tp_split, par.fc.bias.tp_split, par.proj.weight.tp_split,
                     par.proj.bias.tp_split],
    }


def collective_directional_check(f, p, grad, tp, n_dirs=3):
    """Every rank perturbs its own slice `p` along its own random direction, in lockstep (one
    f() per rank per step, so the allreduces inside match). L changes by the sum over ranks of
    <grad_r, d_r>, which is what the numerical derivative is compared with."""
    rng = np.random.default_rng(100 + tp.rank)
    p0 = p.copy()
    for _ in range(n_dirs):
        d = rng.standard_normal(p.shape)
        p[...] = p0 + EPS * d
        fp = f()
        p[...] = p0 - EPS * d
        fm = f()
        p[...] = p0
        num = (fp - fm) / (2 * EPS)
        ana = tp.allreduce_scalar(float((grad * d).sum()))
        assert _close(num, ana, RTOL, ATOL), f"directional {num!r} vs analytic {ana!r}"


def gradient_check(tp):
    """(b): L = sum(w * y), the same on every rank; d L / d x, the replicated bias (every rank
    perturbs its copy along the same direction) and each rank's weight and bias slices."""
    x, w = data()
    block = Parallel(5, np.float64, tp)
    # non-zero biases: fc's a different slice on each rank, proj's the same everywhere
    block.fc.bias.data[...] = np.random.default_rng(11 + tp.rank).standard_normal(HIDDEN // tp.size)
    block.proj.bias.data[...] = np.random.default_rng(11).standard_normal(C_OUT)
    block.forward(x)
    dx = block.backward(w)
    params = {"fc.weight": block.fc.weight, "fc.bias": block.fc.bias,
              "proj.weight": block.proj.weight, "proj.bias": block.proj.bias}
    grads = {name: p.grad.copy() for name, p in params.items()}
    calls = [0]

    def f():
        calls[0] += 1
        return float((block.forward(x) * w).sum())

    rng = np.random.default_rng(21)  # the same on every rank: replicated perturbations
    directional_check(f, x, dx, rng, n_dirs=3, name="x")
    directional_check(f, block.proj.bias.data, grads["proj.bias"], rng, n_dirs=3,
                      name="proj.bias")
    for name in ("fc.weight", "fc.bias", "proj.weight"):  # split: each rank its own slice
        collective_directional_check(f, params[name].data, grads[name], tp)
    L = f()
    return {"checked": ["x", "proj.bias", "fc.weight", "fc.bias", "proj.weight"],
            "forwards": calls[0], "L_same": tp.allreduce_scalar(L, "max") ==
            tp.allreduce_scalar(L, "min")}


def traffic(tp, dtype=np.float64):
    """(c): allreduce calls and bytes after forward, then after backward."""
    x, dy = data(dtype)
    block = Parallel(3, dtype, tp)
    tp.reset_counters()
    y = block.forward(x)
    after_forward = tp.counters_snapshot()
    block.backward(dy.astype(y.dtype))
    after_backward = tp.counters_snapshot()
    return {"forward": after_forward, "backward": after_backward,
            "y_dtype": str(y.dtype), "itemsize": np.dtype(y.dtype).itemsize}


def half_precision(tp):
    """float16 storage: computed in float32 (also the allreduces), close to the serial twin."""
    x, dy = data()
    serial, par = Serial(3, np.float16), Parallel(3, np.float16, tp)
    y, yp = serial.forward(x), par.forward(x)
    dx, dxp = serial.backward(dy), par.backward(dy)
    return {"y": max_err(y, yp), "dx": max_err(dx, dxp), "dtype": str(yp.dtype),
            "grad_dtype": str(par.fc.weight.grad.dtype)}


def refusals(tp):
    out = {}
    for name, make in (("column", lambda: ColumnParallelLinear(4, 4 * tp.size + 1, tp)),
                       ("row", lambda: RowParallelLinear(4 * tp.size + 1, 4, tp))):
        try:
            make()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def main():
    comm = Comm()
    out = {"size": comm.size, "tp": {}}
    for t in (2, 4):
        if comm.size % t:
            continue
        mesh = Mesh(comm, tp=t)
        tp = mesh.tp_comm
        got = {"tp_size": tp.size, "tp_rank": tp.rank, "is_world": tp is comm,
               "serial": against_serial(tp), "traffic": traffic(tp),
               "traffic_fp16": traffic(tp, np.float16), "half": half_precision(tp),
               "refusals": refusals(tp)}
        if t == 2:
            got["gradcheck"] = gradient_check(tp)
        mesh.free()
        out["tp"][str(t)] = got
    report(out)


if __name__ == "__main__":
    main()

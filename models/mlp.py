"""A tiny MLP classifier as a UnitModel: the engine tests' model without tied weights.

    model = MLPModel(sizes=(16, 32, 32, 8))
    loss = model.loss(x, y)        # x (B, 16) or (B, T, 16) float, y (B,) or (B, T) int
    model.backward_loss()
"""

import numpy

from zmpi.nn import GELU, Linear, Module, UnitModel


class Dense(Module):
    """One unit: fc (Linear) followed by GELU unless `act=False`.  x (..., d_in) -> (..., d_out)."""

    def __init__(self, d_in, d_out, act, rng, dtype):
        self.fc = Linear(d_in, d_out, rng=rng, dtype=dtype)
        self.act = GELU() if act else None

    def forward(self, x):
        x = self.fc.forward(x)
        return self.act.forward(x) if self.act else x

    def backward(self, dy):
        return self.fc.backward(self.act.backward(dy) if self.act else dy)


class MLPModel(UnitModel):
    """Units Dense(sizes[i], sizes[i+1]) with GELU between, the last one without (logits).

    Weights normal(0, 1/sqrt(fan_in)) from `seed`, biases 0, stored in `dtype`.
    """

    def __init__(self, sizes=(16, 32, 32, 8), seed=0, dtype=numpy.float32):
        rng = numpy.random.default_rng(seed)
        n = len(sizes) - 1
        super().__init__([Dense(sizes[i], sizes[i + 1], i < n - 1, rng, dtype) for i in range(n)])

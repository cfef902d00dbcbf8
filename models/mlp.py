"""An MLP as a UnitModel, one zmpi.nn.Dense per unit: a classifier (softmax cross-entropy) or,
with `loss=MSELoss()`, a regressor. The engine tests' model without tied weights.

    model = MLPModel(sizes=(16, 32, 32, 8))
    loss = model.loss(x, y)        # x (B, 16) or (B, T, 16) float, y (B,) or (B, T) int
    model.backward_loss()
    regressor = MLPModel(sizes=(16, 32, 1), loss=MSELoss())   # y (B, 1) float
"""

import numpy

from zmpi.nn import Dense, UnitModel


class MLPModel(UnitModel):
    """Units Dense(sizes[i], sizes[i+1]) with GELU between, the last one without (the output).

    Weights normal(0, 1/sqrt(fan_in)) from `seed`, biases 0, stored in `dtype`. loss: a
    zmpi.nn.losses.Loss (default: softmax cross-entropy on the output as logits).
    """

    def __init__(self, sizes=(16, 32, 32, 8), seed=0, dtype=numpy.float32, loss=None):
        rng = numpy.random.default_rng(seed)
        n = len(sizes) - 1
        super().__init__([Dense(sizes[i], sizes[i + 1], i < n - 1, rng, dtype)
                          for i in range(n)], loss)

"""Losses: the last piece of a UnitModel, on the output of its last unit.

    model = UnitModel(units, loss=MSELoss())              # default: CrossEntropyLoss()
    loss = model.loss(inputs, targets)                    # forward + loss, a float
    model.backward_loss(scale)                            # d(scale * loss) back through the units

Contract of a loss (subclass `Loss`, implement the three methods):
- `forward(outputs, targets, normalizer=None)` returns a 0-d array: the *sum* of the
  per-element losses divided by `normalizer`, by default the number of elements that count (so
  the mean), and keeps what backward needs (`self._save`).
- `backward(dloss)` returns d(dloss * loss)/d outputs, shaped like the outputs.
- `count(targets)` says how many elements of `targets` count, or None when every element of
  every batch counts equally (then a per-rank mean is already the global mean).

Across ranks the engine averages gradients over the global batch. When `count` varies (targets
equal to `ignore_index`), the engine allreduces the counts of the whole step and passes
`normalizer` = (global count) / (ranks x micro-batches), so that averaging the micro-batch
losses gives sum over every rank's counted elements / global count: the loss a single process
would compute on the whole batch (PyTorch DDP instead averages per-rank means).
"""

from zmpi.nn import functional as F
from zmpi.nn.base import Module


class Loss(Module):
    """Base class: see the module docstring. A loss has no parameters."""

    def forward(self, outputs, targets, normalizer=None):
        raise NotImplementedError

    def backward(self, dloss=1.0):
        raise NotImplementedError

    def count(self, targets):
        return None


class CrossEntropyLoss(Loss):
    """Softmax cross-entropy of logits (..., V) against int targets (...): the mean over
    positions whose target is not `ignore_index` (None: every position counts)."""

    def __init__(self, ignore_index=None):
        self.ignore_index = ignore_index

    def forward(self, outputs, targets, normalizer=None):
        loss, cache = F.cross_entropy_forward(outputs, targets, self.ignore_index, normalizer)
        self._save(cache)
        return loss

    def backward(self, dloss=1.0):
        return F.cross_entropy_backward(self._pop(), dloss)

    def count(self, targets):
        if self.ignore_index is None:
            return None
        return int((targets != self.ignore_index).sum())


class MSELoss(Loss):
    """Mean squared error of outputs against float targets of the same shape."""

    def forward(self, outputs, targets, normalizer=None):
        loss, cache = F.mse_forward(outputs, targets, normalizer)
        self._save(cache)
        return loss

    def backward(self, dloss=1.0):
        return F.mse_backward(self._pop(), dloss)

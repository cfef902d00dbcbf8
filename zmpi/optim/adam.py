"""Adam and AdamW on flat fp32 arrays, in place (Kingma & Ba 2015; Loshchilov & Hutter 2019).

The same code runs on NumPy (host) and CuPy (device) arrays: it uses only in-place ufuncs of
the arrays' own module, so the update allocates two temporaries of the array's size and no
more. The engine calls it once per step on the rank's contiguous shard of master weights.
"""
from __future__ import annotations

from dataclasses import dataclass

from zmpi.backend import array_module


@dataclass
class Adam:
    """Hyper-parameters and step count; the state (m, v) belongs to the caller's buffers.

    decoupled=True is AdamW (weight decay applied to the weights, not through the gradient),
    matching torch.optim.AdamW; decoupled=False matches torch.optim.Adam's L2 weight decay.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    step_count: int = 0

    def step_(self, param, grad, m, v) -> None:
        """One update of `param` (fp32, 1-D) from `grad` (fp32, same shape; may be modified)."""
        self.step_count += 1
        adam_update_(param, grad, m, v, self.step_count, self.lr, self.betas, self.eps,
                     self.weight_decay, self.decoupled)


def adam_update_(param, grad, m, v, step, lr, betas, eps, weight_decay, decoupled) -> None:
    """In-place Adam(W) update; `grad` is used as scratch space and left overwritten."""
    xp = array_module(param)
    beta1, beta2 = betas
    if weight_decay and not decoupled:
        grad += weight_decay * param                       # g = g + wd * p   (L2, Adam)
    m *= beta1
    m += (1 - beta1) * grad                                # m = b1 m + (1 - b1) g
    v *= beta2
    grad *= grad
    v += (1 - beta2) * grad                                # v = b2 v + (1 - b2) g^2
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = grad                                           # reuse g's memory
    xp.sqrt(v, out=denom)
    denom /= bias2**0.5
    denom += eps                                           # sqrt(v_hat) + eps
    if weight_decay and decoupled:
        param *= 1 - lr * weight_decay                     # p = p - lr wd p   (AdamW)
    xp.divide(m, denom, out=denom)
    denom *= lr / bias1
    param -= denom                                         # p = p - lr m_hat / (sqrt(v_hat) + eps)

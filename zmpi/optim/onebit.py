"""1-bit Adam (Tang et al., *1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed*, ICML'21), as DeepSpeed's OnebitAdam
(deepspeed/runtime/fp16/onebit/adam.py) computes it, on flat buffers like zmpi's Adam.

    opt = OneBitAdam(lr=1e-3, freeze_step=100, average=CompressedAllreduce(...))
    opt.reduces_gradients        # True while it warms up: the engine allreduces the gradients
    opt.step_(param, grads, m, v, grad_scale, clip_coef)   # param, m (and v) in place

Steps 1 .. freeze_step, the warm-up: Adam on the gradient averaged over the ranks, both
moments updated, without bias correction (DeepSpeed's OnebitAdam corrects neither moment, in
either phase, whatever its `bias_correction` says):

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2;   p = p (1 - lr wd) - lr m / (sqrt(v) + eps)

Every later step: v is frozen and only the momentum crosses the network, one bit an element:

    m = b1 m + (1 - b1) g_i      on each rank i, from its own, unreduced gradient g_i
    m = 0 where v <= eps^2       the mask: what had no gradient above eps in the warm-up (the
                                 layout's padding, unused parameters, the attention's key bias,
                                 whose gradient is rounding noise), see below
    m = average(m)               the error-compensated 1-bit allreduce (zmpi.comm.compressed):
                                 afterwards every rank holds the same m
    m = 0 where v <= eps^2       the mask again (the average gives every element +-scale)
    p = p (1 - lr wd) - lr m / (sqrt(v) + eps)

The mask. One bit cannot say "about zero": after the average an element's momentum is +-t, its
chunk's RMS, whatever its own gradient was. Where sqrt(v) is far below that, lr t / (sqrt(v) +
eps) moves the weight by orders of magnitude more than Adam would (plain Adam moves an
element with sqrt(v) <= eps by at most about lr a step: its |m| is below sqrt(v)). DeepSpeed
asks its user for a mask of the elements whose momentum stays exactly zero (`exp_avg_mask`);
zmpi derives it from the frozen v, and includes the elements whose gradient's RMS never rose
above eps (on a small GPT in fp32: the key biases, sqrt(v) ~ 1e-12; without the mask one
compressed step at lr 1e-2 moved them by about 1e3 in the tests). Masking the momentum
before the average too makes those elements exact zeros there, as DeepSpeed's masked ones
are: their rounding noise then never reaches the compressed signs and scales.

Weight decay is decoupled (DeepSpeed adds wd p to the update). `grads` is in the storage dtype
and read as grads x grad_scale x clip_coef, as Adam reads it: the engine passes the averaging
factor for the summed gradient in the warm-up and for this rank's own after it. `average` is
any callable that replaces a buffer of the master dtype by its average over the ranks, in
place, with a `reset()` (None: one rank, nothing to average). A checkpoint load resets its
errors (`load_state_dict`), as DeepSpeed does: the errors are each rank's own, and DeepSpeed
measured no loss from an occasional reset.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zmpi.backend import array_module
from zmpi.config.onebit import DEFAULT_FREEZE_STEP
from zmpi.optim.adam import (
    Adam,
    AdamCoefficients,
    _check_shapes,
    _publish_chunk_,
    _publish_pieces,
    _scaled_,
)

__all__ = ["OneBitAdam"]


@dataclass
class OneBitAdam(Adam):
    """Adam for `freeze_step` steps, then 1-bit Adam (module docstring). On the host give it
    `chunk` and `threads` as HostAdam has them; on a device, None and 1."""

    bias_correction: bool = False
    freeze_step: int = DEFAULT_FREEZE_STEP
    average: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        super().__post_init__()
        if self.freeze_step < 1:
            raise ValueError(f"freeze_step must be >= 1 (the steps of Adam that set v), got "
                             f"{self.freeze_step}")
        if self.bias_correction or not self.decoupled:
            raise ValueError("1-bit Adam has no bias correction and decays the weights "
                             "decoupled, as DeepSpeed's OnebitAdam")

    @property
    def reduces_gradients(self) -> bool:
        """Whether the next step is a warm-up step (it reads the summed gradients)."""
        return self.step_count < self.freeze_step

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.average is not None:
            self.average.reset()

    def step_(self, param, grads, m, v, grad_scale=1.0, clip_coef=1.0, publish=None) -> None:
        """Adam's step_ while warming up; afterwards the compressed step, with `grads` this
        rank's own gradient and `v` read only. `publish` as for Adam."""
        if self.reduces_gradients:
            super().step_(param, grads, m, v, grad_scale, clip_coef, publish)
            return
        _check_shapes(param, grads, m, v)
        pieces = _publish_pieces(publish, param)
        self.step_count += 1
        scale, _, beta1, one_minus_beta1, _, _, eps, decay, step_size = AdamCoefficients.of(
            param.dtype, self.step_count, self.lr, self.betas, self.eps, self.weight_decay,
            True, grad_scale * clip_coef, bias_correction=False)
        xp, n, floor = array_module(param), param.shape[0], eps * eps  # the mask: v <= eps^2

        def momentum(c, s):  # m = b1 m + (1 - b1) g, g this rank's gradient; masked
            g, mc = s[0][:c.stop - c.start], m[c]
            _scaled_(g, grads[c], scale)
            g *= one_minus_beta1
            mc *= beta1
            mc += g
            mc *= v[c] > floor

        def update(c, s):  # masked; p = p (1 - lr wd) - lr m / (sqrt(v) + eps), Adam's order
            t, mc, pc = s[0][:c.stop - c.start], m[c], param[c]
            mc *= v[c] > floor
            xp.sqrt(v[c], out=t)
            t += eps
            if decay != 1:
                pc *= decay
            xp.divide(mc, t, out=t)
            t *= step_size
            pc -= t
            if pieces:
                _publish_chunk_(pieces, param, c)

        self._map(momentum, n, param.dtype, xp, "step")
        if self.average is not None:
            self.average(m)
        self._map(update, n, param.dtype, xp, "step")

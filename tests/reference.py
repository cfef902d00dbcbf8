"""The single-process oracle for ZeRO parity: no MPI, no engine, no flat buffers.

Trains a freshly built model on the whole global batch of every step with a plain per-tensor
AdamW written out here (independently of zmpi.optim), with torch-style global-norm clipping.
The engine under any stage and world size must reproduce these parameters.
"""
import numpy as np


def reference_train(model, batches, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                    clip=0.0, adamw=True, delay_after=None):
    """batches: list of (inputs, targets), each the step's whole global batch.
    Returns (name -> array after training, in the model's dtype; per-step mean losses).

    delay_after=W: the one-step delayed update (ZeRO-Offload's DPU) after W synchronous
    steps: from step W on (0-based), step t's gradient is computed with the weights from before
    step t-1's update, and the update is still applied to the latest weights."""
    params = dict(model.named_parameters())
    m = {n: np.zeros_like(p.data, dtype=np.float64) for n, p in params.items()}
    v = {n: np.zeros_like(p.data, dtype=np.float64) for n, p in params.items()}
    master = {n: p.data.copy() for n, p in params.items()}  # the weights updates apply to
    losses = []
    for t, (x, y) in enumerate(batches, start=1):
        model.zero_grad()
        losses.append(model.loss(x, y))
        model.backward_loss()
        grads = {n: p.grad.astype(np.float64) for n, p in params.items()}
        if clip > 0:
            norm = np.sqrt(sum(float((g * g).sum()) for g in grads.values()))
            coef = clip / (norm + 1e-6)
            if coef < 1:
                grads = {n: g * coef for n, g in grads.items()}
        delayed = delay_after is not None and t > delay_after
        published = {n: w.copy() for n, w in master.items()}  # visible at the next step
        for n in params:
            g, w = grads[n], master[n].astype(np.float64)
            if weight_decay and not adamw:
                g = g + weight_decay * w
            m[n] = betas[0] * m[n] + (1 - betas[0]) * g
            v[n] = betas[1] * v[n] + (1 - betas[1]) * g * g
            m_hat = m[n] / (1 - betas[0] ** t)
            v_hat = v[n] / (1 - betas[1] ** t)
            if weight_decay and adamw:
                w = w - lr * weight_decay * w
            master[n][...] = w - lr * m_hat / (np.sqrt(v_hat) + eps)
        for n, p in params.items():
            p.data[...] = published[n] if delayed else master[n]
    return {n: w.copy() for n, w in master.items()}, losses

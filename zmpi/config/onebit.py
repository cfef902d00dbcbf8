"""The config of 1-bit Adam (`"optimizer": {"type": "OneBitAdam", "params": {...}}`,
docs/onebit.md): its DeepSpeed keys, and the layouts it runs in. This module imports no MPI.

    params = onebit_params(type, params)   the keys DeepSpeed's OnebitAdam takes that zmpi
                                           never varies, checked and dropped
    check_onebit_fields(optimizer)         its own fields: only with OneBitAdam, valid values
    check_onebit_layout(config)            ZeRO stage 0 and plain data parallelism only

DeepSpeed's OnebitAdam takes lr, freeze_step, bias_correction, betas, eps, eps_inside_sqrt,
weight_decay, max_grad_norm, amsgrad, cuda_aware and comm_backend_name. zmpi acts on lr, betas,
eps, weight_decay and freeze_step. `cuda_aware` says whether the MPI takes device buffers,
which zmpi's Comm finds out itself: the engine checks that it agrees (zmpi.optim.onebit).
The rest are accepted only with the value that describes what both DeepSpeed and zmpi do.
"""
from __future__ import annotations

from .base import ConfigError, _check

__all__ = ["ONEBIT", "DEFAULT_FREEZE_STEP", "ONEBIT_FIELDS", "ONEBIT_ALWAYS", "onebit_params",
           "check_onebit_fields", "check_onebit_layout"]

ONEBIT = "OneBitAdam"
DEFAULT_FREEZE_STEP = 100_000  # DeepSpeed's OnebitAdam
ONEBIT_FIELDS = ("freeze_step", "cuda_aware", "comm_backend_name")  # OptimizerConfig fields
ONEBIT_ALWAYS = {  # key: (the value zmpi accepts, what DeepSpeed's OnebitAdam and zmpi do)
    "bias_correction": (False, "applies no bias correction (DeepSpeed's OnebitAdam corrects "
                               "neither moment whatever this key says)"),
    "eps_inside_sqrt": (False, "adds eps outside the square root (DeepSpeed's OnebitAdam "
                               "ignores this key)"),
    "amsgrad": (False, "has no AMSGrad variant (DeepSpeed's OnebitAdam refuses it)"),
    "max_grad_norm": (0.0, "clips through the top-level gradient_clipping (DeepSpeed's "
                           "OnebitAdam ignores this key)"),
}
COMM_BACKEND = "mpi"


def onebit_params(type_: str | None, params: dict) -> dict:
    """`params` without the ONEBIT_ALWAYS keys, each checked: with OneBitAdam only, and only
    at the value zmpi always behaves as. ConfigError (key `params.<key>`, or `type`) else."""
    given = [k for k in ONEBIT_ALWAYS if k in params]
    if not given:
        return params
    if str(type_).lower() != ONEBIT.lower():
        raise ConfigError(f"params.{given[0]}", f"is a key of {ONEBIT} (1-bit Adam); the "
                          f"optimizer is {type_ or 'AdamW'}")
    for k in given:
        want, behaviour, value = *ONEBIT_ALWAYS[k], params[k]
        same = value is want if isinstance(want, bool) else (
            type(value) in (int, float) and value == want)
        _check(same, f"params.{k}", f"zmpi's {ONEBIT} always {behaviour}: only {want!r} is "
               f"supported, got {value!r}")
    return {k: v for k, v in params.items() if k not in ONEBIT_ALWAYS}


def check_onebit_fields(opt) -> dict:
    """Check an OptimizerConfig's 1-bit fields; return {field: resolved value} to set (the
    DeepSpeed default freeze_step for OneBitAdam, when it is not given)."""
    if opt.type != ONEBIT:
        for k in ONEBIT_FIELDS:
            _check(getattr(opt, k) is None, k, f"is a key of {ONEBIT} (1-bit Adam); the "
                   f"optimizer is {opt.type}")
        return {}
    _check(opt.adam_w_mode, "adam_w_mode", f"{ONEBIT} decays the weights decoupled, as "
           "DeepSpeed's OnebitAdam (p -= lr (update + weight_decay p)); drop the key")
    _check(opt.freeze_step is None or opt.freeze_step >= 1, "freeze_step",
           f"must be >= 1 (the warm-up steps of plain Adam that set the frozen second moment), "
           f"got {opt.freeze_step}")
    _check(opt.comm_backend_name in (None, COMM_BACKEND), "comm_backend_name",
           f"zmpi's compressed allreduce always runs on MPI through its Comm (only "
           f"{COMM_BACKEND!r} is supported), got {opt.comm_backend_name!r}")
    return {"freeze_step": DEFAULT_FREEZE_STEP} if opt.freeze_step is None else {}


def check_onebit_layout(config) -> None:
    """ConfigError naming the key unless a OneBitAdam run is ZeRO stage 0 with plain data
    parallelism, as DeepSpeed's 1-bit Adam: the compressed momentum replaces stage 0's
    gradient allreduce, and every rank keeps the whole momentum."""
    if config.optimizer.type != ONEBIT:
        return
    zero, why = config.zero_optimization, f"{ONEBIT} (1-bit Adam) runs with "
    if zero.strategy is not None:
        _check(zero.strategy == "stage0", "zero_optimization.strategy",
               why + f"ZeRO stage 0 only, as DeepSpeed's; got strategy {zero.strategy!r}")
    else:
        _check(zero.stage == 0, "zero_optimization.stage",
               why + f"ZeRO stage 0 only (every rank keeps the whole momentum it compresses), "
               f"as DeepSpeed's; got {zero.stage}")
    for key in ("offload_optimizer", "offload_param"):
        _check(getattr(zero, key).device == "none", f"zero_optimization.{key}.device",
               why + "no offload (its momentum is exchanged on the device)")
    _check(config.tensor_parallel.autotp_size == 1, "tensor_parallel.autotp_size",
           why + f"data parallelism only, as DeepSpeed's; got {config.tensor_parallel.autotp_size}")
    _check(config.pipeline.stages == 1, "pipeline.stages",
           why + f"data parallelism only, as DeepSpeed's; got {config.pipeline.stages}")

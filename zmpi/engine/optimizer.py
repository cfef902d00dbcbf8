"""The engine's optimizer: Adam on the device, HostAdam on host memory (offload, or a CPU
run), or 1-bit Adam (docs/onebit.md) with its compressed allreduce; and what a step sends.

    engine.optimizer = build_optimizer(engine)    from the config's `optimizer` section
    declared_traffic(engine)                      {group kind: bytes} of the next step

1-bit Adam acts through `optimizer.reduces_gradients`: while it is true (the warm-up) stage 0
allreduces the gradients and the step averages them over the ranks; after it, backward
reduces nothing and the step reads this rank's own gradient (engine/step.py). The config has
already checked its layout (zmpi.config.onebit).
"""
from __future__ import annotations

import warnings

import numpy as np

from zmpi import backend
from zmpi.comm.compressed import CompressedAllreduce
from zmpi.config import ConfigError
from zmpi.optim.adam import HOST_CHUNK, Adam, HostAdam, host_threads
from zmpi.optim.onebit import OneBitAdam


def build_optimizer(engine):
    """The optimizer the config names, with its hyper-parameters, for the strategy's master:
    OneBitAdam (ZeRO stage 0), HostAdam on host memory (chunked and threaded), else Adam."""
    opt = engine.config.optimizer
    hyper = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                 weight_decay=opt.weight_decay, decoupled=opt.decoupled_weight_decay)
    if opt.type == "OneBitAdam":
        return build_onebit(engine, hyper)
    if engine.strategy.offload_optimizer or isinstance(engine.strategy.master, np.ndarray):
        return HostAdam(**hyper, threads=host_threads(engine.comm.local_size))
    return Adam(**hyper)


def build_onebit(engine, hyper: dict) -> OneBitAdam:
    """The OneBitAdam of `engine`'s config: Adam's `hyper`, freeze_step, and the 1-bit average
    over the strategy's ranks of the momentum (the master dtype, on the master's device);
    chunked and threaded as HostAdam on host memory."""
    opt, comm = engine.config.optimizer, engine.strategy.comm
    check_cuda_aware(opt.cuda_aware, comm)
    average = CompressedAllreduce(comm, engine.layout.full_numel, engine.master_dtype,
                                  engine.memory, engine.xp)
    on_host = isinstance(engine.strategy.master, np.ndarray)
    threads = dict(chunk=HOST_CHUNK, threads=host_threads(engine.comm.local_size)) \
        if on_host else {}
    return OneBitAdam(**hyper, freeze_step=opt.freeze_step, average=average, **threads)


def check_cuda_aware(cuda_aware, comm) -> None:
    """DeepSpeed's `cuda_aware` declares whether MPI takes device buffers; zmpi's Comm finds
    out itself (zmpi.comm.mpi_info) and hands them over exactly when it does, else stages
    them through host memory. A declaration that contradicts it is a ConfigError; on the
    NumPy backend there are no device buffers and the key has no effect (noted)."""
    if cuda_aware is None:
        return
    key = "optimizer.params.cuda_aware"
    if not backend.is_gpu:
        if comm.rank == 0:
            warnings.warn(f"zmpi config: {key}: accepted without effect (the NumPy backend has "
                          "no device buffers)", stacklevel=3)
        return
    if cuda_aware != comm.is_cuda_aware:
        found = "is" if comm.is_cuda_aware else "is not"
        raise ConfigError(key, f"{cuda_aware}, but this MPI {found} CUDA-aware (decided by "
                          f"{comm.cuda_aware_source}), and zmpi hands "
                          "device buffers to MPI exactly when it is; drop the key, or set "
                          "ZMPI_CUDA_AWARE=0|1 if the detection is wrong")


def declared_traffic(engine) -> dict[str, int]:
    """{group kind: bytes this rank sends} in the next step without gradient accumulation, as
    Comm counts them: the strategy's `expected_traffic`, or after 1-bit Adam's warm-up its
    compressed allreduce (zmpi.comm.compressed: 2 (N - 1) / N x n / 8 + 2 (N - 1) s bytes,
    n = Psi padded to a multiple of 8 N, s the master dtype's itemsize)."""
    if engine.optimizer.reduces_gradients:
        return engine.strategy.expected_traffic()
    return {"world": engine.optimizer.average.sent_bytes()}

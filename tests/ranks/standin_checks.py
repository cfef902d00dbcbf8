"""Rank side of tests/test_gpu_standin.py: the whole training path on the current backend (run
with the cupy stand-in, or NumPy for the reference), for one world size in one launch.

    PYTHONPATH=tests/standin ZMPI_BACKEND=cupy mpiexec -n N python tests/ranks/standin_checks.py OUT

Trains stages 0-3 x fp32/fp16/bf16 x overlap on/off with gradient accumulation and clipping and
writes rank 0's gathered parameters to OUT/<case>.npz; reports the backend, whether MPI took
device buffers directly, the bytes staged through the host, and the device bytes at peak during
a stage-3 engine's construction (stand-in pool) next to the ledger's.
"""
import gc
import sys

import numpy as np
from _report import report
from zero_checks import GPT_CONFIG, config, gpt_data

from zmpi import backend
from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.models.gpt import GPT


def device_peak_while(build):
    """(device bytes at the highest while `build()` runs, above those in use before; its result).

    CuPy's memory pool keeps no peak, so every allocation meanwhile goes through a wrapper of
    the current allocator that notes the pool's bytes in use (a peak only rises at an allocation).
    """
    xp = backend.xp
    pool, inner = xp.get_default_memory_pool(), xp.cuda.get_allocator()
    before = pool.used_bytes()
    peak = [before]

    def noting_malloc(size):
        mem = inner(size)
        peak[0] = max(peak[0], pool.used_bytes())
        return mem

    xp.cuda.set_allocator(noting_malloc)
    try:
        result = build()
    finally:
        xp.cuda.set_allocator(inner)
    return peak[0] - before, result


def main(out):
    comm = Comm()
    cases = {}
    if comm.rank == 0:
        np.savez(f"{out}/init.npz", **{k: p.data for k, p in
                                       GPT(GPT_CONFIG, seed=0).named_parameters()})
    for stage in range(4):
        for dtype in ("fp32", "fp16", "bf16"):
            for overlap in (False, True):
                cfg = config(stage, dtype, accumulation=2, clip=0.05, overlap=overlap, n=comm.size)
                engine = Engine(GPT(GPT_CONFIG, seed=0), cfg, comm)
                data = gpt_data(comm, 2)
                losses = [engine.train_step(*data.sample(s)) for s in range(3)]
                params = engine.gather_parameters()
                name = f"s{stage}_{dtype}_{'overlap' if overlap else 'sync'}"
                if comm.rank == 0:
                    np.savez(f"{out}/{name}.npz", **params)
                cases[name] = losses
    init = {}
    if backend.is_gpu:
        del engine
        gc.collect()  # nothing of the engines above may count in the peak below
        peak, engine = device_peak_while(
            lambda: Engine(GPT(GPT_CONFIG, seed=0), config(3, "fp16", n=comm.size), comm))
        init = {"peak_device_bytes": peak,
                "ledger_device_bytes": engine.memory.peak(device="device"),
                "padded_params": engine.layout.full_numel}
    from zmpi.comm import staging_nbytes

    device = None
    if backend.is_gpu:
        device = (backend.device_source, backend.xp.cuda.runtime.getDevice())
    report({"backend": backend.name, "cuda_aware": comm.is_cuda_aware, "device": device,
            "staging_in_ledger": engine.memory.current("comm_buffer", "host") == staging_nbytes(),
            "cuda_aware_source": comm.cuda_aware_source, "staged": comm.staged_bytes,
            "losses": cases, "init": init})


if __name__ == "__main__":
    main(sys.argv[1])

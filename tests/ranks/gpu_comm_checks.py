"""Rank side of tests/test_gpu_comm.py: float16 and bfloat16 reductions (allreduce and
reduce-scatter, blocking and non-blocking, sum/max/min) on host buffers, and on float16
device buffers when the backend is the CuPy stand-in (staged, or "CUDA-aware" with
ZMPI_CUDA_AWARE=1). Mode `native` uses the MPI's own float16 type (MPIX_C_FLOAT16, which the
mpich wheel has); `no_float16` plays an MPI without one (the wire table's float16 entry
becomes 2-byte words, as zmpi.comm.wire builds it there). Every reduction call that reaches
MPI is recorded: its op and its datatypes. Nothing is asserted here.

    [PYTHONPATH=tests/standin ZMPI_BACKEND=cupy] mpiexec -n 3 python \
        tests/ranks/gpu_comm_checks.py native|no_float16
"""
import sys

import ml_dtypes
import numpy as np
from _report import report

from zmpi import backend
from zmpi.comm import MPI, Comm, wire

K = 64  # elements of each rank's buffer (a reduce-scatter sends the first K // n * n)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
REDUCTIONS = ("Allreduce", "Iallreduce", "Reduce_scatter_block", "Ireduce_scatter_block")


def inputs(n: int, dtype, size: int) -> np.ndarray:
    """(n, size) values of `dtype`, row r for rank r: +-(1 + j / 2^m), m the dtype's
    mantissa bits, so that any sum of n <= 4 of them is exact in float32 and its rounding to
    `dtype` depends on whether it is rounded once or after every pairwise step."""
    m = 7 if np.dtype(dtype) == DTYPES["bfloat16"] else 10
    rng = np.random.default_rng(0)
    values = (1 + rng.integers(0, 2**m, (n, size)) / 2**m) * rng.choice([-1.0, 1.0], (n, size))
    return values.astype(dtype)


class Recorder:
    """An mpi4py communicator that records the reductions made on it (op, datatypes)."""

    def __init__(self, mpi):
        self._mpi, self.calls = mpi, []

    def __getattr__(self, name):
        attr = getattr(self._mpi, name)
        if name not in REDUCTIONS:
            return attr

        def reduction(send, recv, op):
            types = ["IN_PLACE" if s is MPI.IN_PLACE else s[1].Get_name() for s in (send, recv)]
            self.calls.append([name, op.is_predefined, *types])
            return attr(send, recv, op)

        return reduction


def f64(a):
    return np.asarray(backend.to_host(a)).astype(np.float64).tolist()


def reductions(comm, x, memory: str) -> dict:
    """Every reduction path on this rank's row `x` (host), in `memory` ('host' | 'device')."""
    put = backend.xp.asarray if memory == "device" else np.copy
    n, out = comm.size, {}
    buf = put(x)
    out["allreduce_sum"] = f64(comm.allreduce(buf))
    buf = put(x)
    req = comm.iallreduce(buf)
    out["iallreduce_sum"] = f64(req.wait())
    out["result_is_buffer"] = req.result is buf
    out["allreduce_max"] = f64(comm.allreduce(put(x), op="max"))
    out["iallreduce_min"] = f64(comm.iallreduce(put(x), op="min").wait())
    block = x.size // n
    send, recv = put(x[:block * n]), put(np.zeros(block, x.dtype))
    out["reduce_scatter_sum"] = f64(comm.reduce_scatter(send, recv))
    recv2 = put(np.zeros(block, x.dtype))
    out["ireduce_scatter_sum"] = f64(comm.ireduce_scatter(send, recv2).wait())
    out["reduce_scatter_max"] = f64(comm.reduce_scatter(send, put(np.zeros(block, x.dtype)),
                                                        op="max"))
    # what one allreduce and one reduce-scatter of this buffer count, and what they stage
    comm.reset_counters()
    staged = dict(comm.staged_bytes)
    comm.allreduce(put(x))
    comm.reduce_scatter(send, put(np.zeros(block, x.dtype)))
    out["counters"] = {op: comm.counters_snapshot()[op] for op in ("allreduce",
                                                                    "reduce_scatter")}
    out["staged"] = {k: comm.staged_bytes[k] - staged[k] for k in staged}
    return out


def main():
    mode = sys.argv[1]
    if mode == "no_float16":
        wire._WIRES[DTYPES["float16"]] = wire._Wire(MPI.UINT16_T, True)
    comm = Comm()
    recorder = comm.mpi = Recorder(comm.mpi)
    n, r = comm.size, comm.rank
    out = {"backend": backend.name, "cuda_aware": comm.is_cuda_aware, "results": {}}
    for name, dtype in DTYPES.items():
        memories = ("host", "device") if backend.is_gpu and name == "float16" else ("host",)
        for memory in memories:
            out["results"][f"{name}/{memory}"] = reductions(comm, inputs(n, dtype, K)[r], memory)
    out["calls"] = recorder.calls
    report(out)


if __name__ == "__main__":
    main()

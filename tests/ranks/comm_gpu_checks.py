"""Rank side of tests/test_backend.py::test_gpu_collectives_on_two_ranks: collectives on CuPy
arrays (passed directly if MPI is CUDA-aware, staged through pinned host memory otherwise).

    ZMPI_BACKEND=cupy mpiexec -n 2 python tests/ranks/comm_gpu_checks.py
"""

import numpy as np
from _report import report

from zmpi import backend
from zmpi.comm import Comm

comm = Comm()
backend.select_device(comm.local_rank)
xp, r = backend.xp, comm.rank
out = {"is_cuda_aware": comm.is_cuda_aware}
out["allreduce"] = comm.allreduce(xp.full(5, r, xp.float16))
send = (r + xp.arange(2 * comm.size)).astype(xp.float32)  # recv[j] = sum_q (q + 2r + j)
out["reduce_scatter"] = comm.ireduce_scatter(send, xp.zeros(2, xp.float32)).wait()
out["allgather"] = comm.iallgather(xp.full(2, r, xp.float64), xp.zeros(4, xp.float64)).wait()
out["broadcast"] = comm.broadcast(xp.arange(3, dtype=xp.float32) * (r == 0), root=0)
report({k: backend.to_host(v).astype(np.float64).tolist() if hasattr(v, "dtype") else v
        for k, v in out.items()})

"""Rank side of tests/test_gpu_standin.py's Comm checks: collectives on device buffers of the
strict CuPy stand-in (copies on a side stream land only when waited for; until then their
destination holds NaN), staged through pinned host memory, and handed to a "CUDA-aware" MPI.

    PYTHONPATH=tests/standin ZMPI_BACKEND=cupy mpiexec -n N python tests/ranks/standin_comm.py

Reports what each check saw; the test asserts on it.
"""
import os

import cupy
import numpy as np
from _report import report
from ml_dtypes import bfloat16 as BF16

import zmpi.comm as zcomm
from zmpi.comm import Comm, wait_all

os.environ["ZMPI_CUDA_AWARE"] = "0"
comm = Comm()
n, r = comm.size, comm.rank
out = {}

# A staged non-blocking collective waits in the queue until its device -> host copy lands
# (the stand-in's event says "not yet" once), and the device result changes only at wait().
x = cupy.asarray(np.full(8, r + 1.0, np.float32))
req = comm.iallreduce(x)
out["queued_at_launch"] = not req.started
out["unchanged_before_wait"] = x.get().tolist() == [r + 1.0] * 8
out["allreduce"] = req.wait().get().tolist()

# Queued requests start in call order: waiting for the second starts the first before it.
a = cupy.asarray(np.full(4, 1.0, np.float32))
b = cupy.asarray(np.full(6, 2.0, np.float32))
ra, rb = comm.iallreduce(a), comm.iallreduce(b)
rb.wait()
out["first_started_by_second"] = ra.started
out["in_order"] = [ra.wait().get().tolist(), b.get().tolist()]

# A blocking collective starts what is queued before it.
c = cupy.asarray(np.ones(4, np.float32))
rc = comm.iallreduce(c)
out["scalar"] = comm.allreduce_scalar(1.0)
out["queued_started_by_blocking"] = rc.started
rc.wait()

# A request whose start fails never passes for completed: its wait() raises, every time.
f = cupy.asarray(np.ones(4, np.float32))
rf = comm.iallreduce(f)


def _refuse():
    raise OSError("injected")


rf._start_mpi = _refuse
errors = []
for _ in range(2):
    try:
        rf.wait()
    except (OSError, RuntimeError) as e:
        errors.append(type(e).__name__)
out["failed_start"] = errors
out["after_failure"] = comm.allreduce(cupy.asarray(np.ones(2, np.float32))).get().tolist()

# Every Comm on one communicator shares its queue: a collective through another Comm object
# starts what this one queued.
other = Comm()
rq = comm.iallreduce(cupy.asarray(np.ones(3, np.float32)))
other.barrier()
out["shared_queue"] = rq.started
rq.wait()

# reduce-scatter, allgather, in-place allgather of bf16 (2-byte words), broadcast
send = cupy.asarray(np.arange(2 * n, dtype=np.float32) * (r + 1))
recv = cupy.zeros(2, np.float32)
out["reduce_scatter"] = comm.reduce_scatter(send, recv).get().tolist()
g = cupy.zeros(2 * n, np.float32)
out["allgather"] = comm.allgather(cupy.asarray(np.full(2, float(r), np.float32)), g).get().tolist()
bf = np.zeros(3 * n, dtype=BF16)
bf[3 * r:3 * r + 3] = r + 0.5
out["bf16_allgather_inplace"] = comm.allgather_inplace(cupy.asarray(bf)).get().astype(
    np.float32).tolist()
out["broadcast"] = comm.broadcast(cupy.asarray(np.full(3, float(r), np.float32)), root=n - 1
                                  ).get().tolist()

# An in-place allgather stages only this rank's block to the host, and the whole buffer back.
before = dict(comm.staged_bytes)
comm.allgather_inplace(cupy.zeros(256 * n, np.float32))
out["inplace_allgather_staged"] = {k: comm.staged_bytes[k] - before[k] for k in before}

# Staging buffers are reused: the same shapes again take no new pinned memory; two requests
# of one shape in flight at once take two buffers.
pooled = zcomm.staging_nbytes()
for _ in range(3):
    comm.reduce_scatter(send, recv)
    comm.allreduce(recv)
out["no_new_staging"] = zcomm.staging_nbytes() == pooled
p, q = cupy.asarray(np.ones(8, np.float32)), cupy.asarray(np.full(8, 2, np.float32))
wait_all([comm.iallreduce(p), comm.iallreduce(q)])
out["two_in_flight"] = [p.get().tolist(), q.get().tolist()]

# CUDA-aware: device buffers go to MPI directly, bf16 reductions too (as float32).
os.environ["ZMPI_CUDA_AWARE"] = "1"
aware = Comm()
acquired = []
real_acquire = zcomm._POOL.acquire
zcomm._POOL.acquire = lambda *args: acquired.append(args) or real_acquire(*args)
out["aware_allreduce"] = aware.allreduce(cupy.asarray(np.ones(4, np.float32))).get().tolist()
out["aware_fp32_staged"] = len(acquired)
aware.allreduce(cupy.asarray(np.ones(4, dtype=BF16)))
out["aware_bf16_staged"] = len(acquired)
out["aware_staged_bytes"] = aware.staged_bytes
report(out)

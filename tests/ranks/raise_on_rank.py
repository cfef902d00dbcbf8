"""Rank 1 raises before a collective; the others enter it. Run by tests/test_comm.py to check
that Comm's abort-on-exception ends the job instead of leaving ranks 0 and 2 waiting.

    mpiexec -n 3 python tests/ranks/raise_on_rank.py    # exits non-zero within seconds
"""

import numpy as np

from zmpi.comm import Comm

comm = Comm()
if comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1 (zmpi abort test)")
comm.allreduce(np.ones(4, np.float32))
comm.barrier()
print("UNREACHABLE: collective completed without rank 1", flush=True)

"""Rank side of tests/test_nvme.py's abort check: `zmpi train` (this script's arguments) with
rank 1's swap file overwritten (80 KiB of random bytes at its start, the master's first
blocks) just before optimizer step 3, as a drive or another process might:

    mpiexec -n 2 python tests/ranks/nvme_tamper.py train --config nvme.json ...

Rank 1's read of the changed block fails its checksum in that step; its peers cannot know,
so the job is aborted (zmpi.comm.faults.fail_alone), and no rank's swap files may be left.
"""
import os

from zmpi.cli import main
from zmpi.comm import MPI
from zmpi.offload import nvme

step = nvme.NvmeOptimizerState.step


def tampered(self, optimizer, *args, **kwargs):
    if MPI.COMM_WORLD.Get_rank() == 1 and optimizer.step_count == 2:
        fd = os.open(self.file.path, os.O_WRONLY)
        os.pwrite(fd, os.urandom(80 * 1024), 0)
        os.fsync(fd)
        os.close(fd)
    return step(self, optimizer, *args, **kwargs)


nvme.NvmeOptimizerState.step = tampered
main()

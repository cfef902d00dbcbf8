"""Rank side of tests/test_checkpoint.py's crash test: rank 0 is killed (SIGKILL) in the
middle of a save, at its KILL_AT-th fsync of the save, after a first save completed.

    mpiexec -n 2 python tests/ranks/checkpoint_kill.py CKPT_DIR KILL_AT
"""
import os
import signal
import sys

from checkpoint_checks import build
from zero_checks import gpt_data

import zmpi.checkpoint.store as store
from zmpi.comm import Comm


def main():
    directory, kill_at = sys.argv[1], int(sys.argv[2])
    comm = Comm()
    engine = build("3/fp16", comm)
    data = gpt_data(comm, 1)
    for step in range(2):
        engine.train_step(*data.sample(step))
    engine.save_checkpoint(directory, client_state={"step": 2})  # complete: tag step2
    engine.train_step(*data.sample(2))
    calls = [0]
    fsync = os.fsync

    def dying_fsync(fd):
        calls[0] += 1
        if comm.rank == 0 and calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        fsync(fd)

    store.os.fsync = dying_fsync
    engine.save_checkpoint(directory, client_state={"step": 3})  # tag step3, killed midway
    print(f"rank {comm.rank}: the save finished after {calls[0]} fsyncs", flush=True)


if __name__ == "__main__":
    main()

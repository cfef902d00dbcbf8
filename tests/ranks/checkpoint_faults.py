"""Rank side of tests/test_checkpoint_safety.py: disk faults during a save and checkpoint
directories shared between runs, on every rank of one launch. Each case reports what every
rank saw (the error text or None) and the state of the directory afterwards.

    mpiexec -n 2 python tests/ranks/checkpoint_faults.py WORK_DIR

A full disk is simulated with a file-size limit on rank 1 (RLIMIT_FSIZE, SIGXFSZ ignored):
its shard write fails with EFBIG, as a write to a full disk fails with ENOSPC.
"""
import resource
import signal
import sys
from pathlib import Path

from _report import report
from checkpoint_checks import build
from zero_checks import gpt_data

from zmpi.checkpoint import CheckpointError
from zmpi.comm import Comm


def outcome(fn):
    try:
        fn()
        return None
    except CheckpointError as e:
        return str(e)


def listing(directory: Path):
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else None


def file_size_limit(comm, limit):
    """Rank 1 may write files of at most `limit` bytes (None: no limit)."""
    if comm.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit or resource.RLIM_INFINITY,
                                                   resource.RLIM_INFINITY))


def main():
    work = Path(sys.argv[1])
    comm = Comm()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    out = {}
    data = gpt_data(comm, 1)
    engine = build("3/fp16", comm)
    a = work / "a"
    engine.train_step(*data.sample(0))
    engine.save_checkpoint(a, client_state={"step": 1})

    # a shard write fails on rank 1 (synchronous, then asynchronous)
    engine.train_step(*data.sample(1))
    file_size_limit(comm, 64 << 10)
    out["sync_disk_full"] = outcome(lambda: engine.save_checkpoint(a, client_state={"step": 2}))
    out["sync_after"] = listing(a)

    def async_save():
        engine.save_checkpoint(a, client_state={"step": 2}, async_=True)
        for step in range(2, 6):  # finished at a train_step once every writer is done
            engine.train_step(*data.sample(step))
        engine.close()

    out["async_disk_full"] = outcome(async_save)
    out["async_after"] = listing(a)
    out["latest"] = (a / "latest").read_text().strip()
    file_size_limit(comm, None)
    out["save_after_fault"] = outcome(lambda: engine.save_checkpoint(a, tag="recovered"))

    # a second engine (another run) in the same directory: in use while the first holds it
    other = build("3/fp16", comm)
    out["in_use"] = outcome(lambda: other.save_checkpoint(a))
    engine.close()  # releases the directory
    out["other_run"] = outcome(lambda: other.save_checkpoint(a))
    out["other_run_after"] = listing(a)
    # start over: the first run's checkpoints go once the new run's first one is complete
    other.close()
    fresh = build("3/fp16", comm)
    out["overwrite_claim"] = outcome(lambda: fresh.claim_checkpoint_dir(a, overwrite=True))
    out["overwrite_before_save"] = listing(a)
    fresh.train_step(*data.sample(0))
    out["overwrite_save"] = outcome(lambda: fresh.save_checkpoint(a, keep_last=1))
    out["overwrite_after"] = listing(a)
    fresh.close()

    # retention counts only the run's own checkpoints: run B resumes run A's checkpoint in
    # another directory holding only A's checkpoints, so it continues run A there
    b = work / "b"
    first = build("3/fp16", comm)
    for step in range(3):
        first.train_step(*data.sample(step))
        first.save_checkpoint(b)
    first.close()
    resumed = build("3/fp16", comm)
    resumed.load_checkpoint(b)
    out["same_run"] = resumed.run_id == first.run_id
    resumed.train_step(*data.sample(3))
    out["resumed_save"] = outcome(lambda: resumed.save_checkpoint(b, keep_last=2))
    out["resumed_after"] = listing(b)
    resumed.close()
    report(out)


if __name__ == "__main__":
    main()

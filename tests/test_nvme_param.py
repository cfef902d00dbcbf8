"""Stage 3's parameter shards on NVMe (`offload_param.device: "nvme"`, zmpi.offload.nvme_param)
in one process: the store against the array it stands for (reads, writes from an array and
from the optimizer tier's handle, gathers through a pool smaller than the prefetch), and every
failure: the buffer size, the space, a failed write (blocks until a checkpoint restores), a
failed read (the step raises, the next one trains on), qwZ. The multi-rank bit equality with
CPU offload, the ledger and the checkpoints are in tests/test_nvme.py's launch.
"""
import errno
import os
import warnings

import numpy as np
import pytest

from zmpi.comm import Comm
from zmpi.config import ConfigError, OffloadConfig, OffloadParamConfig
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import MemoryLedger
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.offload import NVMeError, NvmeOptimizerState, aio, files
from zmpi.offload.nvme_param import NvmeParamShard

SLICES = [(0, 100), (100, 3000), (3000, 3001), (3001, 5000)]  # ragged, one unit of 1 element


def test_store_reads_writes_and_gathers_like_the_array(tmp_path):
    ledger, rng = MemoryLedger(), np.random.default_rng(0)
    cfg = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_size=4096,
                             buffer_count=2, max_in_cpu=100)  # unit 0 stays in host memory
    store = NvmeParamShard(SLICES, np.float16, cfg, None, ledger)
    values = rng.standard_normal(5000).astype(np.float32)
    store.handle[...] = values
    want = values.astype(np.float16)
    assert np.array_equal(np.asarray(store.handle), want)
    assert np.array_equal(store.handle[50:3500], want[50:3500])  # across units and tiers
    comm, outs = Comm(), {}
    requests = {u: store.iallgather(u, outs.setdefault(u, np.empty(b - a, np.float16)), comm)
                for u, (a, b) in enumerate(SLICES)}  # 3 units on file, a pool of 2
    for u in (3, 0, 2, 1):  # waited out of order: started in order all the same
        requests[u].wait()
    for u, (a, b) in enumerate(SLICES):
        assert np.array_equal(outs[u], want[a:b]), u
    # the master on the optimizer tier's file, scanned block by block into the units
    opt = NvmeOptimizerState(5000, np.float32, OffloadConfig(
        device="nvme", nvme_path=str(tmp_path), buffer_size=1024), None, ledger)
    opt.master[...] = values[::-1].copy()
    store.handle[...] = opt.master
    assert np.array_equal(np.asarray(store.handle), values[::-1].astype(np.float16))
    assert ledger.current("param", "host") == store.host_bytes()["param"] \
        == (100 + 2 * 4096 // 2 * 2) * 2  # unit 0, and two buffers of the largest extent
    opt.close()
    store.close()
    assert ledger.current(device="host") == 0 and os.listdir(tmp_path) == []
    with pytest.raises(NVMeError, match="closed"):
        store.handle[0:1]


def test_a_changed_shard_file_is_an_error(tmp_path):
    """Issue 49: the parameter shard's file is checked as the optimizer tier's is (CRC32 of
    each unit's extent, written and read whole): a changed byte fails the read or gather of
    its unit, naming it; the other units read."""
    cfg = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_size=4096,
                             buffer_count=2, max_in_cpu=0)
    store = NvmeParamShard(SLICES, np.float16, cfg, None, MemoryLedger())
    values = np.arange(5000).astype(np.float16)
    store.handle[...] = values
    fd = os.open(store.file.path, os.O_WRONLY)
    os.pwrite(fd, b"\x01", store._offset(3) + 10)
    os.fsync(fd)
    os.close(fd)
    with pytest.raises(NVMeError, match=r"reading params: read of the parameter shard of unit "
                                        r"3 \(elements \[3001, 5000\)\) at byte \d+ of "
                                        r".*params\.bin failed: checksum mismatch"):
        store.handle[4000:4001]
    assert np.array_equal(store.handle[0:3001], values[:3001])
    out = np.empty(1999, np.float16)
    with pytest.raises(NVMeError, match="gathering unit 3: .* checksum mismatch"):
        store.iallgather(3, out, Comm()).wait()
    store.close()


SMALL = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _engine(path, **param):
    offload_param = {"device": "cpu"} if path is None else {
        "device": "nvme", "nvme_path": str(path), "buffer_size": 4096, "buffer_count": 2,
        "max_in_cpu": 0, **param}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(GPT(SMALL, seed=0), {
            "train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": offload_param}})


def _batches():
    return SyntheticSource(16, 8, 4, seed=1)


def _equal(a, b):
    want, got = a.gather_parameters(), b.gather_parameters()
    return all(np.array_equal(want[k], got[k]) for k in want)


def test_config_and_space_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_size: 1024 elements cannot "
                                          r"hold the largest unit's shard \(3280 elements\)"):
        _engine(tmp_path, buffer_size=1024)
    with warnings.catch_warnings(), pytest.raises(
            ConfigError, match=r"zero_quantized_weights: qwZ .* \"nvme\" reads from a file"):
        warnings.simplefilter("ignore")
        Engine(GPT(SMALL, seed=0), {
            "train_micro_batch_size_per_gpu": 4, "zero_optimization": {
                "stage": 3, "zero_quantized_weights": True, "offload_param": {
                    "device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0}}})
    assert os.listdir(tmp_path) == []  # the refused run's file is gone

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(files.os, "statvfs", lambda p: Tiny)
    with pytest.raises(NVMeError, match=r"MiB free, the parameter shards of this rank needs "
                                        r".* MiB \(this node's ranks .* together\)"):
        _engine(tmp_path)
    monkeypatch.undo()
    engine = _engine(tmp_path, max_in_cpu=10**9)  # every unit in host memory: no file
    assert engine.strategy.param_store.file is None and os.listdir(tmp_path) == []
    engine.close()


def test_failed_write_raises_and_blocks_until_a_checkpoint_restores(tmp_path, monkeypatch):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    data, reference = _batches(), _engine(None)
    for step in range(4):
        reference.train_step(*data.sample(step))
    engine = _engine(swap)
    for step in range(2):
        engine.train_step(*data.sample(step))
    engine.save_checkpoint(ckpt, tag="two")
    real, calls = aio._pwrite, []

    def failing(fd, view, offset):
        calls.append(offset)
        if len(calls) == 2:  # the second unit of the publish: the first is new already
            raise OSError(errno.EIO, "Input/output error")
        real(fd, view, offset)

    monkeypatch.setattr(aio, "_pwrite", failing)
    with pytest.raises(NVMeError, match=r"writing params: write of the parameter shard of unit "
                                        r"\d .* of .*params\.bin failed: Input/output error"):
        engine.train_step(*data.sample(2))
    monkeypatch.undo()
    broken = "parameter shard in .* is inconsistent since writing the parameter shard failed"
    with pytest.raises(NVMeError, match=broken):
        engine.train_step(*data.sample(2))
    engine.load_checkpoint(ckpt, tag="two")  # writes the shard whole again
    for step in (2, 3):
        engine.train_step(*data.sample(step))
    assert _equal(reference, engine)
    engine.close()
    assert os.listdir(swap) == []


def test_failed_read_fails_the_step_and_the_next_trains_on(tmp_path, monkeypatch):
    data, reference, engine = _batches(), _engine(None), _engine(tmp_path)
    for step in range(2):
        reference.train_step(*data.sample(step))
    engine.train_step(*data.sample(0))
    real, calls = aio._pread, []

    def failing(fd, view, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        real(fd, view, offset)

    monkeypatch.setattr(aio, "_pread", failing)
    with pytest.raises(NVMeError, match=r"gathering unit \d: read of the parameter shard"):
        engine.train_step(*data.sample(1))
    monkeypatch.undo()
    engine.train_step(*data.sample(1))  # the file is whole: the step runs again
    assert _equal(reference, engine)
    assert engine.memory.current("param", "host") == engine.strategy.param_store.host_bytes()[
        "param"]
    engine.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.mpi
def test_bench_at_a_tiny_size(tmp_path):
    import subprocess
    import sys

    from mpi_util import REPO_ROOT

    out = tmp_path / "nvme_param"
    subprocess.run([sys.executable, REPO_ROOT / "experiments" / "bench_nvme_param.py", "--out",
                    out, "--n-layer", "1", "--d-model", "32", "--steps", "2"], check=True,
                   cwd=REPO_ROOT, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'experiments'}"})
    table = (out / "table.md").read_text()
    assert "| nvme | " in table and table.count("| yes |") == 2  # CPU offload's bits
    assert (out / "run.json").is_file()


@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetched_units_are_read_ahead(tmp_path, prefetch):
    engine = _engine(tmp_path)
    if not prefetch:
        engine.strategy._ahead = {step: [[] for _ in ahead] for step, ahead in
                                  engine.strategy._ahead.items()}
    store, log = engine.strategy.param_store, []
    read, finish = store.io.read, store._finish

    def reading(*args):
        log.append("read")
        return read(*args)

    def finishing(items, what):
        if what.startswith("gathering"):  # how many reads were out when this one was needed
            log.append(log.count("read") - sum(isinstance(x, int) for x in log) - 1)
        return finish(items, what)

    store.io.read, store._finish = reading, finishing
    engine.train_step(*_batches().sample(0))
    ahead = [x for x in log if isinstance(x, int)]
    assert len(ahead) >= 2 * len(store.slices)  # each unit in forward and backward (and the
                                                # embedding again for the tied LM head)
    assert (max(ahead) >= 1) == prefetch, ahead  # the next unit's read already out
    engine.close()


def test_a_failed_read_keeps_its_allgather_first(tmp_path, monkeypatch):
    """A unit whose read failed stays first in line: asking again raises again, and the
    allgathers of the units queued behind it never start before it (every other rank would
    be waiting in its allgather, and would match another unit's against it)."""
    cfg = OffloadParamConfig(device="nvme", nvme_path=str(tmp_path), buffer_size=4096,
                             buffer_count=3, max_in_cpu=0)
    store = NvmeParamShard(SLICES, np.float16, cfg, None, MemoryLedger())
    store.handle[...] = np.arange(5000, dtype=np.float32)
    real, started = aio._pread, []

    def failing(fd, view, offset):
        if offset == 0:  # unit 0's shard
            raise OSError(errno.EIO, "Input/output error")
        real(fd, view, offset)

    class Counting(Comm):
        def iallgather(self, send, recv):
            started.append(len(recv))
            return super().iallgather(send, recv)

    monkeypatch.setattr(aio, "_pread", failing)
    comm = Counting()
    gathers = [store.iallgather(u, np.empty(b - a, np.float16), comm)
               for u, (a, b) in enumerate(SLICES[:3])]
    for g in (gathers[1], gathers[0], gathers[1]):
        with pytest.raises(NVMeError, match="read of the parameter shard of unit 0"):
            g.wait()
    assert started == []  # neither unit 1's nor unit 2's allgather went ahead of unit 0's
    store.close()

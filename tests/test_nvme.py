"""ZeRO-Infinity's NVMe tier: the optimizer state in a file changes where it lives, never
what training computes, and host memory stays the buffers.

Under MPI (one `mpiexec -n N` launch per world size, tests/ranks/nvme_checks.py): stages 1-3,
fp32 and fp16 (an overflow step, accumulation, clipping), with read-ahead and write-behind, without,
and with part of the state kept in host memory (`max_in_cpu`): parameters, master weights,
Adam moments and losses equal CPU offload's bit for bit; the ledger's host bytes of the
optimizer state, now and at peak, are the buffers; checkpoints go from NVMe to CPU offload
and back exactly; the files are removed by close(). The same for stage 3's parameter shards on NVMe
(`offload_param.device: "nvme"`, zmpi.offload.nvme_param), with the optimizer on the host and
on NVMe. In one process: NvmeOptimizerState against HostAdam, the handles, and every failure
(the path, the space, a failed write), of both tiers.
"""
import contextlib
import errno
import gc
import io
import json
import os
import re
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
from mpi_util import RANKS_DIR, launch_mpi, run_mpi

from zmpi.checkpoint import CheckpointError
from zmpi.config import AioConfig, Config, ConfigError, OffloadConfig
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.memory import MemoryLedger
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.offload import NVMeError, NvmeOptimizerState, aio, files
from zmpi.optim.adam import HostAdam

sys.path.insert(0, str(RANKS_DIR))

WORLD_SIZES = (2, 3)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"n{n}")
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"nvme_n{request.param}")
    return request.param, run_mpi(RANKS_DIR / "nvme_checks.py", request.param, args=[out],
                                  timeout=400)


@pytest.mark.mpi
def test_nvme_is_bit_identical_to_cpu_offload(run):
    n, reports = run
    for r in reports:
        base = {(e["stage"], e["dtype"]): e for e in r["equality"] if e["variant"] == "cpu"}
        checked = 0
        for e in r["equality"]:
            want = base[(e["stage"], e["dtype"])]
            where = f"n={n} rank {r['rank']} stage {e['stage']} {e['dtype']} {e['variant']}"
            for key in ("params", "optimizer_state", "losses", "skipped"):
                assert e[key] == want[key], f"{where}: {key} differs from CPU offload"
            assert e["skipped"] == (1 if e["dtype"] == "fp16" else 0), where
            checked += e["variant"] != "cpu"
        assert checked == 2 * (3 + 1 + 1 + 4)
        assert all(e["direct"] for e in r["equality"]  # ext4 here
                   if e["variant"] not in ("cpu", "param_cpu", "param_nvme"))
        assert all(e["param_host"]["direct"] for e in r["equality"]
                   if e["variant"].startswith("param_nvme"))


@pytest.mark.mpi
def test_host_holds_the_buffers_not_the_state(run):
    n, reports = run
    for r in reports:
        for e in r["equality"]:
            where = f"n={n} rank {r['rank']} stage {e['stage']} {e['dtype']} {e['variant']}"
            assert e["host"] == e["declared_host"], where  # the ledger equals the declaration
            assert e["host_peak"] == e["host"], where  # and never held more during the steps
            state = e["state_bytes"]
            if e["variant"].startswith("param"):
                continue  # test_host_holds_the_parameter_buffers_not_the_shard
            if e["variant"] == "cpu":
                assert e["host"]["master"] == state, where
            elif e["variant"] == "nvme":  # 2 slots x 1024 fp32 elements per state
                assert e["host"] == dict.fromkeys(("master", "adam_m", "adam_v"), 2 * 4096)
                assert 2 * 4096 < state, where  # the state is larger than its buffers
            elif e["variant"] == "nvme_sync":
                assert e["host"]["master"] == 4096, where  # one slot
            else:  # 1500 elements kept in host memory, and a slot per block up to two
                blocks = -(-(state // 4 - 1500) // 1024)
                assert e["host"]["master"] == 4 * (1500 + min(2, blocks) * 1024), where


@pytest.mark.mpi
def test_host_holds_the_parameter_buffers_not_the_shard(run):
    n, reports = run
    for r in reports:
        for e in r["equality"]:
            where = f"n={n} rank {r['rank']} {e['dtype']} {e['variant']}"
            p = e["param_host"]
            assert p["host"] == p["declared"] == p["peak"], where  # never more in the steps
            if e["variant"] in ("cpu", "nvme", "nvme_max_in_cpu", "param_cpu"):
                if e["stage"] == 3 and e["variant"] == "param_cpu":
                    assert p["host"] == p["shard_bytes"], where  # the whole shard
                continue
            if not e["variant"].startswith("param_nvme"):
                continue
            buffers, block, resident = p["pool"]
            assert p["host"] == (buffers * block + resident) * p["itemsize"], where
            assert block >= 4096 // p["itemsize"] and block % (4096 // p["itemsize"]) == 0
            if e["variant"] == "param_nvme_max_in_cpu":
                assert 0 < resident <= 400 and buffers == 3, where  # units on file: 3
            else:
                assert resident == 0 and buffers == 2, where  # the pool, whatever the shard


@pytest.mark.mpi
def test_checkpoints_cross_between_nvme_and_cpu_offload_exactly(run):
    n, reports = run
    for r in reports:
        assert [(c["stage"], c["from"], c["to"]) for c in r["checkpoints"]] == [
            (2, "nvme", "cpu"), (3, "cpu", "nvme"), (3, "nvme_param", "cpu"),
            (3, "cpu", "nvme_param")]
        for c in r["checkpoints"]:
            assert c["params_equal"] and c["optimizer_equal"], (n, r["rank"], c)


@pytest.mark.mpi
def test_files_are_removed_on_close(run):
    _, reports = run
    for r in reports:
        assert r["files"] == {"alive": True, "removed": True}
        assert r["left"] == []


# ---- one process: the state against HostAdam --------------------------------------------

def _offload(path, **kw):
    return OffloadConfig(**{"device": "nvme", "nvme_path": str(path), "buffer_size": 1024,
                            "buffer_count": 6, **kw})


@pytest.mark.parametrize("kw, aio_kw", [
    ({}, {}),
    ({"max_in_cpu": 3000}, {"thread_count": 3, "queue_depth": 2, "block_size": 4096}),
    ({"pipeline_read": False, "pipeline_write": False, "buffer_count": 4}, {}),
    ({"buffer_count": 12, "buffer_size": 2048}, {"block_size": 8192}),
    ({"max_in_cpu": 10**9}, {}),  # everything in host memory: no file at all
], ids=["default", "max_in_cpu", "no_pipeline", "wide", "all_in_cpu"])
def test_state_steps_like_host_adam(tmp_path, kw, aio_kw):
    n = 10_001  # not a multiple of the 4 KiB alignment: a ragged last block
    rng = np.random.default_rng(0)
    ledger = MemoryLedger()
    state = NvmeOptimizerState(n, np.float32, _offload(tmp_path, **kw), AioConfig(**aio_kw),
                               ledger)
    init = rng.standard_normal(n).astype(np.float32)
    state.master[...] = init
    p, m, v = init.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    ref, opt = HostAdam(lr=1e-2, weight_decay=0.1), HostAdam(lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        grads = rng.standard_normal(n).astype(np.float16)
        want, got = np.zeros(n, np.float16), np.zeros(n, np.float16)
        ref.step_(p, grads, m, v, 0.5, 0.9, publish=[(0, want)])
        state.step(opt, grads, 0.5, 0.9, publish=[(0, got[:4000]), (4000, got[4000:])])
        assert np.array_equal(want, got)  # the parameters, published block by block
    for a, b in zip((p, m, v), state.states, strict=True):
        assert np.array_equal(a, np.asarray(b)), b.name
    assert np.array_equal(state.adam_m[2999:7001], m[2999:7001])  # across blocks and tiers
    assert opt.step_count == ref.step_count == 3
    held = state.host_bytes()
    assert {c: ledger.current(c, "host") for c in held} == held
    state.close()
    assert ledger.current(device="host") == 0 and os.listdir(tmp_path) == []


def test_without_direct_io_the_file_is_buffered_and_synced(tmp_path, monkeypatch):
    real_open, synced = os.open, []

    def no_direct(path, flags, *mode):  # as on tmpfs
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *mode)

    monkeypatch.setattr(files.os, "open", no_direct)
    monkeypatch.setattr(files, "sync_and_drop", lambda *a: synced.append(a))
    state = NvmeOptimizerState(5000, np.float32, _offload(tmp_path), None, MemoryLedger())
    assert not state.direct
    values = np.arange(5000, dtype=np.float32)
    state.adam_v[...] = values
    assert np.array_equal(np.asarray(state.adam_v), values)
    assert len(synced) == 5  # each write request: 5 blocks of 1024 elements
    state.close()


def test_a_changed_or_cut_swap_file_is_an_error(tmp_path):
    """Issue 49: 80 KB overwritten in a swap file mid-run were trained on silently (the loss
    went from 2.70 back to 4.17, exit 0). Every block written records its CRC32 and every
    read checks it, so a changed byte is an NVMeError naming the block, as a file cut short
    is. Blocks of 4096 elements are written as 4 requests of 1024 (`aio.block_size`), each
    with its CRC; a slice reads the requests that hold it, whole, so it is checked too."""
    state = NvmeOptimizerState(5000, np.float32, _offload(tmp_path, buffer_size=4096), AioConfig(
        block_size=4096), MemoryLedger())
    values = np.arange(5000, dtype=np.float32)
    for s in state.states:
        s[...] = values
    assert np.array_equal(state.adam_m[1500:1600], values[1500:1600])
    fd = os.open(state.file.path, os.O_WRONLY)
    os.pwrite(fd, b"\x01", state.region * 4 + 5000)  # adam_m's element 1250: 2nd request
    os.fsync(fd)
    os.close(fd)
    assert np.array_equal(state.adam_m[0:1000], values[0:1000])  # the 1st request only
    with pytest.raises(NVMeError, match=r"reading adam_m: read of adam_m elements \[1024, "
                                        r"2048\) at byte 24576 of .*optimizer\.bin failed: "
                                        r"checksum mismatch at byte 24576: CRC32 "):
        state.adam_m[1500:1600]
    assert np.array_equal(state.master[1000:1100], values[1000:1100])  # the others read
    state.adam_m[...] = values  # written whole again: sound
    assert np.array_equal(np.asarray(state.adam_m), values)
    os.truncate(state.file.path, state.region * 4 * 2 + 8192)
    with pytest.raises(NVMeError, match=r"reading adam_v: read of adam_v elements \[0, "
                                        r"4096\) .* unexpected end of file at byte 49152"):
        np.asarray(state.adam_v)
    state.close()
    assert os.listdir(tmp_path) == []


def test_a_dead_runs_swap_directory_is_removed_at_start(tmp_path):
    """Issue 49: a run killed with SIGKILL (or aborted: MPI_Abort skips close and atexit)
    left its swap files, and the next run's reservation then failed with ENOSPC. A swap
    directory is locked while its process lives; the next SwapFile on the drive removes the
    unlocked ones and says so, and leaves a live one alone. On a 1 MiB tmpfs (skipped where
    this process cannot mount one), two 600 KiB files fit only once the dead one is gone."""
    drive = tmp_path / "drive"
    drive.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(drive)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        child = subprocess.Popen([sys.executable, "-c", (
            "import sys, time; from zmpi.offload.files import SwapFile; "
            f"f = SwapFile({str(drive)!r}, 600 * 1024, 600 * 1024); "
            "print(f.dir, flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
        dead = child.stdout.readline().strip()
        child.kill()
        child.wait()
        assert os.path.exists(f"{dead}/optimizer.bin")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            live = files.SwapFile(drive, 600 * 1024, 600 * 1024)
        assert re.fullmatch(
            rf"zmpi: removed {re.escape(dead)}, the swap directory of a run that ended without "
            rf"removing it \(pid {child.pid} on {re.escape(socket.gethostname())}, since "
            r"[0-9T:-]+; 0\.6 MiB\)\n", err.getvalue()), err.getvalue()
        assert not os.path.exists(dead)
        assert files.remove_dead(drive) == [] and os.path.exists(live.path)  # held: alive
        live.close()
        assert os.listdir(drive) == []
    finally:
        subprocess.run(["umount", str(drive)], check=True)


@pytest.mark.mpi
def test_a_changed_swap_file_ends_the_job_in_one_line_leaving_no_files(tmp_path):
    """Issue 49: a swap file changed mid-run is caught by its checksum on the rank that reads
    it; the others cannot know, so the job is aborted with one line from that rank, and the
    abort removes every rank's swap directory (MPI_Abort skips close() and atexit: each rank
    removes its own first, the aborting rank what its killed peers on the host left)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    config = tmp_path / "nvme.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(swap), "buffer_size": 1024, "buffer_count": 6}}}))
    result = launch_mpi(RANKS_DIR / "nvme_tamper.py", 2, timeout=120, args=[
        "train", "--config", config, "--steps", 6, "--n-layer", 1, "--d-model", 32,
        "--seq-len", 16, "--batch", 4, "--sample-tokens", 0, "--out", tmp_path / "run"])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.describe()
    said = [line for line in result.ranks_stderr() if "zmpi" in line]
    assert len(said) == 1 and re.fullmatch(
        r"\[rank 1\] zmpi train: optimizer step 3: read of master elements \[0, 1024\) at "
        r"byte 0 of .*/zmpi-nvme-\w+/optimizer\.bin failed: checksum mismatch at byte 0: "
        r"CRC32 \w+ of 4096 bytes, written as \w+ of 4096 \(the file was changed behind "
        r"zmpi's back\); aborting the MPI job", said[0]), result.describe()
    assert os.listdir(swap) == []


def test_handles_refuse_what_would_change_a_copy(tmp_path):
    state = NvmeOptimizerState(5000, np.float32, _offload(tmp_path), None, MemoryLedger())
    part = state.master[10:20]
    with pytest.raises(ValueError, match="read-only"):
        part += 1  # an in-place update of what was read
    with pytest.raises(TypeError, match="contiguous slices"):
        state.master[::2]
    with pytest.raises(TypeError, match="only the whole state"):
        state.master[3:5] = 1.0
    assert state.master.shape == (5000,) and "optimizer.bin" in repr(state.master)
    state.close()
    with pytest.raises(NVMeError, match="closed"):
        state.master[0:1]


# ---- one process: failures ------------------------------------------------------------------

SMALL = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _engine(path, device="nvme", stage=2):
    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=str(path), buffer_size=1024, buffer_count=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(GPT(SMALL, seed=0), {
            "train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "offload_optimizer": offload}})


def _batches():
    return SyntheticSource(16, 8, 4, seed=1)


@pytest.mark.parametrize("offload, match", [
    ({"device": "nvme"}, r"offload_optimizer\.nvme_path: required"),
    ({"device": "nvme", "nvme_path": "/x", "buffer_count": 2}, r"buffer_count: must be >= 3"),
    ({"device": "nvme", "nvme_path": "/x", "buffer_size": 100}, r"buffer_size: must be >= 1024"),
    ({"device": "nvme", "nvme_path": "/x", "delay_update": True},
     r"delay_update: is not implemented with \"device\": \"nvme\""),
])
def test_config_errors(offload, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": offload}})
    with pytest.raises(ConfigError, match=r"offload_param\.nvme_path: required"):
        Config.from_dict({"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme"}}})
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_count: must be >= 1"):
        Config.from_dict({"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": "/x", "buffer_count": 0}}})
    with pytest.raises(ConfigError, match=r"aio\.block_size: must be a positive multiple"):
        Config.from_dict({"aio": {"block_size": 1000}})
    with pytest.raises(ConfigError, match=r"aio\.single_submit: zmpi always"):
        Config.from_dict({"aio": {"single_submit": True}})


def test_nvme_keys_with_another_device_are_noted():
    c = Config.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "nvme_path": "/x", "pipeline_read": True}}})
    assert c.notes() == [
        "zero_optimization.offload_optimizer.nvme_path: accepted without effect (the device is "
        "'cpu', not 'nvme')",
        "zero_optimization.offload_optimizer.pipeline_read: accepted without effect (the device "
        "is 'cpu', not 'nvme')"]


def test_buffers_without_effect_are_noted():
    def notes(count):
        return Config.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/x", "buffer_count": count}}}).notes()
    assert notes(6) == [] and notes(9) == []
    assert notes(7) == ["zero_optimization.offload_optimizer.buffer_count: the last 1 of 7 "
                        "buffers unused (a block takes three: master, m and v)"]
    four = notes(4)  # DeepSpeed's default: one block, so nothing overlaps Adam
    assert len(four) == 2 and "pipeline_read, pipeline_write: no effect" in four[1]


def test_bad_paths_are_clear_errors(tmp_path, monkeypatch):
    afile = tmp_path / "file"
    afile.write_text("")
    for path in (tmp_path / "missing", afile):
        with pytest.raises(NVMeError, match=f"nvme_path {path}: not a directory"):
            _engine(path)
    # root may write anywhere: the permission checks are shown by what they see
    if os.path.isdir("/proc"):  # root passes the permission check; making a directory fails
        with pytest.raises(NVMeError, match="nvme_path /proc: (cannot create a directory|not "
                                            "writable)"):
            _engine("/proc")
    monkeypatch.setattr(files.os, "access", lambda path, mode: False)
    with pytest.raises(NVMeError, match="not writable by this process"):
        _engine(tmp_path)
    monkeypatch.undo()

    def refused(**kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.tempfile, "mkdtemp", refused)
    with pytest.raises(NVMeError, match="cannot create a directory: Permission denied"):
        _engine(tmp_path)


def test_too_little_space_fails_at_start(tmp_path, monkeypatch):
    real = os.statvfs

    class Tiny:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(files.os, "statvfs", lambda p: Tiny if str(p) == str(tmp_path)
                        else real(p))
    with pytest.raises(NVMeError, match=r"0\.0 MiB free, the optimizer state of this rank "
                                        r"needs .* MiB \(this node's ranks .* together\)"):
        _engine(tmp_path)
    monkeypatch.undo()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "posix_fallocate", full)  # the reservation itself fails
    with pytest.raises(NVMeError, match="cannot reserve .* No space left on device"):
        _engine(tmp_path)
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_failed_write_raises_and_blocks_until_a_checkpoint_restores(tmp_path, monkeypatch):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    data = _batches()
    reference = _engine(None, device="cpu")
    for step in range(4):
        reference.train_step(*data.sample(step))
    engine = _engine(swap)
    for step in range(2):
        engine.train_step(*data.sample(step))
    engine.save_checkpoint(ckpt, tag="two")
    real, calls = aio._pwrite, []

    def failing(fd, view, offset):
        calls.append(offset)
        if len(calls) == 3:  # a block into the step: part of the state is new already
            raise OSError(errno.EIO, "Input/output error")
        real(fd, view, offset)

    monkeypatch.setattr(aio, "_pwrite", failing)
    with pytest.raises(NVMeError, match=r"optimizer step 3: write of .* elements \[.*\) at byte "
                                        r".* of .*optimizer\.bin failed: Input/output error"):
        engine.train_step(*data.sample(2))
    monkeypatch.undo()
    broken = "inconsistent since optimizer step 3 failed .*: load a checkpoint"
    with pytest.raises(NVMeError, match=broken):
        engine.train_step(*data.sample(2))
    with pytest.raises(CheckpointError, match=broken):  # a save would keep the torn state
        engine.save_checkpoint(ckpt, tag="broken")
    assert (ckpt / "latest").read_text().strip() == "two"
    engine.load_checkpoint(ckpt, tag="two")  # writes all three states whole again
    for step in (2, 3):
        engine.train_step(*data.sample(step))
    want, got = reference.gather_parameters(), engine.gather_parameters()
    assert all(np.array_equal(want[k], got[k]) for k in want)
    engine.close()
    assert os.listdir(swap) == []


def test_files_are_removed_when_the_engine_is_dropped(tmp_path):
    engine = _engine(tmp_path)
    engine.train_step(*_batches().sample(0))
    assert len(os.listdir(tmp_path)) == 1
    del engine
    gc.collect()
    assert os.listdir(tmp_path) == []


@pytest.mark.mpi
def test_bench_at_a_tiny_size(tmp_path):
    import subprocess

    from mpi_util import REPO_ROOT

    out = tmp_path / "nvme"
    subprocess.run([sys.executable, REPO_ROOT / "experiments" / "bench_nvme.py", "--out", out,
                    "--n-layer", "1", "--d-model", "32", "--steps", "2",
                    "--stream-elements", "300000"], check=True, cwd=REPO_ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'experiments'}"},
                   capture_output=True)
    table = (out / "table.md").read_text()
    assert "| nvme | " in table and table.count("| yes |") == 2  # CPU offload's bits
    assert "threads, queue_depth" in table and (out / "run.json").is_file()

"""Two hosts x two ranks (tests/twohost.py: network, UTS, IPC and PID namespaces on this
machine, as root; skipped, saying why, elsewhere): training across nodes, rank placement,
NVMe offload ended by a killed rank and by Ctrl-C, a checkpoint directory the nodes do not
share, and a setting that differs between the nodes (issue 56). Few launches, each with a
hard timeout: they run in `make test`."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import pytest
from mpi_util import CLI, RANKS_DIR, finish_mpi, parse_reports, run_mpi
from twohost import TwoHosts

pytestmark = pytest.mark.mpi

# a small zmpi train; with NVMe offload of the optimizer state (the swap files) where asked
TRAIN = ["train", "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8",
         "--batch", "4", "--sample-tokens", "0"]
TIMEOUT = 60  # seconds: every launch's hard limit (each takes a few)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two hosts for the module's tests; removed at its end, however the tests ended."""
    with TwoHosts(tmp_path_factory.mktemp("twohost")) as made:
        yield made


def _reports(proc, report_dir) -> list[dict]:
    result = finish_mpi(proc, TIMEOUT)
    assert result.returncode == 0, result.describe()
    return parse_reports(result.stdout, report_dir)


def test_training_across_two_hosts_placed_round_robin(hosts, tmp_path):
    """Ranks dealt to the hosts round-robin (rank 0 and 2 on one host, 1 and 3 on the other):
    stage 3 and tensor 2 x data 2 give one host's losses (float64, to 1e-12: MPI may sum in
    another order across nodes; they were equal bit for bit here); hybrid sharding's shard
    groups (by default a node's ranks) and hpZ's groups of 2 are each one host's ranks (they
    were consecutive ranks, each group spanning both hosts), and their losses are one host's
    up to the order of the sums."""
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    env = {"ZMPI_REPORT_DIR": str(report_dir)}
    two = _reports(hosts.start(2, [sys.executable, RANKS_DIR / "twohost_checks.py"], env,
                               round_robin=True), report_dir)
    one = run_mpi(RANKS_DIR / "twohost_checks.py", 4, timeout=TIMEOUT)
    assert [r["host"] for r in two] == [hosts.a, hosts.b, hosts.a, hosts.b]
    for mine, alone in zip(two, one, strict=True):
        for name in ("hybrid", "hpz"):
            assert mine[name]["group_hosts"] == [mine["host"]] * 2, (name, mine)
        for name in ("stage3", "tp2_dp2", "hybrid", "hpz"):
            np.testing.assert_allclose(mine[name]["losses"], alone[name]["losses"],
                                       rtol=1e-12, err_msg=name)


def _wait_for_rows(path, rows: int, proc) -> None:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) > rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} did not reach {rows} rows\n"
                         + finish_mpi(proc, 1).describe())


def _rank_pid(proc, rank: int) -> int:
    """The pid (in this machine's pid namespace) of `rank` of the job `proc` started."""
    from mpi_util import _job_processes

    for pid, argv0 in _job_processes(proc.pid).items():
        if argv0 != os.fsencode(sys.executable):
            continue
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")  # noqa: SIM115
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} below mpiexec {proc.pid}")


def _swap_dirs(hosts) -> dict[str, list[str]]:
    return {host: sorted(os.listdir(hosts.local_dir(host) / "swap"))
            for host in (hosts.a, hosts.b)}


def _removed(result, hosts, left) -> bool:
    """Whether `result`'s stderr names each swap directory of `left` as removed."""
    return all(f"zmpi: removed {hosts.node_local / 'swap' / name}, the swap directory of a "
               "run that ended without removing it" in result.stderr
               for names in left.values() for name in names)


def test_nvme_offload_across_hosts_a_checksum_a_killed_rank_and_ctrl_c(hosts, tmp_path):
    """NVMe offload on each host's own drive, three runs. Rank 1's swap file changed: one
    line, exit 1; its host's swap files removed, the second host's (its ranks killed by the
    launcher) left, as docs/failures.md says. Then a rank of the second host killed
    (SIGKILL): the job ends, no hang; the run removed and named what the first left, and
    leaves its own. Then Ctrl-C: one line, exit 130, the killed run's files removed and no
    swap file left on either host (the second host's stayed: its ranks waited a second
    before removing theirs, and rank 0's abort had them killed by then). run.json names the
    hosts and their ranks."""
    for host in (hosts.a, hosts.b):
        (hosts.local_dir(host) / "swap").mkdir(exist_ok=True)
    config = tmp_path / "nvme.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(hosts.node_local / "swap"), "buffer_size": 1024,
        "buffer_count": 6}}}))
    train = [sys.executable, CLI, *TRAIN, "--config", config, "--steps", 100000]

    tampered = [sys.executable, RANKS_DIR / "nvme_tamper.py", *train[2:-1], 6]
    result = finish_mpi(hosts.start(2, [*tampered, "--out", tmp_path / "tampered"]), TIMEOUT)
    said = [line for line in result.ranks_stderr() if "zmpi" in line]
    assert result.returncode == 1 and len(said) == 1 and said[0].startswith(
        "[rank 1] zmpi train: optimizer step 3: read of master elements"), result.describe()
    left = _swap_dirs(hosts)
    assert left[hosts.a] == [] and len(left[hosts.b]) == 2, (left, result.describe())

    killed = hosts.start(2, [*train, "--out", tmp_path / "killed"])
    _wait_for_rows(tmp_path / "killed" / "metrics.csv", 1, killed)
    os.kill(_rank_pid(killed, 3), signal.SIGKILL)
    result = finish_mpi(killed, TIMEOUT)
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert _removed(result, hosts, left), (left, result.describe())
    left = _swap_dirs(hosts)
    assert left[hosts.b], left  # the killed rank's, at least

    interrupted = hosts.start(2, [*train, "--out", tmp_path / "interrupted"])
    _wait_for_rows(tmp_path / "interrupted" / "metrics.csv", 1, interrupted)
    time.sleep(0.5)  # the watcher threads are up on every rank (Comm, long before)
    interrupted.send_signal(signal.SIGINT)
    result = finish_mpi(interrupted, TIMEOUT)
    assert result.returncode == 130, result.describe()
    assert result.stderr.count("zmpi: interrupted; ending all 4 ranks") == 1, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    assert _removed(result, hosts, left), (left, result.describe())
    assert _swap_dirs(hosts) == {hosts.a: [], hosts.b: []}, result.describe()
    run = json.loads((tmp_path / "interrupted" / "run.json").read_text())
    assert run["nodes"] == 2 and run["hosts"] == {hosts.a: [0, 1], hosts.b: [2, 3]}, run


def test_a_checkpoint_directory_the_hosts_do_not_share_is_found_at_start(hosts, tmp_path):
    """--ckpt-dir on each node's own drive (made on both, so that every rank can write
    there): found as the directory is claimed, before the first step, in one line saying
    that it must be shared (it was found at the first save, as "not written: No such file or
    directory")."""
    for host in (hosts.a, hosts.b):
        (hosts.local_dir(host) / "ckpt").mkdir(exist_ok=True)
    result = finish_mpi(hosts.start(2, [
        sys.executable, CLI, *TRAIN, "--steps", 4, "--save-every", 1,
        "--ckpt-dir", hosts.node_local / "ckpt", "--out", tmp_path / "run"]), TIMEOUT)
    said = [line for line in result.ranks_stderr() if "zmpi" in line]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.describe()
    assert len(said) == 1 and f"{hosts.node_local / 'ckpt'}: not shared between the nodes: " \
        f"{hosts.b} does not see the file rank 0 has just created there" in said[0], \
        result.describe()
    assert not (tmp_path / "run" / "metrics.csv").exists()  # no step was trained
    assert os.listdir(hosts.local_dir(hosts.a) / "ckpt") == [".zmpi-lock"]


def test_a_setting_that_differs_between_the_hosts_is_one_message(hosts, tmp_path):
    """ZMPI_DEBUG set on the second host only: one line from rank 0 naming the setting, not
    a traceback per rank."""
    script = (f"[ \"$(hostname)\" = {hosts.b} ] && export ZMPI_DEBUG=1; "
              f"exec {sys.executable} {CLI} {' '.join(TRAIN)} --steps 2 --out {tmp_path / 'r'}")
    result = finish_mpi(hosts.start(2, ["sh", "-c", script]), TIMEOUT)
    said = [line for line in result.ranks_stderr() if "zmpi" in line]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.describe()
    assert said == ["zmpi: the ranks disagree on the collective check (ZMPI_DEBUG); set it "
                    "alike on every rank (each node's environment and GPUs)"], result.describe()

"""Two hosts on one machine, for the tests that need more than one node (tests/test_twohost.py).

    with TwoHosts(tmp_dir) as hosts:           # skips the test where they cannot be made
        proc = hosts.start(2, [sys.executable, script, ...])   # 2 ranks on each host
        result = finish_mpi(proc, timeout=60)  # tests/mpi_util.py: a hard timeout

Each host is a network, UTS, IPC and PID namespace of its own (Linux, as root): its own
hostname, its own address on a bridge that exists only inside the namespaces, its own
shared-memory segments (without the IPC namespace MPICH would move "inter-node" messages
through shared memory, as between ranks of one node) and its own process ids. A third
namespace, the launch node, holds the bridge and runs mpiexec. The file system is shared, as
on a cluster with a shared file system, except `node_local`: one path on every host, a
different directory behind it on each (a node's local drive), bind-mounted in each host's
private mount namespace; /etc/hosts is replaced there too (never edited).

Hydra's mpiexec starts its proxy on each host through `-launcher ssh -launcher-exec
nslaunch`: nslaunch gets `-x HOST proxy-command...`, as ssh would, and runs the command in
HOST's namespaces (`nsexec`). Every name is this process's own (namespaces `zt<pid>a`,
`zt<pid>b`, `zt<pid>m`, addresses 10.<pid-derived>.x), so the suite and another tool that
makes namespaces (or a second suite) do not collide. `close()` (the context's exit, and an
atexit hook) kills whatever still runs in the namespaces and deletes them, however the test
ended.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_util import OPEN_MPI, REPO_ROOT, _no_core_files, mpiexec_path

NSLAUNCH = """#!/bin/sh
# hydra's ssh launcher calls: LAUNCHER -x HOST proxy-command... (a remote shell's command line)
[ "$1" = -x ] && shift
host=$1; shift
exec "$(dirname "$0")/nsexec" "$host" sh -c "exec $*"
"""

# nsexec HOST CMD...: CMD in HOST's namespaces (see the module docstring); the compute hosts
# get a PID namespace (--kill-child: a launcher killed takes its proxy and ranks along, as a
# remote shell's hang-up does), the launch node none (a signal sent to mpiexec reaches it)
NSEXEC = """#!/bin/sh
host=$1; shift
d=$(dirname "$(readlink -f "$0")")
pidns="--pid --fork --kill-child --mount-proc"
[ "$host" = "{launch}" ] && pidns=
exec ip netns exec "$host" unshare --uts --ipc $pidns --mount --propagation private sh -c \\
    'hostname "$0" && mount --bind "$1/hosts" /etc/hosts &&
     mount --bind "$1/local/$0" "$1/node-local" && shift 2 && cd "$PWD" && exec "$@"' \\
    "$host" "$d" "$PWD" "$@"
"""


def _ip(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20,
                          check=check)


def why_not() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if sys.platform != "linux":
        return "two hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "two hosts need root (network, UTS, IPC and PID namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"two hosts need `{tool}`, which is not on PATH"
    if OPEN_MPI:
        return "the two-host harness starts MPICH's Hydra (-launcher-exec); this is Open MPI"
    return None


class TwoHosts:
    """Hosts `a` and `b` (the nodes) and `m` (the launch node); see the module docstring.
    Constructing it makes them (pytest.skip, saying why, where that fails); `close()` (or the
    context's exit) removes them."""

    def __init__(self, directory: Path):
        reason = why_not()
        if reason:
            pytest.skip(reason)
        tag, net = f"zt{os.getpid() % 100000}", 100 + os.getpid() % 150
        self.a, self.b, self.m = f"{tag}a", f"{tag}b", f"{tag}m"
        self.address = {self.a: f"10.{net}.0.1", self.b: f"10.{net}.0.2",
                        self.m: f"10.{net}.0.10"}
        self.dir = Path(directory)
        self.node_local = self.dir / "node-local"  # the same path on each host, its own drive
        self._made = []
        atexit.register(self.close)
        try:
            self._write_helpers()
            self._up()
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", None) or e
            self.close()
            pytest.skip(f"two hosts could not be made here: {str(detail).strip()}")

    def _write_helpers(self) -> None:
        for host in (self.a, self.b, self.m):
            (self.dir / "local" / host).mkdir(parents=True, exist_ok=True)
        self.node_local.mkdir(exist_ok=True)
        (self.dir / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{addr} {host}\n" for host, addr in self.address.items()))
        for name, text in (("nslaunch", NSLAUNCH), ("nsexec", NSEXEC.format(launch=self.m))):
            (self.dir / name).write_text(text)
            (self.dir / name).chmod(0o755)

    def _up(self) -> None:
        for host in (self.a, self.b, self.m):
            _ip("netns", "add", host)
            self._made.append(host)
            _ip("-n", host, "link", "set", "lo", "up")
        _ip("-n", self.m, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.m, "link", "set", "br0", "up")
        _ip("-n", self.m, "addr", "add", f"{self.address[self.m]}/24", "dev", "br0")
        for host, port in ((self.a, "va"), (self.b, "vb")):
            _ip("-n", host, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", self.m)
            _ip("-n", self.m, "link", "set", port, "master", "br0")
            _ip("-n", self.m, "link", "set", port, "up")
            _ip("-n", host, "addr", "add", f"{self.address[host]}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
        for host in (self.a, self.b, self.m):  # the other namespaces, the mounts, hostname
            subprocess.run([str(self.dir / "nsexec"), host, "true"], capture_output=True,
                           text=True, timeout=20, check=True)
        deadline = time.monotonic() + 10  # until the bridge's ports forward
        while not (self._reachable(self.a, self.b) and self._reachable(self.b, self.m)):
            if time.monotonic() > deadline:
                raise OSError(f"{self.a} cannot reach {self.b} over the bridge")
            time.sleep(0.2)

    def _reachable(self, source: str, target: str) -> bool:
        """A TCP connection from `source` to `target`'s port 9 is refused (a reply came)."""
        probe = ("import socket, sys\ns = socket.socket(); s.settimeout(2)\ntry:\n"
                 f"    s.connect(({self.address[target]!r}, 9))\nexcept ConnectionRefusedError:"
                 "\n    sys.exit(0)\nexcept OSError:\n    sys.exit(1)\n")
        done = subprocess.run(["ip", "netns", "exec", source, sys.executable, "-c", probe],
                              capture_output=True, timeout=10)
        return done.returncode == 0

    def hosts_flag(self, per_host: int, round_robin: bool = False) -> str:
        """hydra's -hosts: `per_host` ranks on a then on b (blocks), or alternating."""
        if round_robin:
            return f"{self.a},{self.b}"
        return f"{self.a}:{per_host},{self.b}:{per_host}"

    def start(self, per_host: int, argv, env=None, round_robin: bool = False,
              mpiexec_args=()) -> subprocess.Popen:
        """Start `mpiexec` on the launch node with `per_host` ranks on each host running
        `argv` (ranks 0..per_host-1 on a, the rest on b; or alternating with `round_robin`),
        in its own process group, as tests/mpi_util.start_mpi does (finish it with
        mpi_util.finish_mpi): OMP_NUM_THREADS=1, the repository on PYTHONPATH, `env` on
        top. mpiexec's pid is the Popen's (a signal sent to it reaches mpiexec)."""
        full_env = dict(os.environ)
        full_env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                        PYTHONFAULTHANDLER="1")
        path = full_env.get("PYTHONPATH")
        full_env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + path if path else "")
        full_env.update(env or {})
        cmd = [str(self.dir / "nsexec"), self.m, mpiexec_path(), "-launcher", "ssh",
               "-launcher-exec", str(self.dir / "nslaunch"),
               "-hosts", self.hosts_flag(per_host, round_robin), "-n", str(2 * per_host),
               *mpiexec_args, *map(str, argv)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, cwd=REPO_ROOT, start_new_session=True,
                                preexec_fn=_no_core_files)
        proc.started = time.monotonic()
        return proc

    def local_dir(self, host: str) -> Path:
        """What host `host` sees at `node_local` (its own drive), seen from outside."""
        return self.dir / "local" / host

    def close(self) -> None:
        """Kill what still runs in the namespaces and delete them (idempotent)."""
        while self._made:
            host = self._made.pop()
            pids = _ip("netns", "pids", host, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", host, check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Tests for zmpi.comm: a size-1 Comm in this process, then real collectives and
point-to-point messages on 2, 3 and 4 ranks under mpiexec (tests/ranks/comm_checks.py reports
raw results; expectations are computed here from rank and size), abort-on-exception, and the
watchdog over a recv that never gets its message.

    .venv/bin/python -m pytest tests/test_comm.py -q
"""

import json
import pickle
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from mpi_util import RANKS_DIR, REPO_ROOT, STANDIN, launch_mpi, run_mpi, said_by_ranks

from zmpi import backend
from zmpi import comm as zcomm
from zmpi.comm import OPS, Comm, wait_all

BF16 = ml_dtypes.bfloat16


def ring(nbytes, n, k=1):
    """Bytes one rank sends in a ring collective: k (N-1)/N nbytes, rounded down."""
    return nbytes * k * (n - 1) // n


# --------------------------------------------------------------------------- size 1, in process


@pytest.fixture
def comm():
    return Comm()


def test_size_one_comm_without_mpiexec(comm):
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    assert comm.is_cuda_aware is False
    buf = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert comm.allreduce(buf) is buf and np.array_equal(buf.ravel(), np.arange(6))
    recv = np.empty(4, BF16)
    comm.reduce_scatter(np.arange(4, dtype=BF16), recv)
    assert np.array_equal(recv.astype(np.float32), np.arange(4))
    gathered = comm.allgather(np.arange(3.0), np.empty(3))
    assert np.array_equal(gathered, np.arange(3.0))
    assert np.array_equal(comm.allgather_inplace(np.arange(3.0)), np.arange(3.0))
    assert np.array_equal(comm.broadcast(np.arange(2, dtype=np.int64)), [0, 1])
    assert comm.allreduce_scalar(2.5) == 2.5 and comm.allreduce_scalar(2.5, "max") == 2.5
    assert comm.bcast_object({"a": 1}) == {"a": 1}
    assert comm.allgather_object("x") == ["x"]
    comm.barrier()


def test_size_one_nonblocking(comm):
    a, b = np.ones(3, np.float16), np.ones(4, BF16)
    requests = [comm.iallreduce(a), comm.iallgather_inplace(b)]
    results = wait_all(requests)
    assert results[0] is a and results[1] is b
    assert all(r.test() for r in requests)
    assert requests[0].wait() is a  # idempotent


def test_counters_size_one(comm):
    comm.allreduce(np.zeros(10, np.float32))
    comm.allgather(np.zeros(2), np.zeros(2))
    snap = comm.counters_snapshot()
    assert set(snap) == set(OPS)
    assert snap["allreduce"] == {"calls": 1, "bytes": 40, "sent": 0}  # nothing leaves one rank
    assert snap["allgather"] == {"calls": 1, "bytes": 16, "sent": 0}
    snap["allreduce"]["calls"] = 99  # a copy
    assert comm.counters["allreduce"].calls == 1
    comm.reset_counters()
    assert all(c == {"calls": 0, "bytes": 0, "sent": 0} for c in comm.counters_snapshot().values())


def test_split_size_one(comm):
    sub = comm.split(0)
    assert (sub.rank, sub.size) == (0, 1) and sub.counters is not comm.counters
    sub.allreduce(np.zeros(2))
    assert sub.counters["allreduce"].calls == 1 and comm.counters["allreduce"].calls == 0
    sub.free()
    assert comm.split(MPI.UNDEFINED) is None


def test_agreed_call_size_one(comm):
    """The result where fn returns; where it raises, the rank's description in the list and
    its own exception to chain from (the multi-rank agreement: test_checkpoint_safety's and
    test_pipeline's errors on some ranks only)."""
    from zmpi.comm.agree import agreed_call

    assert agreed_call(comm, lambda: 7, repr) == (7, [], None)
    oops = KeyError("x")

    def fails():
        raise oops

    result, failed, error = agreed_call(comm, fails, lambda e: f"{type(e).__name__}")
    assert (result, failed, error) == (None, [(0, "KeyError")], oops)


@pytest.mark.parametrize("call, match", [
    (lambda c: c.reduce_scatter(np.zeros(5), np.zeros(4)), r"send.size \(5\).*recv.size \(4\)"),
    (lambda c: c.allgather(np.zeros(2), np.zeros(3)), r"recv.size \(3\).*send.size \(2\)"),
    (lambda c: c.allgather(np.zeros(2, np.float32), np.zeros(2)), "dtype"),
    (lambda c: c.allreduce(np.zeros((3, 3))[:, 1]), "contiguous"),
    (lambda c: c.allreduce(np.zeros(3), op="prod"), "sum, max, min"),
    (lambda c: c.allreduce(np.zeros(3, np.complex128)), "not supported"),
    (lambda c: c.broadcast(np.zeros(3), root=1), "root"),
])
def test_local_errors(comm, call, match):
    with pytest.raises(ValueError, match=match):
        call(comm)
    assert comm.counters["allreduce"].calls == 0  # nothing counted, nothing sent


def test_cuda_aware_env_override(monkeypatch):
    monkeypatch.setenv("ZMPI_CUDA_AWARE", "1")
    assert Comm().is_cuda_aware is True
    monkeypatch.setenv("ZMPI_CUDA_AWARE", "0")
    assert Comm().is_cuda_aware is False
    monkeypatch.setenv("ZMPI_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="ZMPI_CUDA_AWARE"):
        Comm()


# --------------------------------------------------------------------------- 2, 3, 4 ranks


@pytest.fixture(scope="module", params=[2, 3, 4])
def reports(request):
    return run_mpi(RANKS_DIR / "comm_checks.py", request.param, timeout=60)


def test_mpi_basics(reports):
    n = len(reports)
    for r, rep in enumerate(reports):
        assert rep["size"] == n and rep["backend"] == backend.name
        assert (rep["local_rank"], rep["local_size"]) == (r, n)  # one node
        assert rep["is_cuda_aware"] is False


def test_progress_thread_polls_while_a_collective_is_in_flight(reports, monkeypatch):
    """By default a rank has the thread only with a spare core of its own (on this 2-core
    machine: only at 1 rank); forced on, every rank polls while its collective is in flight."""
    for rep in reports:
        for mode, expected in (("auto", 2 * len(reports) <= rep["progress_auto"]["cores"]),
                               ("1", True)):
            progress = rep[f"progress_{mode}"]
            assert progress["in_flight"] == 1 and progress["sum_ok"], progress
            assert (progress["polls"] > 0) == expected, (mode, progress)
            assert progress["in_flight_after"] == 0
    for rep in reports:  # without the thread, the engine's call between units probes MPI
        assert rep["pokes"]["sum_ok"], rep["pokes"]
        assert rep["pokes"]["pokes"] == (0 if rep["pokes"]["thread"] else 1), rep["pokes"]
    monkeypatch.setenv("ZMPI_PROGRESS_THREAD", "yes")
    with pytest.raises(ValueError, match="ZMPI_PROGRESS_THREAD must be auto, 0 or 1"):
        zcomm._Progress()


def test_mpi_allreduce(reports):
    n = len(reports)
    s = n * (n - 1) / 2
    for rep in reports:
        for k, v in rep["allreduce_sum"].items():
            assert v == [[s] * 3] * 2, k
        for k, v in rep["allreduce_max"].items():
            assert v == [n - 1, 7], k
        for k, v in rep["allreduce_min"].items():
            assert v == [0, 7 - (n - 1)], k
        assert rep["bf16_signed_max"] == [0, 0.25 * (n - 1), 3]
        assert rep["bf16_signed_min"] == [-1.5 * (n - 1), 0, 3 - (n - 1)]
        assert rep["allreduce_scalar"] == {"sum": s + 0.5 * n, "max": n - 0.5, "min": 0.5}


def test_mpi_bf16_sum_matches_float32(reports):
    n = len(reports)
    xs = [np.random.default_rng(1234 + r).standard_normal(1000).astype(BF16).astype(np.float32)
          for r in range(n)]
    ref = np.sum(xs, axis=0)
    # reduced in float32 and rounded to bf16 once (exactly: tests/test_gpu_comm.py); this
    # bound, 2^-8 relative per pairwise step, held for the rounding after every step too
    tol = (n - 1) * 2.0**-8 * np.sum(np.abs(xs), axis=0)
    got = np.array(reports[0]["bf16_random_sum"])
    assert np.all(np.abs(got - ref) <= tol)
    assert np.array_equal(got, got.astype(BF16).astype(np.float64))  # bf16 values
    assert all(rep["bf16_random_sum"] == reports[0]["bf16_random_sum"] for rep in reports)


def test_mpi_reduce_scatter(reports):
    n = len(reports)
    s = n * (n - 1) / 2
    for r, rep in enumerate(reports):
        expected = [s + n * (2 * r + j) for j in range(2)]  # sum_q (q + 2r + j)
        for k, v in rep["reduce_scatter"].items():
            assert v == expected, k
        assert rep["reduce_scatter_max"] == [n - 1 + 2 * r + j for j in range(2)]


def test_mpi_allgather_and_broadcast(reports):
    n = len(reports)
    for rep in reports:
        for k, v in rep["allgather"].items():
            dt = BF16 if k == "bfloat16" else np.dtype(k)
            blocks = [(q + 0.5 * np.arange(3)).astype(dt).astype(np.float64) for q in range(n)]
            assert v == np.concatenate(blocks).tolist(), k
        for k, v in rep["allgather_inplace"].items():
            assert v == np.repeat(np.arange(1, n + 1), 3).tolist(), k
        for k, v in rep["broadcast"].items():
            assert v == list(range(5)), k
        assert rep["bcast_object"] == {"from": 0, "list": [1, 2]}
        assert rep["allgather_object"] == [["r", q] for q in range(n)]


def test_mpi_nonblocking(reports):
    n = len(reports)
    s = n * (n - 1) / 2
    for r, rep in enumerate(reports):
        assert rep["nb_allreduce"] == [[s] * 4, [s] * 6, True, True]
        assert rep["nb_reduce_scatter"] == [s + n * (2 * r + j) for j in range(2)]
        assert rep["nb_allgather"] == np.repeat(np.arange(n), 2).tolist()
        assert rep["nb_allgather_inplace"] == np.repeat(np.arange(1, n + 1), 2).tolist()
        assert rep["nb_results_are_outputs"] == [True, True, True]


def test_mpi_split(reports):
    n = len(reports)
    for r, rep in enumerate(reports):
        members = [q for q in range(n) if q % 2 == r % 2]
        assert rep["split"] == {"rank": members.index(r), "size": len(members),
                                "sum": float(sum(members)), "gather": members,
                                "sub_calls": 2, "parent_calls": 0}


def test_mpi_local_errors_raise_on_every_rank_without_hanging(reports):
    n = len(reports)
    for rep in reports:
        assert all(msg is not None for msg in rep["errors"].values()), rep["errors"]
        assert f"send.size ({2 * n + 1})" in rep["errors"]["reduce_scatter_size"]
        assert f"recv.size ({2 * n - 1})" in rep["errors"]["allgather_size"]
        assert rep["after_errors"] == n


def test_mpi_counters_follow_ring_model(reports):
    """Every op, every size: calls, payload and ring-model bytes sent, exactly."""
    n = len(reports)
    obj_bytes = len(pickle.dumps([1, 2, 3], protocol=pickle.HIGHEST_PROTOCOL))
    gathered = sum(len(pickle.dumps(q, protocol=pickle.HIGHEST_PROTOCOL)) for q in range(n))
    for r, rep in enumerate(reports):
        root = 1 % n
        expected = {
            # 2 x float32[10] + float16[7]
            "allreduce": {"calls": 3, "bytes": 94, "sent": 2 * ring(40, n, 2) + ring(14, n, 2)},
            # send float32[3n] + bf16[2n], which travels as float32[2n] (tests/test_gpu_comm.py)
            "reduce_scatter": {"calls": 2, "bytes": 16 * n, "sent": 20 * (n - 1)},
            # recv float64[2n] + float32[5n] + float16[n]
            "allgather": {"calls": 3, "bytes": 38 * n, "sent": 38 * (n - 1)},
            "alltoall": {"calls": 0, "bytes": 0, "sent": 0},  # tests/test_zeropp.py
            "broadcast": {"calls": 1, "bytes": 24, "sent": 24 if r == root else 0},
            "allreduce_scalar": {"calls": 1, "bytes": 8, "sent": ring(8, n, 2)},
            "object": {"calls": 2, "bytes": obj_bytes + gathered,
                       "sent": (obj_bytes if r == 0 else 0) + ring(gathered, n)},
            "send": {"calls": 0, "bytes": 0, "sent": 0},
            "recv": {"calls": 0, "bytes": 0, "sent": 0},
        }
        assert rep["counters"] == expected
        assert rep["objects"] == [[1, 2, 3], list(range(n))]
        assert all(v == {"calls": 0, "bytes": 0, "sent": 0}
                   for v in rep["counters_after_reset"].values())


def test_ring_model_matches_zero_paper():
    """Reduce-scatter + allgather of Psi moves what one allreduce of Psi does: 2 (N-1)/N Psi."""
    psi = 2 * 1_000_000 * 12  # fp16 bytes, divisible by every N below
    for n in (2, 3, 4, 8):
        assert ring(psi, n) + ring(psi, n) == ring(psi, n, 2) == 2 * psi * (n - 1) // n


def test_abort_on_exception_ends_the_job():
    """Rank 1 raises before a collective that ranks 0 and 2 enter: without the excepthook
    MPICH would hang forever; with it the job dies in seconds with rank 1's traceback."""
    result = launch_mpi(RANKS_DIR / "raise_on_rank.py", 3, timeout=30)
    assert not result.timed_out, result.describe()
    assert result.returncode != 0, result.describe()
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in result.stderr
    assert "UNREACHABLE" not in result.stdout


def test_watchdog_keeps_no_frame_of_a_finished_wait():
    """The watchdog's thread looks at the frames of the collectives waited for; once a wait
    ended it must not keep its frame (and so the frame's buffers) alive."""
    import sys
    import time
    import weakref

    class Buffer:
        pass

    def waiting_call():
        buf = Buffer()  # noqa: F841  (a local the frame holds)
        return sys._getframe(), weakref.ref(buf)

    dog = zcomm._Watchdog(timeout=4.0)  # checks once a second
    frame, alive = waiting_call()
    token = dog.begin("allreduce", frame)
    del frame
    time.sleep(1.5)  # the thread has looked at the wait
    dog.end(token)
    time.sleep(1.5)
    assert alive() is None


# --------------------------------------------------------------------------- point-to-point


def test_size_one_messages_to_itself(comm):
    sent, got = np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((2, 3), np.float32)
    req = comm.isend(sent, 0, tag=2)
    assert comm.recv(got, 0, tag=2) is got and req.wait() is sent
    assert np.array_equal(got, sent)
    assert comm.counters_snapshot()["send"] == {"calls": 1, "bytes": 24, "sent": 24}
    assert comm.counters_snapshot()["recv"] == {"calls": 1, "bytes": 24, "sent": 0}
    bad = comm.irecv(np.zeros(3, np.float32), 0)
    comm.isend(np.zeros(3, np.int32), 0).wait()
    for _ in range(2):  # every time, never a silent result
        with pytest.raises(ValueError, match="sent int32 x 3 .* buffer is float32 x 3"):
            bad.wait()


class _NoAttributes:
    """An MPI communicator that answers None to every attribute, as Open MPI does for TAG_UB
    on a communicator split from MPI_COMM_WORLD (MPI attaches it to the world only)."""

    def __init__(self, mpi_comm):
        self._comm = mpi_comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Get_attr(self, key):  # noqa: N802 (mpi4py's name)
        return None


def test_messages_on_a_communicator_without_attributes_bound_tags_by_the_world():
    comm = Comm(_NoAttributes(MPI.COMM_SELF.Dup()))
    sent, got = np.arange(3, dtype=np.float32), np.zeros(3, np.float32)
    req = comm.isend(sent, 0, tag=5)
    comm.recv(got, 0, tag=5)
    req.wait()
    assert np.array_equal(got, sent)
    top = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) - 1) // 2
    with pytest.raises(ValueError, match=rf"tag {top + 1} not in \[0, {top}\]"):
        comm.isend(sent, 0, tag=top + 1)


def test_mpi_ring_exchange(reports):
    """send/recv around the ring, then isend/irecv both ways on two tags: values, results,
    and counters (bytes = payload; sent = payload for send, 0 for recv; nothing else)."""
    n = len(reports)
    for r, rep in enumerate(reports):
        left, right = (r - 1) % n, (r + 1) % n
        assert rep["p2p"] == {"ring": (10 * left + np.arange(6.0)).reshape(2, 3).tolist(),
                              "bf16": [left + 0.5] * 4, "int64": [right, -right],
                              "results_are_buffers": [True] * 4}
        assert rep["p2p_counters"] == {"send": {"calls": 3, "bytes": 48, "sent": 48},
                                       "recv": {"calls": 3, "bytes": 48, "sent": 0}}
        assert rep["p2p_other_calls"] == 0


def test_mpi_mismatched_message_is_a_clear_error(reports):
    """A message larger or smaller than the receive buffer, or of another dtype: ValueError
    naming both sides, from recv and from irecv (test/wait), not a hang or a truncation."""
    n = len(reports)
    for r, rep in enumerate(reports):
        errors = rep["p2p_errors"]
        sender = f"recv: rank {(r - 1) % n} sent float32 x 4 (tag 11), but the receive buffer is"
        for how in ("recv", "irecv"):
            assert errors[f"{how}_larger"].startswith(f"{sender} float32 x 2"), errors
            assert errors[f"{how}_smaller"].startswith(f"{sender} float32 x 8"), errors
            assert errors[f"{how}_dtype"].startswith(f"{sender} int32 x 4"), errors
        assert errors["bad_dest"] == f"send: rank {n} not in [0, {n})"
        assert errors["bad_source"] == f"recv: rank -1 not in [0, {n})"
        assert errors["bad_tag"].startswith("send: tag -1 not in [0, ")
        assert "C-contiguous" in errors["non_contiguous"]
        assert rep["p2p_after_errors"] == [(r - 1) % n] * 3


def test_watchdog_ends_a_recv_that_never_gets_its_message():
    result = launch_mpi(RANKS_DIR / "comm_checks.py", 2, args=["recv_nothing"], timeout=30,
                        env={"ZMPI_COLLECTIVE_TIMEOUT": "1"})
    assert not result.timed_out and result.returncode == 3, result.describe()
    assert ("[rank 0] zmpi watchdog: waited 1 s (ZMPI_COLLECTIVE_TIMEOUT) in recv (float32 x 4 "
            "from rank 1, tag 3), called at tests/ranks/comm_checks.py") in result.stderr
    assert "UNREACHABLE" not in result.stdout


STANDIN_MESSAGES = """
import json, os
import cupy, numpy as np
from zmpi.comm import Comm
out = {}
for aware in ("0", "1"):
    os.environ["ZMPI_CUDA_AWARE"] = aware
    comm = Comm()
    x, got, y = (cupy.asarray(np.arange(6, dtype=np.float32)), cupy.zeros(6, np.float32),
                 cupy.zeros(6, np.float32))
    req = comm.isend(x, 0, tag=1)  # to this rank itself (size 1)
    comm.recv(got, 0, tag=1)
    req.wait()
    comm.wait_all([comm.irecv(y, 0), comm.isend(x * 2, 0)])
    bad = comm.irecv(cupy.zeros(5, np.float32), 0)
    comm.send(x, 0)
    try:
        bad.wait()
        error = None
    except ValueError as e:
        error = str(e)
    out[aware] = {"recv": got.get().tolist(), "irecv": y.get().tolist(), "error": error,
                  "staged": comm.staged_bytes}
print(json.dumps(out))
"""


def test_messages_of_device_buffers_staged_and_cuda_aware():
    """On the strict CuPy stand-in: device buffers are staged through the host (MPI not
    CUDA-aware) or handed to MPI directly, as in the collectives."""
    out = json.loads(subprocess.run([sys.executable, "-c", STANDIN_MESSAGES], env=STANDIN,
                                    cwd=REPO_ROOT, capture_output=True, text=True,
                                    check=True).stdout)
    for aware, staged in (("0", {"to_host": 72, "to_device": 68}),
                          ("1", {"to_host": 0, "to_device": 0})):
        assert out[aware]["recv"] == list(range(6)) and out[aware]["irecv"] == list(range(0, 12, 2))
        assert "sent float32 x 6 (tag 0), but the receive buffer is float32 x 5" in \
            out[aware]["error"]
        assert out[aware]["staged"] == staged  # three sends of 24 bytes; recvs of 24, 24, 20


SETTINGS_DIFFER = """
import os, sys
rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
if rank == "1":  # the collective check on rank 1 only, as a node's own environment might
    os.environ["ZMPI_DEBUG"] = "1"
from zmpi.comm import Comm
try:
    Comm()
    said = "built"
except RuntimeError as e:
    said = str(e)
with open(f"{sys.argv[1]}/rank{rank}.txt", "w") as fh:
    fh.write(said)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("variable, expected", [
    ("ZMPI_DEBUG", "zmpi: the ranks disagree on the collective check (ZMPI_DEBUG); set it "
                   "alike on every rank (each node's environment and GPUs)"),
    ("ZMPI_CUDA_AWARE", "built")])  # on NumPy no device buffer goes to MPI: no difference
def test_ranks_that_disagree_on_a_setting_fail_at_construction(tmp_path, variable, expected):
    """ZMPI_DEBUG on one rank only would add an allgather per collective on that rank alone
    (a hang at the first collective): Comm's construction compares the settings that decide
    which MPI calls a rank makes, and every rank raises, naming the one that differs."""
    said = said_by_ranks(tmp_path, SETTINGS_DIFFER.replace("ZMPI_DEBUG", variable))
    assert said[0] == said[1] == expected, said

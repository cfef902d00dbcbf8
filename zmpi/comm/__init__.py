"""zmpi.comm: MPI through one door. Every collective and point-to-point message on a flat
buffer goes through a `Comm`, which counts it.

Run a program under MPI as usual:

    mpiexec -n 4 python train.py          # Comm() wraps MPI.COMM_WORLD
    python train.py                       # works too: a size-1 Comm (MPI singleton)

The modules, one concept each (communicator imports the others; none imports it):

    communicator.py   Comm: collectives, send/recv/isend/irecv, counters, split/free,
                      object collectives
    requests.py       Request, wait_all, the request queue, the progress thread and
                      make_progress (the same from the caller's thread)
    staging.py        the host staging pool for device buffers (and its ledger accounting)
    wire.py           MPI datatypes and reduction ops (16-bit floats without an MPI type
                      reduced as float32), the buffer checks, the message header, OPS and
                      OpCounter
    faults.py         abort on an exception (and the peer kill), Ctrl-C, fail_alone
    watchdog.py       the watchdog over blocking MPI waits (_watched), waited_seconds
    checks.py         CollectiveMismatch and the collective check, the settings check
    mpi_info.py       the loaded MPI library, cuda_support, mpi_flavour
    agree.py          agreed_call: a call whose failure on any rank every rank learns

Everything `zmpi.comm` held before it became a package is importable from it still, except
the module flags a function rebinds (faults._PEERS_ASKED, _abort_installed,
watchdog._WATCHDOG): read those on their modules; and except the user-defined MPI.Op for
bfloat16 (`_user_op`, `_USER_OPS`, `_NUMPY_OPS`), gone: no reduction runs a Python-level op
(`wire.reduction_dtype`). Patching a name here changes what callers that import it from here
get, not what the modules inside use.
"""

# ruff: noqa: F401  (re-exports: the private names too, which tests and older code reach for)

from zmpi import backend  # before mpi4py.MPI (MPI_Init): it picks this rank's GPU

# isort: split
from mpi4py import MPI

from zmpi.comm.checks import CollectiveMismatch
from zmpi.comm.communicator import Comm
from zmpi.comm.faults import (
    _FORWARD_S,
    _PEERS,
    SettingsDiffer,
    _abort,
    _end_local_peers,
    _identity,
    _proc_stat,
    _set_peers,
    install_abort_on_exception,
)
from zmpi.comm.mpi_info import _libmpi, cuda_support, mpi_flavour
from zmpi.comm.requests import _PROGRESS, _QUEUES, Request, _Progress, make_progress, wait_all
from zmpi.comm.staging import _POOL, _StagingPool, account_staging_in, staging_nbytes
from zmpi.comm.watchdog import _call_site, _Watchdog, _watchdog, _watched, waited_seconds
from zmpi.comm.wire import (
    _NATIVE_OPS,
    _WIRES,
    OPS,
    OpCounter,
    _check_op,
    _flat,
    _same_dtype,
    _Wire,
    _wire,
    reduction_dtype,
)

__all__ = ["MPI", "Comm", "CollectiveMismatch", "SettingsDiffer", "OPS", "OpCounter",
           "Request", "wait_all", "make_progress", "account_staging_in", "staging_nbytes",
           "cuda_support", "mpi_flavour", "install_abort_on_exception", "waited_seconds"]

"""Suite-wide setting: the processes the suite starts run NumPy's host loops.

Every mpiexec rank and `zmpi` command the tests start gets ZMPI_NUMBA=0 unless the test or the
caller says otherwise. Loading Numba costs a process about half a second of a core (its import
and the first call of its cached loops); over the suite's 400 or so processes that was a
quarter of `make test`'s time, while their tiny models gain nothing from the compiled loops,
which give the same bits as NumPy (tests/test_host_kernels.py). This process keeps the loops
its environment asks for (compiled by default), so the engine tests that run in it use them,
and the ZeRO-Offload suite's ranks ask for them again (tests/test_offload.py).
`ZMPI_NUMBA=1 make test` runs every process with them.
"""
import os

from zmpi import host_kernels  # noqa: F401  (loaded now, by the environment as it was given)

os.environ.setdefault("ZMPI_NUMBA", "0")

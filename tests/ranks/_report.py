"""Rank-side half of tests/mpi_util.py: print one `ZMPI_REPORT <json>` line per rank.

A rank script (run by `run_mpi`) does `from _report import report` (its own directory is on
sys.path) and calls `report({...})` once; `run_mpi` returns the reports sorted by rank.
mpiexec may interleave long lines from different ranks, so when ZMPI_REPORT_DIR is set (as
`run_mpi` does) the same JSON is also written to `$ZMPI_REPORT_DIR/rank-<r>.json`, which is
what `run_mpi` reads.
"""

import json
import os

import numpy as np

PREFIX = "ZMPI_REPORT "


def _rank_from_env():
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank()


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "get"):  # a CuPy array
        return x.get().tolist()
    raise TypeError(f"cannot report {type(x).__name__}")


def report(obj: dict):
    """Print this rank's report; adds 'rank' (the MPI world rank) if obj has none."""
    obj = dict(obj)
    obj.setdefault("rank", _rank_from_env())
    text = json.dumps(obj, default=_jsonable)
    directory = os.environ.get("ZMPI_REPORT_DIR")
    if directory:
        path = os.path.join(directory, f"rank-{obj['rank']}.json")
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    print(PREFIX + text, flush=True)

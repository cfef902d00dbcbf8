"""Rank side of tests/test_plan_validation.py: run each layout given (a JSON list of
{"job": Job fields, "layout": Layout fields} in argv[1]) with the Engine for a few steps, as
experiments/validate_plan.py does, and report this rank's ledger figures per layout (model
states after the first step, peaks over the steps) for the test to compare with
zmpi.plan.memory.stage_memory."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))

from _report import report  # noqa: E402
from validate_plan import run_layout  # noqa: E402

from zmpi.comm import Comm  # noqa: E402
from zmpi.plan.layout import Job, Layout  # noqa: E402


def main():
    comm = Comm()
    items, steps = json.loads(sys.argv[1]), int(sys.argv[2])
    out = []
    for item in items:
        r = run_layout(comm, Job(**item["job"]), Layout(**item["layout"]), steps, seed=0)
        r.pop("times")
        out.append(r)
    report({"rank": comm.rank, "layouts": out})


if __name__ == "__main__":
    main()

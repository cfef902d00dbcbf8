"""Rank side of tests/test_strategies_doc.py: a strategy loaded by module path against stage 1.

    mpiexec -n N python tests/ranks/plugin_checks.py package.module:ClassName

Trains the fp64 GPT of zero_checks.py for 3 steps with `stage1` and with the given strategy
(same weights, same batches) and reports the largest parameter difference, the strategy's
registered name and the payload bytes of each collective the plugin's step used.
"""
import sys

import numpy as np
from _report import report
from zero_checks import GPT_CONFIG, config, gpt_data
from zmpi.models.gpt import GPT

from zmpi.comm import Comm
from zmpi.engine import Engine


def train(strategy, comm):
    cfg = config(1, "fp64", n=comm.size)
    cfg["zero_optimization"]["strategy"] = strategy
    engine = Engine(GPT(GPT_CONFIG, seed=0, dtype=np.float64), cfg, comm)
    data = gpt_data(comm, 1)
    for step in range(3):
        comm.reset_counters()
        engine.train_step(*data.sample(step))
    traffic = {op: c.bytes for op, c in comm.counters.items() if c.calls}
    return engine.gather_parameters(), engine.strategy.name, traffic


def main():
    comm = Comm()
    want, _, _ = train("stage1", comm)
    got, name, traffic = train(sys.argv[1], comm)
    worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    report({"max_diff": worst, "name": name, "traffic": traffic,
            "model_bytes": sum(v.size for v in want.values()) * 8})


if __name__ == "__main__":
    main()

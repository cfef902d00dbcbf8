"""Rank side of tests/test_twohost.py's training checks, on one host or on two, in one launch:

    mpiexec -n 4 python tests/ranks/twohost_checks.py

For each layout (stage 3; hybrid sharding with its default group, a node's ranks; hpZ in
groups of 2; tensor 2 x data 2) a small GPT trains a few steps, and each rank reports its
host, the losses and, for the layouts that keep collectives inside a node, the hosts of its
group's ranks (hybrid's shard group, hpZ's), so the test can compare the losses with one
host's and see where the groups lie whatever the ranks' placement.
"""
import socket

import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=16, seq_len=8, n_layer=2, n_head=2, d_model=16)
ROWS, STEPS = 4, 3  # rows per data-parallel rank and step
LAYOUTS = {  # name: (zero_optimization, tensor-parallel degree)
    "stage3": ({"stage": 3}, 1),
    "hybrid": ({"strategy": "hybrid"}, 1),
    "hpz": ({"stage": 3, "zero_hpz_partition_size": 2}, 1),
    "tp2_dp2": ({"stage": 1}, 2),
}


def train(comm, zero, tp):
    mesh = Mesh(comm, tp=tp)
    config = {"train_micro_batch_size_per_gpu": ROWS, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": dict(zero),
        "tensor_parallel": {"autotp_size": tp}}
    engine = Engine(GPT(CFG, seed=0, dtype=np.float64, tp=mesh.tp_comm), config, comm,
                    mesh=mesh)
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, ROWS * mesh.dp, mesh.dp_rank, mesh.dp,
                           seed=1)
    losses = [engine.train_step(*data.sample(step)) for step in range(STEPS)]
    strategy = engine.strategy
    group = getattr(strategy, "intra", None) if "zero_hpz_partition_size" in zero else \
        strategy.comm if zero.get("strategy") == "hybrid" else None
    hosts = None if group is None else group.allgather_object(socket.gethostname())
    engine.close()
    return {"losses": losses, "group_hosts": hosts}


def main():
    comm = Comm()
    report({"rank": comm.rank, "host": socket.gethostname(),
            **{name: train(comm, zero, tp) for name, (zero, tp) in LAYOUTS.items()}})


if __name__ == "__main__":
    main()

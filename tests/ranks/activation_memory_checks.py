"""Rank side of tests/test_activation_memory.py: the activation peak the ledger measures on 2
tensor-parallel ranks, to set beside zmpi.models.gpt_counts.gpt_activation_bytes.

    mpiexec -n 2 python tests/ranks/activation_memory_checks.py

Reports `runs`, a list of {"T", "B", "sequence_parallel", "recompute", "partition", "cpu",
"engine", "device", "host"}: one forward and backward of a GPT split over tp = 2 (fp32,
vocabulary 13: padded to 14), device and host peaks of the ledger's "activation", for
every policy with and without sequence parallelism at two (T, B), and with full recompute
its kept inputs partitioned over the two ranks and/or on the host (bare models: an
InputStore); the last run goes through the Engine with those two config keys.
"""
import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.engine import Engine
from zmpi.memory import MemoryLedger
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.nn.checkpointing import InputStore
from zmpi.nn.module import activations_counted_in
from zmpi.parallel.mesh import Mesh

SHAPE = {"vocab_size": 13, "n_layer": 2, "n_head": 4, "d_model": 16}
SIZES = ((8, 3), (80, 2))  # (T, B): one attention block; two, T not a multiple of 64


def batch(T, B):
    rng = np.random.default_rng(1)
    return rng.integers(0, 13, (B, T)), rng.integers(0, 13, (B, T))


def bare(tp, T, B, sp, policy, partition=False, cpu=False):
    """Peaks of one forward and backward of a GPT split over `tp`, kept inputs per the flags."""
    model = GPT(GPTConfig(seq_len=T, **SHAPE), seed=0, tp=tp, sequence_parallel=sp)
    model.set_recompute(policy, saved_inputs=InputStore(tp if partition else None, cpu))
    ledger = MemoryLedger()
    with activations_counted_in(ledger):
        model.forward_loss(*batch(T, B))
        model.backward_loss()
    assert ledger.current("activation") == 0
    return {"T": T, "B": B, "sequence_parallel": sp, "recompute": policy,
            "partition": partition, "cpu": cpu, "engine": False,
            "device": ledger.peak("activation", "device"),
            "host": ledger.peak("activation", "host")}


def through_the_engine(comm, T, B):
    """One train_step of the Engine at tp 2, full recompute, kept inputs partitioned and on
    the host by the config's activation_checkpointing keys."""
    mesh = Mesh(comm, tp=2)
    config = {"train_micro_batch_size_per_gpu": B,
              "tensor_parallel": {"autotp_size": 2},
              "activation_checkpointing": {"recompute": "full", "partition_activations": True,
                                           "cpu_checkpointing": True}}
    engine = Engine(GPT(GPTConfig(seq_len=T, **SHAPE), seed=0, tp=mesh.tp_comm), config, comm,
                    mesh=mesh)
    engine.train_step(*batch(T, B))
    run = {"T": T, "B": B, "sequence_parallel": False, "recompute": "full", "partition": True,
           "cpu": True, "engine": True, "device": engine.memory.peak("activation", "device"),
           "host": engine.memory.peak("activation", "host")}
    engine.close()
    return run


def main():
    comm = Comm()
    runs = []
    for T, B in SIZES:
        for sp in (False, True):
            for policy in ("none", "selective", "full"):
                runs.append(bare(comm, T, B, sp, policy))
        for partition, cpu in ((True, False), (False, True), (True, True)):
            runs.append(bare(comm, T, B, False, "full", partition, cpu))
        runs.append(bare(comm, T, B, True, "full", cpu=True))
    runs.append(through_the_engine(comm, *SIZES[1]))
    report({"runs": runs})


if __name__ == "__main__":
    main()

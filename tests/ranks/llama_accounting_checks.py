"""Rank side of tests/test_llama_accounting.py: what one forward and backward of a Llama split
over 2 tensor ranks keeps and moves, to set beside models/llama.py's counts
(`llama_activation_bytes`, `llama_tensor_traffic`) that `zmpi estimate --model llama` prints.

    mpiexec -n 2 python tests/ranks/llama_accounting_checks.py

Reports `runs`, a list of {"n_kv_head", "sequence_parallel", "recompute", "device" (the
ledger's activation peak), "traffic" ({op: {calls, bytes, sent}} on the tensor group)}: fp32,
T = 16, B = 2, key/value heads split (2) and replicated (1), with and without sequence
parallelism, every recompute policy.
"""
import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.memory import MemoryLedger
from zmpi.models.llama import Llama, LlamaConfig
from zmpi.nn.module import activations_counted_in

T, B = 16, 2


def config(n_kv_head: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=40,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv_head,
                       max_position_embeddings=T)


def run(comm, n_kv_head, sp, policy) -> dict:
    model = Llama(config(n_kv_head), seed=0, tp=comm, sequence_parallel=sp)
    model.set_recompute(policy)
    rng = np.random.default_rng(1)
    ids, targets = rng.integers(0, 13, (B, T)), rng.integers(0, 13, (B, T))
    ledger = MemoryLedger()
    comm.reset_counters()
    with activations_counted_in(ledger):
        model.forward_loss(ids, targets)
        model.backward_loss()
    assert ledger.current("activation") == 0
    return {"n_kv_head": n_kv_head, "sequence_parallel": sp, "recompute": policy,
            "device": ledger.peak("activation"), "traffic": comm.counters_snapshot()}


def main():
    comm = Comm()
    report({"runs": [run(comm, kv, sp, policy) for kv in (2, 1) for sp in (False, True)
                     for policy in ("none", "selective", "full")]})


if __name__ == "__main__":
    main()

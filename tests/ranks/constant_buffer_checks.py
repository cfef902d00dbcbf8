"""Rank side of tests/test_memory.py's constant-size buffer check (ZeRO-R's CB): GPTs of 2, 4
and 8 layers of the same width trained 2 steps at ZeRO stages 0-3, with and without
overlap_comm, on 2 ranks.

    mpiexec -n 2 python tests/ranks/constant_buffer_checks.py

Reports per (layers, stage, overlap) the peak of the ledger's comm_buffer category (buckets,
reduce-scatter parts, staging), the bytes of one rank's gradient shard (what stage 1's reduced
shard holds during a step), the peak of "grad" and what stays of it after the step (stages 2-3:
the shard; the rest is each unit's full gradient in flight), and the parameter count.
"""
from _report import report

from zmpi.comm import Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig

BUCKET = 20_000  # elements: reduce_bucket_size and allgather_bucket_size


def main():
    comm = Comm()
    out = {}
    for layers in (2, 4, 8):
        cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=layers, n_head=2, d_model=64)
        for stage in (0, 1, 2, 3):
            for overlap in (False, True):
                config = {"train_micro_batch_size_per_gpu": 2,
                          "zero_optimization": {"stage": stage, "overlap_comm": overlap,
                                                "reduce_bucket_size": BUCKET,
                                                "allgather_bucket_size": BUCKET}}
                engine = Engine(GPT(cfg, seed=0), config, comm)
                data = SyntheticSource(cfg.vocab_size, cfg.seq_len, 4, comm.rank, comm.size,
                                       seed=1)
                for step in range(2):
                    engine.train_step(*data.sample(step))
                memory = engine.memory
                out[f"L{layers}_stage{stage}_overlap{int(overlap)}"] = {
                    "comm_buffer": memory.peak("comm_buffer"),
                    "shard": engine.layout.shard_numel * engine.dtype.itemsize,
                    "grad_peak": memory.peak("grad"), "grad_now": memory.current("grad"),
                    "params": sum(p.size for p in engine.model.parameters())}
                engine.close()
    report(out)


if __name__ == "__main__":
    main()

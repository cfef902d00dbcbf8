"""Rank side of tests/test_llama.py: a Llama (models/llama.py) trained by the engine at each
(dp, pp, tp) layout given (at dp = world: ZeRO 0-3, optimizer offload to the host, and
optimizer states and parameters on NVMe), in float64, against the same model trained in
one process on the whole batch; then a checkpoint saved at the first tensor-parallel layout
and loaded at (world, 1, 1).

    mpiexec -n 4 python tests/ranks/llama_checks.py 4,1,1,2 2,1,2,1,sp  # dp,pp,tp,kv[,tied][,sp]

(`sparse`: block-sparse attention over SPARSE's per-head layouts, the one process's too.)

Reports per layout and strategy: the largest error of any parameter relative to the move
training made (per tensor and model-wide), the loss difference, whether the replicated
parameters stayed identical on the tensor ranks (engine.check_replicas), this rank's
parameters; and for the checkpoint the largest difference of any parameter after the reload.
"""
import shutil
import tempfile

import numpy as np
from _report import report
from tp_checks import errors

from zmpi.comm import MPI, Comm
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.llama import Llama, LlamaConfig
from zmpi.parallel.mesh import Mesh

BATCH, MICRO_BATCHES, STEPS = 8, 2, 3
# per-head random layouts: tensor rank 1's query heads keep other blocks than rank 0's
SPARSE = {"mode": "bigbird", "block": 2, "num_random_blocks": 1, "num_sliding_window_blocks": 1,
          "num_global_blocks": 1, "different_layout_per_head": True}


def llama_config(n_kv_head, tied=False):
    # 13: a vocabulary padded at tp 2 and 4; 4 blocks: 6 units for the pipeline to split
    return LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=n_kv_head,
                       max_position_embeddings=8, rope_theta=500.0, tie_word_embeddings=tied)


NVME = tempfile.mkdtemp(prefix="zmpi-llama-nvme-")  # this process's drive; removed at the end
STRATEGIES = {  # name: zero_optimization
    **{f"stage{k}": {"stage": k} for k in range(4)},
    "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage3_nvme": {"stage": 3,  # ZeRO-Infinity: optimizer states and parameter shards on NVMe
                    "offload_optimizer": {"device": "nvme", "nvme_path": NVME,
                                          "buffer_size": 1024},
                    "offload_param": {"device": "nvme", "nvme_path": NVME, "buffer_size": 4096,
                                      "buffer_count": 2, "max_in_cpu": 0}},
}


def config(zero, dp, pp, tp, clip, sparse=None):
    return {"train_micro_batch_size_per_gpu": BATCH // (dp * MICRO_BATCHES),
            **({"sparse_attention": sparse} if sparse else {}),
            "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "tensor_parallel": {"autotp_size": tp}, "pipeline": {"stages": pp},
            "zero_optimization": {**zero, "reduce_bucket_size": 500}}


def build(comm, cfg, dp, pp, tp, zero, clip, sp=False, sparse=None):
    mesh = Mesh(comm, tp=tp, pp=pp)
    model = Llama(cfg, seed=0, dtype=np.float64, tp=mesh.tp_comm, sequence_parallel=sp,
                  sparse_attention=sparse)
    settings = config(zero, dp, pp, tp, clip, sparse)
    settings["tensor_parallel"]["sequence_parallel"] = sp
    return mesh, Engine(model, settings, comm, mesh=mesh)


def main():
    import sys

    comm = Comm()
    alone = Comm(MPI.COMM_SELF)
    out = {"runs": {}}
    refs = {}
    saved = None
    for arg in sys.argv[1:]:
        dp, pp, tp, kv, *flags = arg.split(",")
        dp, pp, tp, kv, tied, sp = int(dp), int(pp), int(tp), int(kv), "tied" in flags, \
            "sp" in flags
        sparse = SPARSE if "sparse" in flags else None
        assert dp * pp * tp == comm.size
        cfg = llama_config(kv, tied)
        strategies = STRATEGIES if (pp, tp) == (1, 1) else \
            {k: STRATEGIES[k] for k in ("stage1", "stage3")}
        for k, (name, zero) in enumerate(strategies.items()):
            clip = 0.05 if k % 2 else 0.0  # the norm across split parameters
            key = (kv, tied, name, clip, sparse is not None)
            if key not in refs:
                data = SyntheticSource(cfg.vocab_size, cfg.seq_len, BATCH, 0, 1, seed=1)
                serial = Engine(Llama(cfg, seed=0, dtype=np.float64, sparse_attention=sparse),
                                config(zero, 1, 1, 1, clip, sparse), alone)
                init = serial.gather_parameters()
                losses = [serial.train_step(*data.global_sample(s)) for s in range(STEPS)]
                refs[key] = init, serial.gather_parameters(), losses
                serial.close()
            init, want, want_losses = refs[key]
            mesh, engine = build(comm, cfg, dp, pp, tp, zero, clip, sp, sparse)
            data = SyntheticSource(cfg.vocab_size, cfg.seq_len, BATCH, mesh.dp_rank, dp, seed=1)
            losses = [engine.train_step(*data.sample(s)) for s in range(STEPS)]
            if tp > 1:
                engine.check_replicas()  # raises if a replicated parameter drifted
            got = engine.gather_parameters()
            local = engine.num_params
            if tp > 1 and saved is None:  # a checkpoint of the first tensor-parallel layout
                directory = comm.bcast_object(tempfile.mkdtemp() if comm.rank == 0 else None)
                engine.save_checkpoint(directory, "t")
                saved = (arg, cfg, directory, got)
            engine.close()
            worst, model_move = errors(got, want, init)
            out["runs"][f"{arg}_{name}"] = {
                "tensor_move": worst, "model_move": model_move, "local_params": local,
                "loss_diff": float(np.max(np.abs(np.subtract(losses, want_losses)))),
                "names_match": sorted(got) == sorted(want)}
    if saved is not None:  # load it at (world, 1, 1) with stage 3
        arg, cfg, directory, before = saved
        mesh, engine = build(comm, cfg, comm.size, 1, 1, {"stage": 3}, 0.0)
        engine.load_checkpoint(directory, "t")
        after = engine.gather_parameters()
        engine.close()
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(directory)
        out["checkpoint"] = {"saved_at": arg, "names_match": sorted(after) == sorted(before),
                             "max_diff": max(float(np.abs(after[n] - before[n]).max())
                                             for n in before)}
    shutil.rmtree(NVME)
    report(out)


if __name__ == "__main__":
    main()

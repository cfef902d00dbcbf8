"""Rank side of tests/test_recompute.py: a GPT trained with each activation-recompute policy
("selective", "full") against the same run without recompute, on 2 ranks: data parallel at
ZeRO stages 0-3, tensor parallel (tp 2, with and without sequence parallelism) and pipelined
(pp 2, 1F1B) at stages 1 and 3, fp32; then DeepSpeed's options on the kept inputs
(`OPTIONS`: partitioned over the tensor ranks, on the host, in one buffer, groups of units)
against plain full recompute.

    mpiexec -n 2 python tests/ranks/recompute_checks.py

Reports per (layout, strategy, policy) whether every parameter after 3 steps equals the run
without recompute bit for bit, the largest difference, the losses' and the activation peak;
per option also the peaks of the kept inputs on the device and the host, and of what the
recomputes kept, beside those of plain full recompute; per pipeline schedule the
number_checkpoints refused at pp 2 with 4 micro-batches and the slots the least accepted fills.
"""
import numpy as np
from _report import report

from zmpi.comm import Comm
from zmpi.config import ConfigError
from zmpi.data import SyntheticSource
from zmpi.engine import Engine
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.parallel.mesh import Mesh

CFG = GPTConfig(vocab_size=13, seq_len=8, n_layer=3, n_head=4, d_model=16)
BATCH, STEPS = 8, 3
LAYOUTS = {  # name: (tp, pp, sequence parallel, strategies)
    "dp2": (1, 1, False, (0, 1, 2, 3)), "tp2": (2, 1, False, (1, 3)),
    "tp2_sp": (2, 1, True, (1,)), "pp2": (1, 2, False, (1, 3)),
}
CONTIGUOUS = {"contiguous_memory_optimization": True, "number_checkpoints": 8}
OPTIONS = {  # name: (layout, stage, activation_checkpointing beside recompute "full", interval)
    "tp2_partition": ("tp2", 3, {"partition_activations": True}, 0),
    "dp2_cpu": ("dp2", 3, {"cpu_checkpointing": True}, 0),
    "dp2_contiguous": ("dp2", 2, CONTIGUOUS, 0),
    "dp2_interval2": ("dp2", 3, {}, 2),
    "pp2_interval2_contiguous": ("pp2", 1, CONTIGUOUS, 2),
    "tp2_everything": ("tp2", 1, {"partition_activations": True, "cpu_checkpointing": True,
                                  **CONTIGUOUS, "synchronize_checkpoint_boundary": True,
                                  "profile": True}, 0),
}


def train(comm, tp, pp, sp, stage, policy, options=None, interval=0):
    mesh = Mesh(comm, tp=tp, pp=pp)
    config = {"train_micro_batch_size_per_gpu": BATCH // (mesh.dp * 2),
              "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "tensor_parallel": {"autotp_size": tp, "sequence_parallel": sp},
              "pipeline": {"stages": pp, "activation_checkpoint_interval": interval},
              "activation_checkpointing": {"recompute": policy, **(options or {})},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000}}
    model = GPT(CFG, seed=0, tp=mesh.tp_comm, sequence_parallel=sp)
    engine = Engine(model, config, comm, mesh=mesh)
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, BATCH, mesh.dp_rank, mesh.dp, seed=1)
    losses = [engine.train_step(*data.sample(s)) for s in range(STEPS)]
    params = engine.gather_parameters()
    peak = engine.memory.peak("activation")
    peaks = {"saved_device": engine.memory.peak("saved_input", "device"),
             "saved_host": engine.memory.peak("saved_input", "host"),
             "recompute": engine.memory.peak("recompute"),
             "timed_units": len(engine.model.saved_inputs.recompute_seconds)}
    engine.close()
    return params, losses, peak, peaks


def slot_limits(comm, schedule, micro_batches=4):
    """activation_checkpointing.number_checkpoints at pp 2 under `schedule`: the message for 1
    slot (it gives the layout's least, N) and for N - 1, both refused as the engine is built;
    then 2 steps with N slots, and the most slots this rank's store held at once."""
    def build(slots):
        mesh = Mesh(comm, pp=2)
        return Engine(GPT(CFG, seed=0), {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro_batches,
            "pipeline": {"stages": 2, "schedule": schedule},
            "activation_checkpointing": {"recompute": "full",
                                         "contiguous_memory_optimization": True,
                                         "number_checkpoints": slots}}, comm, mesh=mesh)

    def refused(slots):
        try:
            build(slots).close()
        except ConfigError as e:
            return str(e)
        return None

    out = {"one": refused(1)}
    least = int(out["one"].rsplit("give ", 1)[1].split()[0])
    out["fewer"] = refused(least - 1) if least > 1 else None
    engine = build(least)
    store, used = engine.model.saved_inputs, [0]
    take = store._take_slot

    def counting(nbytes):  # the slots in use once this one is taken
        slot = take(nbytes)
        used[0] = max(used[0], len(store._used) + 1)
        return slot

    store._take_slot = counting
    data = SyntheticSource(CFG.vocab_size, CFG.seq_len, micro_batches, 0, 1, seed=1)
    out["losses"] = [engine.train_step(*data.sample(s)) for s in range(2)]
    out.update(least=least, used=used[0], stage=engine.mesh.pp_rank)
    engine.close()
    return out


def compare(got, want):
    """What the report says of a run against the one it must equal."""
    return {"equal": all(np.array_equal(got[0][n], w) for n, w in want[0].items()),
            "largest": max(float(np.abs(got[0][n] - w).max()) for n, w in want[0].items()),
            "losses_equal": got[1] == want[1], "peak": got[2], "peak_none": want[2]}


def main():
    comm = Comm()
    out = {}
    for name, (tp, pp, sp, stages) in LAYOUTS.items():
        for stage in stages:
            want = train(comm, tp, pp, sp, stage, "none")
            for policy in ("selective", "full"):
                out[f"{name}_stage{stage}_{policy}"] = compare(
                    train(comm, tp, pp, sp, stage, policy), want)
    options = {}
    for name, (layout, stage, keys, interval) in OPTIONS.items():
        tp, pp, sp, _ = LAYOUTS[layout]
        want = train(comm, tp, pp, sp, stage, "none")
        full = train(comm, tp, pp, sp, stage, "full")
        got = train(comm, tp, pp, sp, stage, "full", keys, interval)
        options[name] = {**compare(got, want), "peaks": got[3], "peaks_full": full[3]}
    slots = {schedule: slot_limits(comm, schedule) for schedule in ("1f1b", "gpipe")}
    report({**out, "options": options, "slots": slots})


if __name__ == "__main__":
    main()

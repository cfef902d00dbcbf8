"""zmpi.plan: choose the parallel layout, ZeRO stage, offload, recompute and micro-batch of a
GPT for a cluster, from the formulas the ledger and the counters are checked against.

    hardware.py  Hardware: peak rates, memories, links; presets; JSON files
    measure.py   load_hardware (a preset, a file, "this"); this machine measured
    layout.py    Job (model, batch, cluster), Layout (one candidate), layouts(), to_config()
    memory.py    the bytes one rank of each pipeline stage needs (model states exactly)
    time.py      the predicted step time (compute, tensor, pipeline, bubble, data, optimizer)
    search.py    plan(): every layout that fits, fastest first

`zmpi plan` (zmpi/cli/plan.py) is the command; docs/plan.md the model and its validation.
"""

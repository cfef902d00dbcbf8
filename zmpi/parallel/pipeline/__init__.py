"""Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021).

    partition.py  which units each of P stages holds: balanced by parameters, by count, or
                  by unit type (DeepSpeed's partition_method)
    schedule.py   the order in which a stage runs forward and backward of m micro-batches
                  (GPipe, 1F1B), and a timeline of a schedule from unit times: bubble and
                  activations in flight
    stage.py      one stage of a UnitModel as a UnitModel (held copies of weights tied across
                  stages)
    executor.py   runs a stage's schedule, activations and gradients point-to-point between
                  neighbouring stages

The engine (zmpi/engine/pipeline.py) cuts the model into its stage when `pipeline.stages` is
above 1, and sums tied weights' gradients over the stages holding them. partition.py and
schedule.py import nothing else of zmpi (the config reads their names).
"""

"""Pipeline parallelism (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021): the parts
that are plain data, with no MPI.

    partition.py  which units each of P stages holds: balanced by parameters, by count, or
                  by unit type (DeepSpeed's partition_method)
    schedule.py   the order in which a stage runs forward and backward of m micro-batches
                  (GPipe, 1F1B), and a timeline of a schedule from unit times: bubble and
                  activations in flight

The executor (point-to-point activations through the mesh's `pp_comm`, composition with ZeRO)
is not built yet: `pipeline.stages` above 1 is refused by the config.
"""

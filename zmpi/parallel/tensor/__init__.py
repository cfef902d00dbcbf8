"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with explicit forward and backward.

    regions.py   f (identity forward, allreduce backward) and g (allreduce forward, identity
                 backward): where a tensor-parallel region begins and ends; with sequence
                 parallelism, g-bar (allgather / reduce-scatter along the sequence) and g
                 (reduce-scatter / allgather)
    linear.py    ColumnParallelLinear (weight split by output features) and RowParallelLinear
                 (split by input features)
    vocab.py     the vocabulary-parallel embedding and cross-entropy (the (B, T, V) logits are
                 never gathered)

Every layer takes the mesh's tensor-parallel Comm (`mesh.tp_comm`) and communicates only
through it, so its traffic is counted in the "tp" dimension. Like zmpi.nn, nothing here
imports MPI.
"""

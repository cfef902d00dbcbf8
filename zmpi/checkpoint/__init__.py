"""Sharded HDF5 checkpoints: exact resume, reshape to any world size and strategy, offline tools.

    engine.save_checkpoint("ckpt")                    # a collective; tag "step<N>"
    engine.save_checkpoint("ckpt", async_=True)       # written in the background
    loaded = engine.load_checkpoint("ckpt")           # a collective; the tag `latest` names
    loaded.client_state                               # what the saver passed along

    zmpi ckpt inspect ckpt                            # offline, no MPI
    zmpi ckpt verify ckpt
    zmpi ckpt consolidate ckpt model.h5               # one file of full fp32 tensors

`store` is the on-disk format (files, shards, ranged reads), `manifest` the manifest and its
checks, `ownership` which run may write a directory and what its retention may delete,
`sharded` the collective save and load (`Checkpointer`, on an engine's `TrainState`),
`agreement` the ranks agreeing on each step's outcome and the fallback to an older checkpoint,
`tools` the offline inspection, verification and consolidation.
"""
from zmpi.checkpoint.store import CheckpointError

__all__ = ["CheckpointError"]

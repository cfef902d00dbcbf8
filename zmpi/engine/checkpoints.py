"""An engine's checkpoints: `EngineCheckpoints`, the Engine's methods for them
(save_checkpoint, claim_checkpoint_dir, load_checkpoint, run_id). Each hands the engine's
`TrainState` (state.py) to its Checkpointer (`engine.checkpoints`,
zmpi.checkpoint.sharded), which never sees the engine itself.
"""
from __future__ import annotations

from zmpi.engine.state import TrainState


class EngineCheckpoints:
    """The Engine's checkpoint methods (a mixin: uses its `checkpoints`, a Checkpointer)."""

    def save_checkpoint(self, directory, tag=None, keep_last=None, async_=False,
                        client_state=None):
        """Save the whole training state under directory/tag (default tag `step<N>`, N the
        global step) and point directory/latest at it. A collective: every rank calls it with
        the same arguments and writes its shard; returns the checkpoint's directory.

        The first save into a directory claims it for this run (`claim_checkpoint_dir`).
        keep_last=K deletes all but the K newest of this run's complete checkpoints in
        `directory`, after the new one is complete (never another run's). async_=True copies
        this rank's state to host buffers and writes it in a background thread; the checkpoint
        is completed (manifest, `latest`) at the first train_step after every rank finished
        writing, or at the next save, load or close, where an error in the writer is raised.
        client_state: a JSON-serialisable dict stored with the checkpoint (rank 0's), e.g. the
        data position; load returns it. A CheckpointError is raised on every rank if any rank
        fails; `latest` and the earlier checkpoints are then as they were."""
        return self.checkpoints.save(TrainState(self), directory, tag, keep_last, async_,
                                     client_state)

    def claim_checkpoint_dir(self, directory, overwrite=False):
        """Make `directory` this run's to save into, until close() (a collective; the first
        save does it anyway, `zmpi train` at start-up). Refused with a CheckpointError on every
        rank if another process holds it, a rank cannot write there, or it holds another
        run's checkpoints; with overwrite=True those are deleted once this run's first
        checkpoint is complete. Returns the claim (its `notes` say what was repaired)."""
        return self.checkpoints.claim(directory, overwrite)

    def load_checkpoint(self, directory, tag=None, verify=True, fallback=False):
        """Restore the whole training state from directory/tag (default: the tag `latest`
        names), saved at any world size and by any strategy. A collective. Every file read is
        checked against the manifest (size, and CRC-32 unless verify=False) and HDF5's
        Fletcher-32; any problem raises a CheckpointError on every rank that names the file,
        and the engine is left as it was. fallback=True (with no tag): if the newest
        checkpoint does not load, the newest one that does (the notes say so). The engine
        continues the run that saved the checkpoint (its run id). Returns a `Loaded` (tag,
        step, client_state and notes on what differs from this engine's config)."""
        return self.checkpoints.load(TrainState(self), directory, tag, verify, fallback)

    @property
    def run_id(self) -> str:
        """The run this engine trains: a new one per engine, or the one of the checkpoint it
        loaded. Every checkpoint it saves records it (zmpi.checkpoint.ownership)."""
        return self.checkpoints.run_id

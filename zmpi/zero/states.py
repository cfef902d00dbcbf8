"""The model states as this rank's owned shard, whatever the policy: what checkpoints save
and load, the whole master model for consolidation, and Adam's step on them.

`StateShards` is a mixin of `Strategy` (strategy.py). It works from the three sharding flags
and the buffers alone, so every policy inherits it; it collects with `self.owned`, and
scatters a replicated state back with `self.allgather_shard_into` (a collective). With the
optimizer state on NVMe (`self.nvme`, zmpi.offload.nvme), `master`, `adam_m` and `adam_v` are
SwappedState handles: slices read from the file, `[...] =` writes it, block by block.
"""
from __future__ import annotations

import numpy as np

from zmpi import backend


class StateShards:
    """Every model state as this rank's owned shard (a mixin of Strategy)."""

    def state_buffer(self, state: str):
        """(buffer, whether it holds only the owned shard) of 'params', 'master', 'adam_m'
        or 'adam_v'."""
        if state == "params":
            return ((self.params_shard, True) if self.shard_parameters
                    else (self.params_full, False))
        if state not in ("master", "adam_m", "adam_v"):
            raise ValueError(f"unknown model state {state!r}")
        return getattr(self, state), self.shard_optimizer

    def state_shard(self, state: str):
        """This rank's owned shard (S,) of a model state: the buffer itself when the policy
        shards that state, else the owned slices of the full buffer (a copy)."""
        buf, sharded = self.state_buffer(state)
        return buf if sharded else self.owned(buf)

    def set_state_shard(self, state: str, shard) -> None:
        """Inverse of `state_shard`: write `shard` (S, host or device) into the state's buffer.
        A collective when the policy replicates the state (each unit is allgathered in place
        from every rank's owned part): every rank calls it with the same `state`."""
        buf, sharded = self.state_buffer(state)
        if sharded:
            backend.copy_(buf, shard)
        else:
            self.allgather_shard_into(buf, shard)

    def optimizer_step(self, optimizer, grads, grad_scale, clip_coef, publish=None,
                       advance=True) -> None:
        """One step of `optimizer` (zmpi.optim.Adam) on this rank's master weights and
        moments from `grads` (optimizer_grads()), as Adam.step_ takes them; on NVMe, streamed
        through the swap buffers (it then writes every publish target, host or device).
        advance=False: the optimizer's step count was advanced already this step (a second
        set of states of the same step: the expert strategy, zmpi.engine.moe)."""
        if self.nvme is not None:
            self.nvme.step(optimizer, grads, grad_scale, clip_coef, publish, advance)
        else:
            (optimizer.step_ if advance else optimizer.update_)(
                self.master, grads, self.adam_m, self.adam_v, grad_scale, clip_coef,
                publish=publish)

    def close_storage(self) -> None:
        """Remove the files of the NVMe tier, if any (engine.close()); the states are gone."""
        for store in (self.nvme, self.param_store):
            if store is not None:
                store.close()

    def full_master(self):
        """The master weights of the whole model in the full layout (P), on every rank, in
        host memory: the shard is copied to the host once and gathered there, so the device
        never holds the whole fp32 model."""
        if not self.shard_optimizer:
            return backend.to_host(self.master)
        shard = backend.to_host(self.master)
        full = np.empty(self.layout.full_numel, self.master_dtype)
        for u in range(len(self.units)):
            self.comm.allgather(shard[self.layout.shard_slice(u)], full[self.layout.full_slice(u)])
        return full

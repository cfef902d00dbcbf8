"""What a partition strategy declares: its process groups, the settings the shared test
suite runs it with, the communicators it sends on, and the model-state bytes and traffic it
must measure (tests/test_zero.py checks both against the ledger and Comm's counters).

`Declarations` is a mixin of `Strategy` (strategy.py); a policy overrides what differs from
these defaults (hybrid.py: `process_groups`, `suite_configs`, `expected_traffic`). It reads
the sharding flags, `self.layout`, `self.comm`, `self.replica`, the dtypes and the offload
settings.
"""
from __future__ import annotations

from zmpi.config import ConfigError
from zmpi.memory import held_model_state, ring_bytes


class Declarations:
    """Process groups and what the policy holds and sends (a mixin of Strategy)."""

    @classmethod
    def process_groups(cls, comm, zero_config):
        """(shard group, replica group) of this rank, as Comms: the ranks the model states are
        partitioned over (the layout is built for its size), and the ranks that hold the same
        shard (None: no replication). Called by the engine, collectively, before the layout
        exists. Default: the whole world shards, nothing is replicated."""
        if zero_config.shard_group_size is not None:
            raise ConfigError("zero_optimization.shard_group_size",
                              f"strategy {cls.name!r} does not split the ranks into groups; "
                              "shard_group_size is for the hybrid strategies")
        return comm, None

    @classmethod
    def suite_configs(cls, world_size: int) -> list[dict]:
        """The `zero_optimization` settings (beyond "strategy") the shared test suite runs this
        policy with at `world_size` ranks (tests/test_zero.py): by default its defaults."""
        return [{}]

    def comms(self) -> dict:
        """{group kind: Comm} of every communicator this policy sends on (for its counters)."""
        if self.replica is None:
            return {"world": self.comm}
        return {"shard": self.comm, "replica": self.replica}

    @property
    def writes_checkpoint(self) -> bool:
        """Whether this rank writes its shard to a checkpoint (one replica of each shard)."""
        return self.replica is None or self.replica.rank == 0

    def ring_bytes(self, numel: int, passes: int = 1, comm=None) -> int:
        """Bytes this rank sends for `passes` ring passes over `numel` storage-dtype elements
        on `comm` (default: the shard group): passes * B (n-1)/n, as Comm counts them."""
        return ring_bytes(numel * self.dtype.itemsize, (comm or self.comm).size, passes)

    def expected_traffic(self) -> dict[str, int]:
        """{group kind (as `comms`): bytes this rank sends} in one optimizer step without
        gradient accumulation, under the ring model Comm counts. Every policy declares it:
        the shared test suite checks it against the counters."""
        raise NotImplementedError(f"strategy {self.name!r} does not declare expected_traffic()")

    def expected_model_state(self) -> dict[str, dict[str, int]]:
        """{"device"|"host": {category: bytes}} of the model states (zmpi.memory.MODEL_STATE)
        this rank holds between steps: what the ledger must measure (the shared test suite
        checks). Derived from the flags and the offload settings; a policy that keeps more
        overrides it. On NVMe the host holds of the master and moments only their
        `max_in_cpu` part and the swap buffers (zmpi.offload.nvme)."""
        held = held_model_state(
            self.layout.full_numel, self.layout.shard_numel, self.dtype.itemsize,
            self.master_dtype.itemsize, self.shard_optimizer, self.shard_gradients,
            self.shard_parameters, self.offload_optimizer, self.offload_param,
            self.grads_spare is not None)
        for store in (self.nvme, self.param_store):  # what the NVMe tiers keep on the host
            if store is not None:
                held["host"].update(store.host_bytes())
        return held

"""Stage 1: optimizer-state partitioning (ZeRO P_os; Rajbhandari et al., SC'20, Sec. 5.1).

Each rank keeps full fp16 parameters and gradients but only its 1/N shard of the fp32 master
weights and Adam moments. Backward accumulates full gradients locally; at the step the
gradient is reduce-scattered (in buckets of `reduce_bucket_size` elements of consecutive units)
so a rank receives the summed gradient of the shard it updates, then the updated shards are
allgathered into every rank's parameters (buckets of `allgather_bucket_size`).
Traffic per step: reduce-scatter Psi + allgather Psi = 2 Psi (N-1)/N per rank.
"""
from zmpi.zero.strategy import Strategy, register


@register("stage1")
class Stage1(Strategy):
    shard_optimizer = True

    @classmethod
    def suite_configs(cls, world_size):  # defaults, and buckets of a few units
        return [{}, {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000}]

    def before_step(self):
        if not self.offload_optimizer:
            # The reduced shard lives only for the step: a step-time buffer, not model state
            # (zero_grads releases it, also when the step raised). Offload keeps it on the host.
            self.grads_shard = self.alloc(self.layout.shard_numel, self.dtype, "comm_buffer",
                                          "rs", zero=False)  # the reduce-scatter writes it
        for units in self.buckets(self.config.reduce_bucket_size):
            packed = self.pack(units, self.grads_full)
            self.reduce_scatter_to_shard(units, packed, accumulate=False,
                                         free=(packed,) if len(units) > 1 else ())
        self.wait_pending()

    def publish_params(self):
        self.publish_sharded_params()

    def expected_traffic(self):  # reduce-scatter + allgather of the model
        return {"world": self.ring_bytes(self.layout.full_numel, passes=2)}

    def zero_grads(self):
        super().zero_grads()
        if not self.offload_optimizer and self.grads_shard is not None:
            self.ledger.release(self.grads_shard)
            self.grads_shard = None

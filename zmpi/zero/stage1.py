"""Stage 1: optimizer-state partitioning (ZeRO P_os; Rajbhandari et al., SC'20, Sec. 5.1).

Each rank keeps full fp16 parameters and gradients but only its 1/N shard of the fp32 master
weights and Adam moments. Backward accumulates full gradients locally; on the micro-step that
ends a gradient accumulation each bucket of units (`Strategy.buckets`, `reduce_bucket_size`)
is reduce-scattered as soon as backward has produced it, so a rank receives the summed gradient
of the shard it updates. After Adam the updated shards are allgathered into every rank's
parameters (buckets of `allgather_bucket_size`).
Traffic per step: reduce-scatter Psi + allgather Psi = 2 Psi (N-1)/N per rank.
"""
from zmpi.zero.registry import register
from zmpi.zero.strategy import Strategy


@register("stage1")
class Stage1(Strategy):
    shard_optimizer = True

    @classmethod
    def suite_configs(cls, world_size):  # defaults, and buckets of a few units
        return [{}, {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000}]

    def after_backward(self, u):
        units = self.reduce_bucket_from(u)
        if units is None or not self.sync_gradients:
            return
        if self.grads_shard is None:
            # The reduced shard lives only for the step: a step-time buffer, not model state
            # (zero_grads releases it, also when the step raised). Offload keeps it on the host.
            self.grads_shard = self.alloc(self.layout.shard_numel, self.dtype, "comm_buffer",
                                          "rs", zero=False)  # the reduce-scatters write it all
        packed = self.pack(units, self.grads_full)
        self.reduce_scatter_to_shard(units, packed, accumulate=False,
                                     free=(packed,) if len(units) > 1 else ())

    def publish_targets(self):
        return self.sharded_publish_targets()

    def publish_params(self):
        self.publish_sharded_params()

    def expected_traffic(self):  # reduce-scatter + allgather of the model
        return {"world": self.ring_bytes(self.layout.full_numel, passes=2)}

    def zero_grads(self):
        if not self.offload_optimizer and self.grads_shard is not None:
            self.ledger.release(self.grads_shard)
            self.grads_shard = None
        super().zero_grads()

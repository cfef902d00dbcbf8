"""Stage 2: + gradient partitioning (ZeRO P_os+g; Rajbhandari et al., SC'20, Sec. 5.2).

Parameters stay whole on every rank. A unit's full gradient exists only from its backward until
it is reduce-scattered right after (every micro-step: gradient accumulation adds into the owned
shard); the rank then frees it, keeping the 1/N shard it updates. After Adam the updated
parameter shards are allgathered. Traffic per step: 2 Psi (N-1)/N per rank, as stage 1.
"""
from zmpi.zero.registry import register
from zmpi.zero.strategy import Strategy


@register("stage2")
class Stage2(Strategy):
    shard_optimizer = True  # master + Adam m, v: 1/N per rank
    shard_gradients = True  # a unit's full gradient lives only during its backward

    def before_backward(self, u):
        self.ensure_unit_grads(u)  # a zeroed full gradient buffer for unit u

    def after_backward(self, u):
        self.reduce_scatter_unit_grads(u)  # sum, keep this rank's shard, free the rest

    def publish_targets(self):  # Adam writes each updated shard into params_full's slice
        return self.sharded_publish_targets()

    def publish_params(self):
        self.publish_sharded_params()  # master shard -> params, allgather

    def expected_traffic(self):  # reduce-scatter + allgather of the model
        return {"world": self.ring_bytes(self.layout.full_numel, passes=2)}

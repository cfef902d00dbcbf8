"""Stage 0: plain data parallelism (DDP; Li et al., VLDB'20). Nothing is sharded.

Every rank keeps all parameters, gradients and optimizer state. Gradients are summed with
allreduce in buckets (`Strategy.buckets`: at most `reduce_bucket_size` elements of consecutive
units, a large unit alone), each a contiguous range of the model-wide gradient buffer,
launched as soon as backward has produced its last unit (non-blocking when `overlap_comm`),
and only on the micro-step that ends a gradient accumulation. Traffic per step: one allreduce
of Psi, i.e. 2 Psi (N-1)/N per rank on a ring.
"""
from zmpi import backend
from zmpi.zero.registry import register
from zmpi.zero.strategy import Strategy


@register("stage0")
class Stage0(Strategy):
    def after_backward(self, u):
        units = self.reduce_bucket_from(u)
        if units is not None and self.sync_gradients:
            self._launch(self.comm.iallreduce(self.grads_full[self._bucket_full(units)]))

    def publish_targets(self):
        return self._hand_out([(0, self.params_full)])

    def publish_params(self):
        if not self._take_written():
            backend.copy_(self.params_full, self.master)

    def expected_traffic(self):
        return {"world": self.ring_bytes(self.layout.full_numel, passes=2)}  # one allreduce

"""Stage 0: plain data parallelism (DDP; Li et al., VLDB'20). Nothing is sharded.

Every rank keeps all parameters, gradients and optimizer state. Gradients are summed with
allreduce in buckets of about `reduce_bucket_size` elements: a bucket is a contiguous range of
whole units of the model-wide gradient buffer, launched as soon as backward has produced its
last unit (non-blocking when `overlap_comm`), and only on the micro-step that ends a gradient
accumulation. Traffic per step: one allreduce of Psi, i.e. 2 Psi (N-1)/N per rank on a ring.
"""
from zmpi import backend
from zmpi.zero.strategy import Strategy, register


@register("stage0")
class Stage0(Strategy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Buckets built from the last unit backwards (the order backward produces gradients);
        # each is launched by the after_backward of its first unit in forward order.
        self._bucket_starting_at = {}
        stop, size = len(self.units), 0
        for u in reversed(range(len(self.units))):
            size += self.layout.units[u].padded_numel
            if size >= self.config.reduce_bucket_size or u == 0:
                self._bucket_starting_at[u] = slice(self.layout.full_offsets[u],
                                                    self.layout.full_offsets[stop])
                stop, size = u, 0

    def after_backward(self, u):
        bucket = self._bucket_starting_at.get(u)
        if bucket is not None and self.sync_gradients:
            self._launch(self.comm.iallreduce(self.grads_full[bucket]))

    def publish_params(self):
        backend.copy_(self.params_full, self.master)

    def expected_traffic(self):
        return {"world": self.ring_bytes(self.layout.full_numel, passes=2)}  # one allreduce

"""Stage 3: + parameter partitioning (ZeRO P_os+g+p; Rajbhandari et al., SC'20, Sec. 5.3).

A rank keeps only its 1/N shard of every model state. A unit's parameters are allgathered just
before its forward and again before its backward, and released right after each (units whose
weights are tied are gathered with the unit that reads them). With `prefetch` the allgather of
the next unit is started before the current one computes. Gradients are reduce-scattered
unit by unit as in stage 2. Adam writes the owned parameter shard directly: nothing to gather
after the step. Traffic per step: 2 allgathers + 1 reduce-scatter = 3 Psi (N-1)/N per rank.
"""
from zmpi import backend
from zmpi.zero.strategy import Strategy, register


@register("stage3")
class Stage3(Strategy):
    shard_optimizer = True
    shard_gradients = True
    shard_parameters = True

    def _gather_and_prefetch(self, u, next_u):
        for w in self.needs(u):
            self.gather(w)
        if self.config.prefetch and 0 <= next_u < len(self.units):
            for w in self.needs(next_u):
                self.gather(w, wait=False)

    def _release(self, u):
        for w in self.needs(u):
            if w in self._gathered:
                self.release(w)

    def before_forward(self, u):
        self._gather_and_prefetch(u, u + 1)

    def after_forward(self, u):
        self._release(u)

    def before_backward(self, u):
        self._gather_and_prefetch(u, u - 1)
        self.ensure_unit_grads(u)

    def after_backward(self, u):
        self.reduce_scatter_unit_grads(u)
        self._release(u)

    def publish_params(self):
        backend.copy_(self.params_shard, self.master)  # host -> device when offloaded

    def expected_traffic(self):
        # Allgather in forward and in backward, reduce-scatter once; a unit that reads another's
        # weights (GPT's LM head) gathers that unit once more in each pass.
        tied = sum(self.layout.units[w].padded_numel for u in range(len(self.units))
                   for w in self.needs(u)[1:])
        return {"world": self.ring_bytes(3 * self.layout.full_numel + 2 * tied)}

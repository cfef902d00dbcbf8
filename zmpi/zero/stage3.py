"""Stage 3: + parameter partitioning (ZeRO P_os+g+p; Rajbhandari et al., SC'20, Sec. 5.3).

A rank keeps only its 1/N shard of every model state. A unit's parameters are allgathered just
before its forward and again before its backward, and released right after each (units whose
weights are tied are gathered with the unit that reads them). Prefetch starts the allgather of
the next units before the current one computes: one unit with `prefetch`, or as many as fit
in `stage3_prefetch_bucket_size` elements. Units of at most
`stage3_param_persistence_threshold` elements are *persistent*, as in DeepSpeed and FSDP: kept
gathered for the whole run and refreshed by one allgather after each step, instead of two per
step, for the memory of their full parameters. Gradients are reduce-scattered unit by unit as
in stage 2. Adam writes the owned parameter shard directly: nothing else to gather after the
step. Traffic per step: 2 allgathers + 1 reduce-scatter = 3 Psi (N-1)/N per rank (persistent
units: 1 allgather).
"""
from collections import Counter

from zmpi import backend
from zmpi.config import ConfigError
from zmpi.zero.registry import register
from zmpi.zero.strategy import Strategy


@register("stage3")
class Stage3(Strategy):
    shard_optimizer = True
    shard_gradients = True
    shard_parameters = True

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, units = self.config, range(len(self.units))
        self._persistent = {u for u in units
                            if self.layout.units[u].numel <= cfg.stage3_param_persistence_threshold}
        self._ahead = {step: [self._prefetch_window(u, step) for u in units] for step in (1, -1)}
        self._check_live_limit()

    @classmethod
    def suite_configs(cls, world_size):  # defaults, and persistent units with a wide prefetch
        return [{}, {"stage3_param_persistence_threshold": 500,
                     "stage3_prefetch_bucket_size": 10_000}]

    def _prefetch_window(self, u, step):
        """Units whose allgather starts with unit u's (the next ones in `step` direction)."""
        if not self.config.prefetch:
            return []
        budget = self.config.stage3_prefetch_bucket_size
        window, size, v = [], 0, u + step
        while 0 <= v < len(self.units):
            size += self.layout.units[v].padded_numel
            if (budget is None and window) or (budget is not None and size > budget):
                break
            window.append(v)
            v += step
        return window

    def _check_live_limit(self):
        limit = self.config.stage3_max_live_parameters
        if limit is None:
            return
        padded = [u.padded_numel for u in self.layout.units]
        live = max(sum(padded[w] for w in {*self._persistent, *self.needs(u),
                                           *(x for v in self._ahead[step][u]
                                             for x in self.needs(v))})
                   for u in range(len(self.units)) for step in (1, -1))
        if live > limit:
            raise ConfigError("zero_optimization.stage3_max_live_parameters",
                              f"zmpi keeps up to {live} parameter elements gathered at once (a "
                              f"unit with its tied and prefetched units, and the persistent "
                              f"ones), more than {limit}; raise it, or lower "
                              "stage3_prefetch_bucket_size or "
                              "stage3_param_persistence_threshold")

    def initialize(self, initial):
        super().initialize(initial)
        for u in self._persistent:
            self.gather(u)

    def _gather_and_prefetch(self, u, step):
        for w in self.needs(u):
            self.gather(w)
        for v in self._ahead[step][u]:
            for w in self.needs(v):
                self.gather(w, wait=False)

    def _release(self, u):
        for w in self.needs(u):
            if w in self._gathered and w not in self._persistent:
                self.release(w)

    def _refresh_persistent(self):
        """The persistent units' gathered parameters from the (updated) shards."""
        for u in self._persistent:
            self._launch(self.iallgather_shard(u, self._gathered[u][0]))
        self.wait_pending()

    def before_forward(self, u):
        self._gather_and_prefetch(u, 1)

    def after_forward(self, u):
        self._release(u)

    def before_recompute(self, u):  # gathered for its forward, prefetching nothing: the
        for w in self.needs(u):     # units after it have run their backward already
            self.gather(w)

    def after_recompute(self, u):
        self._release(u)

    def before_backward(self, u):
        self._gather_and_prefetch(u, -1)
        self.ensure_unit_grads(u)

    def after_backward(self, u):
        self.reduce_scatter_unit_grads(u)
        self._release(u)

    def publish_targets(self):
        if self.param_store is not None:  # written unit by unit in publish_params
            return None
        return self._hand_out([(0, self.params_shard)])

    def publish_params(self):
        if not self._take_written():
            backend.copy_(self.params_shard, self.master)  # host -> device when offloaded
        self._refresh_persistent()

    def set_state_shard(self, state, shard):
        super().set_state_shard(state, shard)
        if state == "params":
            self._refresh_persistent()

    def expected_model_state(self):
        held = super().expected_model_state()
        held["device"]["param"] += sum(self.layout.units[u].padded_numel
                                       for u in self._persistent) * self.dtype.itemsize
        return held

    def expected_traffic(self):
        # A unit is allgathered in forward and in backward for each unit that reads it (itself,
        # and e.g. GPT's LM head reading the embedding), a persistent unit once after the step;
        # every unit is reduce-scattered once.
        reads = Counter(w for u in range(len(self.units)) for w in self.needs(u))
        gathered = sum(self.layout.units[w].padded_numel * (1 if w in self._persistent
                                                            else 2 * reads[w])
                       for w in range(len(self.units)))
        return {"world": self.ring_bytes(gathered + self.layout.full_numel)}

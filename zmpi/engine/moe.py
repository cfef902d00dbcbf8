"""The engine's side of mixture-of-experts layers (zmpi.nn.moe.MoE) at expert-parallel degree 1:
what each layer must be told before a micro-batch's forward, and the losses it adds.

    routing = MoERouting(model)   the model's MoE layers (none: every call is a no-op)
    check_moe(config, mesh, model, routing)
                        ConfigError unless the model's MoE blocks are the config's `moe`
    routing.before(step, first_row, scale, inputs)
                        before a micro-batch's forward: training on, the routing key (step,)
                        and the global index of the micro-batch's first routing group, and
                        aux_loss_scale = scale (the loss scale the main loss's gradient gets)
    routing.losses()    the auxiliary and z losses of the last forward, summed over the
                        layers (coefficients included): added to the reported loss

Why this routes as one process: a routing group is one sequence, so the group of global row r
of the step's batch is r, whatever the data-parallel size and the micro-batches (rank d holds
rows [d b, (d + 1) b) of it, b = micro-batch x accumulation, as zmpi.data's samplers give them;
micro-batch i of rank d starts at row d b + i m). Each group's random draws depend only on the
layer's seed, the key (step,) and that index, and its capacity only on its own tokens; the
forward that full recompute repeats reads the same key and offset. The auxiliary and z losses
are means over a micro-batch's groups and tokens, and the engine divides every gradient by
(loss scale x ranks x micro-batches): the mean over the step's groups, one process's.

The expert parameters are ordinary parameters of their block's unit: the strategy shards,
reduces, clips and loss-scales them with the rest (at ep 1 every rank holds every expert).
"""

from __future__ import annotations

from zmpi.nn.moe import MoE


class MoERouting:
    """The MoE layers of `model` (every zmpi.nn.moe.MoE module in it), told what to route."""

    def __init__(self, model):
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]

    def before(self, step: int, first_row: int, scale: float, inputs) -> None:
        """Before the forward of `inputs` (one row a sequence), global rows from `first_row` of
        optimizer step `step`'s batch, whose loss's gradient is multiplied by `scale`.
        ValueError, alike on every rank and before the micro-batch's first collective, if a
        layer's routing groups (group_size tokens) do not tile a sequence."""
        for layer in self.layers:
            tokens = inputs[0].size  # a row's tokens
            size = tokens if layer.group_size is None else layer.group_size
            if tokens % size:
                raise ValueError(f"an MoE layer's routing groups of group_size={size} tokens "
                                 f"do not tile sequences of {tokens} tokens")
            layer.training = True
            layer.set_routing((step,), first_row * (tokens // size))
            layer.aux_loss_scale = scale

    def losses(self):
        """The auxiliary and z losses of the layers' last forward, summed (0 without MoE
        layers): 0-d arrays where they were computed, no device sync."""
        total = 0.0
        for layer in self.layers:
            total = total + layer.aux_loss + layer.z_loss
        return total


def check_moe(config, mesh, model, routing: MoERouting) -> None:
    """ConfigError unless the model's MoE blocks are the config's `moe` section (a model with
    a `moe` attribute, the GPT, built from an equal section; any other model only with an
    empty one), and the mesh has neither tensor nor pipeline parallelism where the model has
    MoE layers (not built yet)."""
    from zmpi.config import ConfigError

    want = config.moe if config.moe.enabled else None
    built = getattr(model, "moe", None)
    if built != want and (want is not None or built is not None):
        raise ConfigError("moe", (
            f"the config gives {config.moe.to_dict()} but the model was built with "
            f"{'no MoE' if built is None else built.to_dict()}" if want is not None else
            f"the config has none but the model was built with {built.to_dict()}")
            + "; build it as GPT(..., moe=config['moe']) from the same section")
    if routing.layers and mesh.tp > 1:
        raise ConfigError("tensor_parallel.autotp_size", f"{mesh.tp}: MoE layers are not split "
                          "by tensor parallelism yet (docs/moe.md)")
    if routing.layers and mesh.pp > 1:
        raise ConfigError("pipeline.stages", f"{mesh.pp}: MoE layers are not run by the "
                          "pipeline schedules yet (docs/moe.md)")

"""The engine's side of mixture-of-experts layers (zmpi.nn.moe.MoE): what each layer must be
told before a micro-batch's forward, the losses it adds, and at expert-parallel degree > 1 the
expert parameters' own partition.

    routing = MoERouting(model)   the model's MoE layers (none: every call is a no-op)
    check_moe(config, mesh, model)
                        ConfigError unless the model's MoE blocks are the config's `moe`
    routing.before(step, first_row, scale, inputs)
                        before a micro-batch's forward: training on, the routing key (step,)
                        and the global index of the micro-batch's first routing group, and
                        aux_loss_scale = scale (the loss scale the main loss's gradient gets)
    routing.losses()    the auxiliary and z losses of the last forward, summed over the
                        layers (coefficients included): added to the reported loss
    routing.with_losses(loss)
                        loss + losses(), or loss alone without MoE layers (no launch)
    routing.tally()     after a micro-batch's training forward: its routing counted into the
                        expert load and drops
    routing.statistics(comm)
                        (load, dropped) per layer tallied since the last call, summed over
                        comm's ranks
    make_expert_parallel(routing, mesh.experts)
                        at ep > 1: each layer keeps its E / ep experts (expert_parallel)
    dense, experts = split_experts(unit_params)
                        the expert parameters (those marked `ep_split`) apart from the rest
    ExpertStates(cls, units, experts, mesh.experts, context)
                        a second instance of the engine's ZeRO stage, over the
                        expert-data-parallel group, holding the expert parameters

Why this routes as one process: a routing group is one sequence, so the group of global row r
of the step's batch is r, whatever the data-parallel size and the micro-batches (rank d holds
rows [d b, (d + 1) b) of it, b = micro-batch x accumulation, as zmpi.data's samplers give them;
micro-batch i of rank d starts at row d b + i m). Each group's random draws depend only on the
layer's seed, the key (step,) and that index, and its capacity only on its own tokens; the
forward that full recompute repeats reads the same key and offset. The auxiliary and z losses
are means over a micro-batch's groups and tokens, and the engine divides every gradient by
(loss scale x ranks x micro-batches): the mean over the step's groups, one process's.

At ep 1 the expert parameters are ordinary parameters of their block's unit: the strategy
shards, reduces, clips and loss-scales them with the rest (every rank holds every expert).

At ep > 1 (DeepSpeed-MoE's layout, zmpi.parallel.mesh): rank j of an expert-parallel group
holds experts j E/ep .. (j+1) E/ep - 1 of every MoE layer, and the ranks holding the same
experts are the expert-data-parallel group (edp = dp / ep ranks). The dense parameters stay
in the engine's strategy over all of dp; the expert parameters go to flat buffers of their
own, run by a second instance of the same strategy class whose Comm is the
expert-data-parallel group: the mechanism is shared, the Comm varies. Each MoE block's unit is
then a unit of both (the engine runs both strategies' hooks around it, the dense one first),
so ZeRO 0-3 reduce, shard, gather and release the expert states over edp exactly as they do
the dense states over dp. Both are divided by the same (loss scale x dp x micro-batches): an
expert's gradient summed over edp is the sum over every token of the step routed to it,
since the all-to-alls brought each token's rows to the rank holding its expert. One
optimizer updates both (the expert states without advancing its step count again); the
gradients' norm for clipping and the overflow check add the experts' squares summed over edp
(when sharded) and then over ep, so each expert is counted once.
"""

from __future__ import annotations

import numpy as np

from zmpi import backend
from zmpi.checkpoint.tensor import ExpertSplits, TensorSplits
from zmpi.config import ConfigError
from zmpi.engine.build import build_strategy
from zmpi.engine.tensor import gather_tensor_slices, ranges_sumsq, replicated_ranges
from zmpi.nn.moe import MoE
from zmpi.parallel.expert import expert_parallel


class MoERouting:
    """The MoE layers of `model` (every zmpi.nn.moe.MoE module in it), told what to route."""

    def __init__(self, model):
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self._counts = []  # tally's [(load, dropped)] per layer since `statistics`

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

    def with_losses(self, loss):
        """`loss` plus `losses()`; `loss` itself without MoE layers (a dense model's step
        launches no addition of 0 on a GPU)."""
        return loss + self.losses() if self.layers else loss

    def tally(self) -> None:
        """After the training forward of a micro-batch (`before` called for it): add each
        layer's routing to the counts, the assignments each expert received before drops
        (Routing.load) and those over capacity (Routing.dropped). Device arrays, no sync; a
        recompute's repeated forward is not tallied again (the engine calls this, not the
        layer)."""
        counts = [(layer.routing.load, layer.routing.dropped) for layer in self.layers]
        self._counts = counts if not self._counts else [
            (load + new_load, dropped + new_dropped) for (load, dropped), (new_load, new_dropped)
            in zip(self._counts, counts, strict=True)]

    def statistics(self, comm) -> list[tuple[np.ndarray, int]]:
        """[(load (E,) int64, dropped int)] per MoE layer (model order): the assignments routed
        to each expert before drops and those dropped, summed over the micro-batches tallied
        since the last call (called after every train_step: that step's, skipped fp16 steps
        included) and over `comm`'s ranks (the data-parallel group, whose ranks route
        different rows); the counts start again from 0. A collective over `comm` (one
        allreduce of sum(E) + layers integers, counted in its traffic); [] without MoE
        layers. ValueError before the collective, alike on every rank, if nothing was
        tallied since the last call."""
        if not self.layers:
            return []
        if not self._counts:
            raise ValueError("no MoE routing tallied since the last statistics: they come "
                             "after a training step (Engine.train_step)")
        flat = np.concatenate([np.append(backend.to_host(load), int(dropped))
                               for load, dropped in self._counts]).astype(np.int64)
        self._counts = []
        comm.allreduce(flat)
        out, start = [], 0
        for layer in self.layers:
            E = layer.router.num_experts
            out.append((flat[start:start + E], int(flat[start + E])))
            start += E + 1
        return out


def make_expert_parallel(routing: MoERouting, groups) -> None:
    """Each MoE layer of `routing` keeps the experts this rank holds over `groups` (an
    ExpertGroups: zmpi.parallel.expert.expert_parallel). ValueError, before any collective,
    for a layer made expert parallel already: the engine takes a model built whole."""
    for layer in routing.layers:
        if any(hasattr(p, "ep_split") for _, p in layer.experts.named_parameters()):
            raise ValueError("the model's MoE layers are expert parallel already: give the "
                             "Engine the model built whole (it keeps each rank's experts)")
        expert_parallel(layer, groups)


def split_experts(unit_params):
    """(dense, experts): `unit_params` (name -> Parameter per unit) without the expert
    parameters (those marked `ep_split` by expert_parallel), and {unit: its expert
    parameters} for the units that have any ({} for a dense or ep-1 model)."""
    dense, experts = [], {}
    for u, params in enumerate(unit_params):
        dense.append({n: p for n, p in params.items() if not hasattr(p, "ep_split")})
        if len(dense[-1]) < len(params):
            experts[u] = {n: p for n, p in params.items() if hasattr(p, "ep_split")}
    return dense, experts


class ExpertStates:
    """The expert parameters of an engine at ep > 1 (see the module's doc): `strategy`, an
    instance of the engine's strategy class over `groups.edp_comm` whose units are the MoE
    blocks' units, with only their expert parameters; `layout` its flat layout (this rank's
    E / ep experts of each layer); `splits` how those are split over the ep ranks (a
    zmpi.checkpoint.tensor.TensorSplits: axis 0, E whole, ep rank j's experts; under tensor
    parallelism an ExpertSplits, the tensor ranks' hidden slices too), `ep_rank` this rank's
    place among the ep ranks and `slice_rank` among the ep x tp slices (ep_rank at tp 1): what
    a checkpoint records of them."""

    def __init__(self, cls, units, experts: dict, groups, context: dict):
        """cls: the engine's strategy class; units: the model's units; experts: {unit index:
        its expert parameters} (split_experts); groups: the mesh's ExpertGroups; context: the
        other StrategyContext fields (ledger, dtype, master_dtype, xp, config, mesh, aio), the
        engine's: the experts' states live where the engine's do (offload included)."""
        self.groups, self.units = groups, [units[u] for u in experts]
        self.params = list(experts.values())
        # the same experts, the same initial values on every rank of edp (a collective); a
        # hybrid or ZeRO++ group size is cut inside edp, which may refuse it (on every rank)
        try:
            self.strategy, self.layout = build_strategy(cls, groups.edp_comm, self.units,
                                                        self.params, context)
        except ConfigError as e:
            raise ConfigError(e.key, f"{e.msg} (for the expert parameters: their groups are cut "
                              f"inside the dp / moe.ep_size = {groups.edp} ranks holding the "
                              "same experts)") from None
        self.splits = TensorSplits.of_model(self.params, groups.ep_comm, "ep")  # a collective
        self.ep_rank = groups.ep_comm.rank
        self._index = {id(unit): i for i, unit in enumerate(self.units)}
        # under tensor parallelism (zmpi.parallel.expert.tensor): each expert's hidden units
        # split over tp, its proj_bias whole on every tensor rank (counted once in the norm);
        # a checkpoint's expert section is then split both ways (ExpertSplits)
        self.tp, self.master_dtype = context["mesh"].tp_comm, context["master_dtype"]
        self.tp_replicated = replicated_ranges(self.layout, self.params, self.strategy) \
            if self.tp.size > 1 else []
        if self.tp.size > 1:
            self.splits = ExpertSplits(self.splits, TensorSplits.of_model(self.params, self.tp))
        self.slice_rank = self.ep_rank * self.tp.size + self.tp.rank  # its files' place

    def hook(self, name: str, unit) -> None:
        """The strategy's hook `name` ("before_forward", ...) on `unit`, if it holds experts."""
        i = self._index.get(id(unit))
        if i is not None:
            getattr(self.strategy, name)(i)

    @property
    def num_params(self) -> int:
        """The experts' parameters over all ranks (every layer's E experts)."""
        return self.layout.num_params * self.groups.ep

    def global_sumsq(self, sumsq, grad_scale: float):
        """The sum of the squared expert gradients over every expert, from this rank's
        `sumsq` over its optimizer gradients (its shard when sharded, scaled by `grad_scale`):
        summed over the shard group where the shards differ (edp, or with hybrid sharding its
        shard groups inside edp, whose replicas hold the same shards), then over ep, whose
        ranks hold different experts, then, under tensor parallelism, the split ones over tp
        and the whole ones (proj_bias, the same on every tensor rank) once."""
        groups = ((self.strategy.comm,) if self.strategy.shard_optimizer else ()) + (
            self.groups.ep_comm,)
        if self.tp.size == 1:
            for comm in groups:
                sumsq = comm.allreduce_scalar(sumsq)
            return sumsq
        replicated = ranges_sumsq(self.strategy.optimizer_grads(), self.tp_replicated,
                                  self.master_dtype) * grad_scale**2
        for comm in groups:
            sumsq, replicated = comm.allreduce_scalar(sumsq), comm.allreduce_scalar(replicated)
        return self.tp.allreduce_scalar(sumsq - replicated) + replicated

    def gather(self) -> dict:
        """{name: the whole (E, ...) master value} of every expert parameter, on every rank
        (a collective: allgathers over edp, then each parameter's ep slices over ep, placed
        by their `ep_index` as tensor slices are by theirs)."""
        full = backend.to_host(self.strategy.full_master())
        return {name: gather_tensor_slices(gather_tensor_slices(
                    view, self.params[u][name], self.groups.ep_comm, "ep"),
                    self.params[u][name], self.tp)  # then its tensor slices, if split
                for u, unit in enumerate(self.layout.units)
                for name, view in unit.views(full[self.layout.full_slice(u)]).items()}


def check_moe(config, mesh, model) -> None:
    """ConfigError unless the model's MoE blocks are the config's `moe` section (a model with
    a `moe` attribute, the GPT, built from an equal section; any other model only with an
    empty one) and the mesh's expert split is the section's ep_size. Tensor parallelism
    splits the experts (zmpi.parallel.expert.tensor) and pipeline stages route their own
    layers (zmpi/engine/pipeline.py), apart or together."""
    want = config.moe if config.moe.enabled else None
    built = getattr(model, "moe", None)
    if built != want and (want is not None or built is not None):
        raise ConfigError("moe", (
            f"the config gives {config.moe.to_dict()} but the model was built with "
            f"{'no MoE' if built is None else built.to_dict()}" if want is not None else
            f"the config has none but the model was built with {built.to_dict()}")
            + "; build it as GPT(..., moe=config['moe']) from the same section")
    if mesh.ep != config.moe.ep_size:
        raise ConfigError("moe.ep_size", f"{config.moe.ep_size}, but the mesh given splits "
                          f"the data-parallel ranks into expert groups of {mesh.ep}: build it "
                          "as Mesh(comm, ..., ep=config's moe.ep_size)")

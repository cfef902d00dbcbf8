"""The engine's diagnostics: what is checked once at set-up, and what finds a failure's cause.

    check_mesh(mesh, config, model)           the mesh is the config's; a tp > 1 model is split
    check_sparse_attention(config, model)     the model's attention is the config's
    check_units(units, unit_params)           every unit has parameters, none is shared
    check_input_slots(model, config, mesh, n) number_checkpoints fits the layout's kept inputs
    check_same_on_replicas(initial, comm)     every replica built the same initial model
    agreed_across_stages(mesh, build)         build()'s error raised on every pipeline stage
    storage_dtype(config, unit_params)        fp16/bf16 from the config, else the model's
    check_grads_contract(strategy, grads)     a strategy kept its optimizer-gradient contract
    check_replicas(engine)                    replicated state identical (CRC-32 per unit)
    first_nonfinite_unit(engine, grads)       where a NaN/inf gradient first appears

Each raises a clear error on every rank (the collectives among them are over the engine's
groups), so a failure names its cause instead of surfacing steps later.
"""
from __future__ import annotations

import math
import warnings
import zlib

import numpy as np

from zmpi import backend
from zmpi.backend import array_module
from zmpi.nn.module import Module, UnitModel

STATES = ("params", "master", "adam_m", "adam_v")


def as_one_unit(model, comm) -> UnitModel:
    """A plain zmpi.nn Module runs as a one-unit UnitModel (softmax cross-entropy loss;
    wrap it yourself, UnitModel([module], loss=...), for another)."""
    if not isinstance(model, Module):
        raise TypeError(f"Engine needs a zmpi.nn UnitModel or Module, got "
                        f"{type(model).__name__}")
    if comm.rank == 0:
        warnings.warn(f"{type(model).__name__} is not a UnitModel: it runs as one unit. "
                      "ZeRO-3 then gathers all its parameters at once, so the peak "
                      "parameter memory is the whole model; split it into units "
                      "(zmpi.nn.UnitModel([...], loss=...)) to gather one at a time",
                      stacklevel=3)
    return UnitModel([model])


def check_mesh(mesh, config, model) -> None:
    """ConfigError unless the mesh is the config's (tp, pp) over the engine's world, a model
    trained at tp > 1 was split over this mesh's tensor group (zmpi.parallel.tensor), and with
    the config's sequence parallelism (`tensor_parallel.sequence_parallel`, which changes
    nothing at tp = 1): the model's `sequence_parallel` attribute, False if it has none."""
    from zmpi.config import ConfigError

    tp, pp = config.tensor_parallel.autotp_size, config.pipeline.stages
    if (mesh.tp, mesh.pp) != (tp, pp):
        raise ConfigError("tensor_parallel.autotp_size", f"the mesh given is tp {mesh.tp} x pp "
                          f"{mesh.pp}; the config says tp {tp} x pp {pp}")
    if mesh.tp > 1 and getattr(model, "tp", None) is not mesh.tp_comm:
        raise ConfigError("tensor_parallel.autotp_size", f"{tp}: the model is not split over "
                          "this engine's tensor-parallel group; build the mesh first and the "
                          "model on its tp_comm: mesh = Mesh(comm, tp=T); model = GPT(config, "
                          "tp=mesh.tp_comm); Engine(model, config, comm, mesh=mesh)")
    want = config.tensor_parallel.sequence_parallel and mesh.tp > 1
    built = bool(getattr(model, "sequence_parallel", False))
    if built != want:
        raise ConfigError("tensor_parallel.sequence_parallel", (
            f"the config turns sequence parallelism on (tp {mesh.tp}) but the model was built "
            "without it" if want else "the config leaves sequence parallelism off but the "
            "model was built with it") + f"; build it as GPT(config, tp=mesh.tp_comm, "
            f"sequence_parallel={want})")


def check_model_shape(config, model) -> None:
    """ConfigError unless the model has the shape the config's `model` section gives, and its
    vocab_multiple where given (a model without a GPT `config` matches only an empty
    section)."""
    from zmpi.config import ConfigError

    given = config.model.given()
    if config.model.vocab_multiple is not None:
        given["vocab_multiple"] = config.model.vocab_multiple
    for key, value in given.items():
        built = getattr(getattr(model, "config", None), key, None)
        if built != value:
            raise ConfigError(f"model.{key}", f"the config is for {key} {value}, the model "
                              f"given has {built}")


def check_input_slots(model, config, mesh, units: int) -> None:
    """ConfigError unless activation_checkpointing.number_checkpoints (the slots of
    contiguous_memory_optimization), where given, holds every input full recompute keeps at
    once on every rank: its `model`'s recomputed units or groups (UnitModel.inputs_kept) times
    the micro-batches its pipeline stage holds at once (1 without pipelining); and is at most
    `units` (the whole model's) x micro-batches, the most any layout of the model keeps (each
    slot is a buffer the size of the largest kept input). A collective over the pipeline
    group where pp > 1, so every stage refuses alike, before the first step."""
    from zmpi.config import ConfigError
    from zmpi.parallel.pipeline.schedule import in_flight
    from zmpi.words import count

    slots = config.activation_checkpointing.number_checkpoints
    if slots is None:
        return
    m = config.gradient_accumulation_steps
    held = 1 if mesh.pp == 1 else in_flight(config.pipeline.schedule, mesh.pp_rank, mesh.pp, m)
    need = model.inputs_kept() * held
    if mesh.pp > 1:
        need = int(mesh.pp_comm.allreduce_scalar(need, op="max"))
    least, most = max(need, 1), units * m
    if not least <= slots <= most:
        why = (f"fewer than the {need} inputs this layout keeps at once (one per recomputed "
               "unit, or group of units, and micro-batch in flight on a pipeline stage)"
               if slots < least else f"more than the {count(most, 'input')} any layout of this "
               "model keeps at once (one per unit and micro-batch; each slot is a buffer the "
               "size of the largest)")
        raise ConfigError("activation_checkpointing.number_checkpoints",
                          f"{slots} is {why}: give {least} to {most}")


def check_sparse_attention(config, model) -> None:
    """ConfigError unless the model's attention is the config's `sparse_attention`: the same
    layout config for the model's heads (a model without a `sparse_attention` attribute is
    dense)."""
    from zmpi.config import ConfigError

    built = getattr(model, "sparse_attention", None)
    if not config.sparse_attention.enabled and built is None:
        return
    shape = getattr(model, "config", None)  # a GPTConfig's n_head, a LlamaConfig's query heads
    heads = getattr(shape, "n_head", None) or getattr(shape, "num_attention_heads", None)
    want = config.sparse_attention.sparsity(heads) if heads is not None else None
    if built != want:
        say = "dense" if built is None else f"{type(built).__name__}"
        raise ConfigError("sparse_attention", (
            f"the config gives {config.sparse_attention.to_dict()} but the model was built "
            f"with {say} attention" if config.sparse_attention.enabled else
            f"the config has none but the model was built with {say}") + "; build it as "
            "GPT(..., sparse_attention=config['sparse_attention']) from the same section")


def check_units(units, unit_params) -> None:
    seen = {}
    for u, params in enumerate(unit_params):
        if not params:
            raise ValueError(f"unit {u} ({type(units[u]).__name__}) has no parameters")
        for name, p in params.items():
            if id(p) in seen:
                raise ValueError(f"parameter {name} belongs to units {seen[id(p)]} and {u}")
            seen[id(p)] = u
    for u, unit in enumerate(units):
        for shared in getattr(unit, "shared_units", ()):
            if shared not in units or units.index(shared) >= u:
                raise ValueError(f"unit {u} shares weights with a unit that is not an "
                                 "earlier unit of the model")


def check_same_on_replicas(initial, comm) -> None:
    """ValueError, on every rank of `comm`, unless every rank of it (the replicas of this
    rank's slice of the model: the data-parallel group) built the same finite initial
    parameters."""
    checksum = float(np.abs(initial).sum(dtype=np.float64))
    if comm.allreduce_scalar(0.0 if math.isfinite(checksum) else 1.0, op="max"):
        raise ValueError("the model's initial parameters contain NaN or inf")
    low = comm.allreduce_scalar(checksum, op="min")
    high = comm.allreduce_scalar(checksum, op="max")
    if low != high:
        raise ValueError("ranks built different initial models: seed the model identically "
                         "on every rank")


def agreed_across_stages(mesh, build):
    """build() on every rank of `mesh`, an exception it raises agreed over the whole mesh
    where it has pipeline stages: a check of a stage's own units (ZeRO-3's live parameter
    limit, the memory budget) can fail on some stages only, whose peers would then wait for
    ever in the next collective across stages. Every rank raises the first failing rank's
    error, naming the stages it failed on when not all: a ConfigError, ValueError or
    NVMeError as such, a MemoryError as OutOfMemory, anything else as RuntimeError naming its
    type (only the messages travel: one pickled allgather, pp > 1 only)."""
    if mesh.pp == 1:
        return build()
    from zmpi.comm.agree import agreed_call
    from zmpi.config import ConfigError
    from zmpi.memory import OutOfMemory
    from zmpi.offload import NVMeError

    def describe(e):
        kind = next(k for k, t in (("config", ConfigError), ("value", ValueError),
                                   ("memory", MemoryError), ("nvme", NVMeError),
                                   ("other", Exception))
                    if isinstance(e, t))
        text = f"{type(e).__name__}: {e}" if kind == "other" else str(e)
        return ((kind, e.key, e.msg, text) if kind == "config" else (kind, "", "", text),
                mesh.pp_rank)

    result, failed, error = agreed_call(mesh.comm, build, describe)
    if not failed:
        return result
    stages = sorted({stage for _, (_, stage) in failed})
    kind, key, msg, text = failed[0][1][0]
    where = "" if len(stages) == mesh.pp else \
        f" (on pipeline stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))} " \
        f"of {mesh.pp})"
    if kind == "config":
        raise ConfigError(key, msg + where) from error
    raise {"value": ValueError, "memory": OutOfMemory, "nvme": NVMeError,
           "other": RuntimeError}[kind](
        text + where) from error


def storage_dtype(config, unit_params) -> np.dtype:
    """fp16/bf16 when the config enables them, else the model's own float32 or float64."""
    if config.dtype_name != "float32":
        return backend.dtype_from_name(config.dtype_name)
    dtypes = {np.dtype(p.data.dtype) for params in unit_params for p in params.values()}
    if len(dtypes) != 1 or not dtypes <= {np.dtype(np.float32), np.dtype(np.float64)}:
        raise ValueError(f"build the model in float32 (or float64), not "
                         f"{sorted(map(str, dtypes))}; select fp16/bf16 storage with the "
                         "config's fp16/bf16 sections")
    return dtypes.pop()


def check_grads_contract(strategy, grads, dtype) -> None:
    """The cheap invariant every strategy must keep: after before_step() the optimizer's
    gradient buffer exists and is laid out like the master weights."""
    master = strategy.master
    if grads is None or grads.shape != master.shape or grads.dtype != dtype:
        got = None if grads is None else f"{grads.shape} {grads.dtype}"
        raise RuntimeError(
            f"strategy {strategy.name!r} broke its contract: after before_step(), "
            f"optimizer_grads() must be a {master.shape} {dtype} buffer (the "
            f"master's layout), got {got}")


def check_replicas(engine) -> None:
    """engine.check_replicas: see its docstring."""
    engine.wait_update()  # the delayed update writes the master weights
    scalars = (engine.global_steps, engine.scaler.scale, engine.optimizer.step_count)
    dp = engine.mesh.dp_comm  # the replicas of this rank's slice of the model
    # (kind of group, its Comm, what is compared, digests, where each digest is or None)
    checks = [("data-parallel", dp, "step, loss scale and optimizer step", [scalars], None)]
    names = [f" of unit {u} ({type(unit).__name__})" for u, unit in enumerate(engine.model.units)]
    checks += _state_checks(engine.strategy, engine.layout, dp, "data-parallel", names)
    if engine.experts is not None:  # the expert states, over the ranks holding those experts
        ex = engine.experts
        where = [f" (the experts) of unit {engine._unit_index[id(unit)]} "
                 f"({type(unit).__name__})" for unit in ex.units]
        checks += _state_checks(ex.strategy, ex.layout, ex.groups.edp_comm,
                                "expert-data-parallel", where)
    if engine.mesh.tp > 1:  # what every tensor rank holds whole must stay identical
        for state in STATES[1:]:  # the optimizer's layout, which tp_replicated indexes
            host = backend.to_host(engine.strategy.state_buffer(state)[0])
            crc = 0
            for s in engine.tp_replicated:
                crc = zlib.crc32(np.ascontiguousarray(host[s]).view(np.uint8), crc)
            checks.append(("tensor-parallel", engine.mesh.tp_comm,
                           f"{state} of the tensor-replicated parameters", [crc], None))
    found = None  # the first difference this rank's groups saw
    for kind, comm, what, digests, where in checks:
        everyone = comm.allgather_object((engine.comm.rank, digests))  # world ranks
        ranks = [r for r, _ in everyone]
        for u, copies in enumerate(zip(*(d for _, d in everyone), strict=True)):
            if len(set(copies)) > 1 and found is None:
                holders = {}
                for r, d in zip(ranks, copies, strict=True):
                    holders.setdefault(d, []).append(r)
                found = (f"{what}{'' if where is None else where[u]} differs between the "
                         f"ranks of the {kind} group: " + "; ".join(
                             f"ranks {rs} hold copy {i}" for i, rs in enumerate(holders.values())))
    # a group's ranks alone saw its difference: the first rank's that saw one, on every rank
    found = next((f for f in engine.comm.allgather_object(found) if f is not None), None)
    if found is not None:
        raise RuntimeError(f"replicas diverged after step {engine.global_steps}: {found}")


def _state_checks(strategy, layout, comm, kind: str, where: list) -> list:
    """check_replicas' checks of one strategy's model states (`layout` its flat layout,
    `where` a description of each of its units): each unit's CRC-32 of every state it
    replicates over `comm` (a `kind` group), and of every sharded state over the replicas of
    a shard (hybrid sharding)."""
    checks = []
    for state in STATES:
        buf, sharded = strategy.state_buffer(state)
        if sharded and strategy.replica is None:
            continue
        host = backend.to_host(buf)
        slices = [layout.shard_slice(u) if sharded else layout.full_slice(u)
                  for u in range(len(layout.units))]
        checks.append(("replica" if sharded else kind, strategy.replica if sharded else comm,
                       state, [zlib.crc32(np.ascontiguousarray(host[s]).view(np.uint8))
                               for s in slices], where))
    return checks


_UNITS_BOUND = 1 << 30  # more units than any stage has: (stage, unit) as one integer


def first_nonfinite_unit(engine, grads) -> str:
    """The last unit (the first in backward order: of the last pipeline stage that has one)
    whose reduced gradient holds a NaN or inf on any rank, described by index (per stage),
    type and parameter names, the same line on every rank (a collective over every rank)."""
    xp, layout = array_module(grads), engine.layout
    local = -1
    for u in reversed(range(len(layout.units))):
        part = layout.shard_slice(u) if engine.strategy.shard_optimizer else layout.full_slice(u)
        if not bool(xp.isfinite(grads[part]).all()):
            local = u
            break
    stage, stages = engine.mesh.pp_rank, engine.mesh.pp
    key = -1 if local < 0 else stage * _UNITS_BOUND + local  # the last stage's first
    found = int(engine.comm.allreduce_scalar(key, op="max"))
    if found < 0:  # the dense gradients are finite: the expert strategy's are not (ep > 1)
        return "the expert parameters of the MoE layers (moe.ep_size > 1)"
    mine = None
    if found // _UNITS_BOUND == stage:  # this stage's unit: its ranks can name it
        u = found % _UNITS_BOUND
        names = [s.name for s in layout.units[u].slots]
        mine = (f"unit {u} ({type(engine.model.units[u]).__name__}: "
                f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                + (f" of pipeline stage {stage} of {stages}" if stages > 1 else ""))
    return next(d for d in engine.comm.allgather_object(mine) if d is not None)

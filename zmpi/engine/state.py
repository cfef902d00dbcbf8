"""What a checkpoint holds of an engine: the view of it that zmpi.checkpoint works with.

The checkpoint package never sees the Engine: it is handed a `TrainState`, which names what
a save reads (the groups, the layout, the strategy's state shards, the ledger for host
copies, the manifest's state) and what a load changes (`restore`). A new piece of training
state is added here, in `manifest` and `restore`, and nowhere else.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from zmpi.runinfo import git_revision


class TrainState:
    """An engine's training state, for one save or load (made per call: it holds the engine
    only while that call runs). At ep > 1 the expert parameters are a second section
    (`experts`: zmpi.engine.moe.ExpertStates; None otherwise), with a layout, a strategy
    over the expert-data-parallel group and a split over the expert-parallel ranks of its
    own (docs/checkpoints.md)."""

    def __init__(self, engine):
        self._engine = engine
        self.comm, self.mesh, self.layout = engine.comm, engine.mesh, engine.layout
        self.strategy, self.memory = engine.strategy, engine.memory
        self.dtype, self.master_dtype = engine.dtype, engine.master_dtype
        self.global_steps = engine.global_steps
        # how the parameters are split over the tensor ranks (zmpi.checkpoint.tensor)
        self.splits, self.tp_rank = engine.tensor_splits, engine.mesh.tp_rank
        # what the manifest describes: the whole model, every pipeline stage's units; this
        # stage writes its own, not its held copies of other stages' (zmpi.parallel.pipeline)
        pipe = engine.pipeline
        self.saved_layout = pipe.whole_layout if pipe else engine.layout
        self.saved_splits = pipe.whole_splits if pipe else engine.tensor_splits
        self.stage, self.stages = engine.mesh.pp_rank, engine.mesh.pp
        self.held = pipe.held_names if pipe else frozenset()
        self.experts = engine.experts
        # the expert section the manifest describes (at ep > 1): every stage's under pipelines
        if pipe is not None and pipe.whole_experts is not None:
            self.saved_experts = SavedExperts(*pipe.whole_experts)
        else:
            self.saved_experts = None if engine.experts is None else SavedExperts(
                engine.experts.layout, engine.experts.splits)

    def settle(self) -> None:
        """Before a snapshot: a delayed update in flight finishes (its publication stays
        pending, and is recorded as such)."""
        self._engine.wait_update()

    def manifest(self, client_state=None) -> dict:
        """Everything but the four model states that a checkpoint records (its manifest)."""
        engine = self._engine
        opt = engine.optimizer
        body = {
            "world_size": engine.layout.world_size, "strategy": engine.strategy.name,
            "mesh": engine.mesh.describe(),
            "dtype": engine.dtype.name, "master_dtype": engine.master_dtype.name,
            "num_params": self.saved_layout.num_params, "layout": self.saved_layout.to_dict(),
            "tied": engine.model.tied_parameters(), "global_steps": engine.global_steps,
            "optimizer": {**opt.state_dict(), "lr": engine.config.optimizer.lr,
                          "betas": list(engine.config.optimizer.betas), "eps": opt.eps,
                          "weight_decay": opt.weight_decay, "decoupled": opt.decoupled},
            "scheduler": engine.config.scheduler.to_dict(), "last_lr": opt.lr,
            "loss_scaler": engine.scaler.state_dict() if engine.config.fp16.enabled else None,
            "unpublished_update": engine.delayed.unpublished, "config": engine.config.to_dict(),
            "client_state": client_state or {}, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "git_revision": git_revision() if engine.comm.rank == 0 else None,
        }
        if self.splits.size > 1 or self.saved_splits.splits:  # split or padded (tensor.py)
            body["tensor"] = self.saved_splits.to_dict()
        if self.stages > 1:
            body["pipeline"] = {"stages": self.stages, "bounds": engine.model.bounds}
        if self.saved_experts is not None:  # their own layout (over edp), split over ep
            body["experts"] = self.saved_experts.to_dict()
        json.dumps(body["client_state"])  # TypeError now, not when the manifest is written
        return body

    def check_model(self, manifest: dict, where) -> None:
        """CheckpointError ("mismatch") if the checkpoint's config names a model shape (its
        `model` section, as zmpi train and zmpi plan write it) that differs from this
        engine's where both give a key: n_head above all, which no parameter's shape shows."""
        from zmpi.checkpoint import CheckpointError

        saved = manifest["config"].get("model") or {}
        ours = self._engine.config.model.given()
        differ = [f"model.{k}: checkpoint {saved[k]}, this run {ours[k]}"
                  for k in sorted(set(saved) & set(ours)) if saved[k] != ours[k]]
        if differ:
            raise CheckpointError(f"{where}: mismatch: the checkpoint is of a different model "
                                  f"({'; '.join(differ)})")

    def restore_weights(self, master) -> None:
        """Install master weights alone (this rank's owned shard, in this engine's layout; a
        collective), as a fresh run from them (zmpi train --init-from): the parameters become
        the master weights cast, as `restore` makes them without "params"; the optimizer
        state, steps and loss scaler stay as built."""
        engine = self._engine
        engine.strategy.set_state_shard("master", master)
        engine.delayed.unpublished = True
        engine.flush()

    def restore(self, manifest: dict, states: dict, expert_states: dict) -> list[str]:
        """Install a checkpoint read by zmpi.checkpoint (a collective). `states`: this rank's
        owned shard of each model state, in this engine's layout; `expert_states` the same
        of the expert section at ep > 1 ({} otherwise); without "params" (the storage dtype
        changed) the parameters are the master weights cast. Returns notes on what the
        checkpoint had that this engine's config overrides."""
        engine = self._engine
        notes = []
        try:
            engine.wait_update()  # an update in flight is superseded by the checkpoint
        except RuntimeError as e:
            notes.append(f"discarded a failed delayed update: {e}")
        for state, shard in states.items():
            engine.strategy.set_state_shard(state, shard)
        for state, shard in expert_states.items():
            self.experts.strategy.set_state_shard(state, shard)
        engine.global_steps = manifest["global_steps"]
        saved = manifest["optimizer"]
        engine.optimizer.load_state_dict(saved)
        opt, base = engine.optimizer, engine.config.optimizer
        for key, ours in (("lr", base.lr), ("betas", list(base.betas)), ("eps", opt.eps),
                          ("weight_decay", opt.weight_decay), ("decoupled", opt.decoupled)):
            if saved[key] != ours:
                notes.append(f"optimizer {key} is {ours!r} (the checkpoint had {saved[key]!r})")
        kind = manifest["config"].get("optimizer", {}).get("type", "AdamW")
        if kind != base.type:
            notes.append(_optimizer_change(kind, base.type, opt))
        was, now = manifest["config"].get("train_batch_size"), engine.config.train_batch_size
        if was is not None and was != now:  # (micro-batch and accumulation follow the ranks)
            notes.append(f"train_batch_size is {now} (the checkpoint had {was}): the data and "
                         "the losses go on differently from the saved run")
        if "scheduler" in manifest and manifest["scheduler"] != engine.config.scheduler.to_dict():
            notes.append(f"the scheduler is {engine.config.scheduler.to_dict()} (the checkpoint "
                         f"had {manifest.get('scheduler')}); it goes on from step "
                         f"{engine.global_steps}")
        opt.lr = manifest.get("last_lr", opt.lr) if engine.schedule else opt.lr
        notes += _attention_change(manifest["config"].get("sparse_attention") or {},
                                   engine.config.sparse_attention)
        if manifest["dtype"] != engine.dtype.name:
            notes.append(f"parameters are stored as {engine.dtype.name} (the checkpoint had "
                         f"{manifest['dtype']}): they are the master weights cast")
        if manifest["loss_scaler"] is not None and engine.config.fp16.enabled:
            engine.scaler.load_state_dict(manifest["loss_scaler"])
        elif manifest["loss_scaler"] is not None or engine.config.fp16.enabled:
            notes.append("the loss scaler starts afresh (fp16 is "
                         f"{'on' if engine.config.fp16.enabled else 'off'} here, "
                         f"{'off' if engine.config.fp16.enabled else 'on'} in the checkpoint)")
        # A delayed update saved before its publication lands at the next step, as it would
        # have without the checkpoint; otherwise publish now.
        engine.delayed.unpublished = manifest["unpublished_update"] or "params" not in states
        delayed = (engine.delay_update and engine.global_steps >= engine.delay_update_warmup
                   and "params" in states)
        if engine.delayed.unpublished and not delayed:
            engine.flush()
        return notes


@dataclass(frozen=True)
class SavedExperts:
    """The expert section of a checkpoint saved at ep > 1 (zmpi.engine.moe.ExpertStates):
    its `layout` over the expert-data-parallel shards and `splits` over the ep ranks, and
    under pipeline parallelism every stage's expert units put together (PipelineRun's
    whole_experts) with `bounds`, their split points between the stages (None without)."""

    layout: object
    splits: object
    bounds: list | None = None

    def to_dict(self) -> dict:
        """The manifest's `experts` entry. ValueError, alike on every rank, where a pipeline
        stage holds no MoE layer (its expert files would be missing from the stage-major
        list): not built yet."""
        out = {"layout": self.layout.to_dict(), "tensor": self.splits.to_dict()}
        if self.bounds is not None:
            if any(a == b for a, b in zip(self.bounds, self.bounds[1:], strict=False)):
                raise ValueError("save_checkpoint at moe.ep_size > 1 under pipeline stages "
                                 "needs an MoE block on every stage (the stages' MoE blocks "
                                 f"split at {self.bounds}): not built yet (docs/moe.md)")
            out["pipeline"] = {"stages": len(self.bounds) - 1, "bounds": list(self.bounds)}
        return out


def _attention_change(saved: dict, ours) -> list[str]:
    """A note, as for a change of dtype, when the checkpoint's run attended with another
    layout (its config's `sparse_attention` section, `saved`) than this engine's config
    (`ours`, a SparseAttentionConfig): sections that make the same layout (keys given at
    their defaults) are no change. A section that no longer reads is named as saved."""
    from zmpi.config import ConfigError, SparseAttentionConfig

    try:
        same = SparseAttentionConfig.from_dict(saved).sparsity(1) == ours.sparsity(1)
    except ConfigError:
        same = False
    if same:
        return []

    def said(section):
        return f"sparse_attention {json.dumps(section, sort_keys=True)}" if section else \
            "dense attention"

    return [f"attention is {said(ours.to_dict())} (the checkpoint's run had {said(saved)}): "
            "the weights carry over, the layers attend to other blocks"]


def _optimizer_change(saved: str, kind: str, opt) -> str:
    """The note for a checkpoint of optimizer type `saved` loaded by optimizer `opt` of type
    `kind` (types as the config normalises them: Adam, AdamW, OneBitAdam): what carries over
    and what does not. 1-bit Adam's error feedback is each rank's own and never saved
    (zmpi.optim.onebit)."""
    note = (f"the optimizer is {kind} (the checkpoint had {saved}): the master weights, m, v "
            f"and the step count ({opt.step_count}) carry over")
    if saved == "OneBitAdam":
        note += ("; 1-bit Adam's error feedback (never saved) is dropped, and v, which it "
                 "froze after its freeze_step, is updated again")
    if kind == "OneBitAdam":
        when = ("from the first step, with the checkpoint's v as the frozen one"
                if opt.step_count >= opt.freeze_step else f"after step {opt.freeze_step}")
        note += f"; 1-bit Adam's error feedback starts at zero and it compresses {when}"
    return note

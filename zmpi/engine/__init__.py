"""The engine: one training step of a unit model under a ZeRO strategy, over a process mesh.

    from zmpi.engine import Engine
    engine = Engine(model, config)      # config: a Config, a DeepSpeed-style dict or JSON path
    loss = engine.train_step(x, y)

    core.py      Engine: set-up, train_step (forward and backward per micro-batch), eval, close
    build.py     a partition strategy built over a group (the engine's over dp, the experts')
    moe.py       MoE layers: their routing per micro-batch, and at ep > 1 the expert states
    step.py      the step: unscale, overflow, clip, Adam (what is the same for every stage)
    delayed.py   the one-step delayed update (DPU) in its background thread
    state.py     TrainState: what a checkpoint holds of an engine, and how it is restored
    checkpoints.py the Engine's save_checkpoint, load_checkpoint (on its TrainState)
    checks.py    set-up checks and diagnostics (replica check, first non-finite unit)
    profile.py   PhaseProfile: time per phase and per unit, the critical rank
    traffic.py   what the collectives moved, per group and per mesh dimension
    tensor.py    what tensor parallelism changes: the clipping norm, gathering the slices
    pipeline.py  what pipeline parallelism changes: the schedule, tied weights across stages
    hooks.py     EngineHooks (a model's way to its engine), as_config
"""
from zmpi.engine.core import Engine
from zmpi.engine.hooks import as_config
from zmpi.engine.profile import PhaseProfile

__all__ = ["Engine", "PhaseProfile", "as_config"]

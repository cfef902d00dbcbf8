"""`zmpi train`: the training run. Checks its inputs on every rank, builds the engine,
resumes (--resume), claims the checkpoint directory (--save-every), runs the loop with its
progress bar, checkpoints and preemption handling, and reports at the end."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from zmpi.checkpoint import CheckpointError
from zmpi.cli.config_from_flags import InputError, _get
from zmpi.cli.hf import init_from
from zmpi.cli.inputs import (
    _agree_on_inputs,
    _checked_inputs,
    _exit_bad_input,
    inputs_digest,
    llama_config,
    stage_origin,
)
from zmpi.cli.report import memory_table, traffic_line
from zmpi.models.gpt import GPT, GPTConfig
from zmpi.models.gpt_counts import gpt_num_params
from zmpi.models.llama import Llama, llama_num_params
from zmpi.nn.sparsity import MODES, model_layout
from zmpi.offload.files import NVMeError
from zmpi.parallel.mesh import Mesh
from zmpi.words import count


def train(args) -> None:
    from tqdm import tqdm

    from zmpi.comm import Comm
    from zmpi.config import ConfigError
    from zmpi.data import BatchSampler, FileWatch
    from zmpi.engine import Engine
    from zmpi.runinfo import (
        METRICS,
        PreemptionGuard,
        RunRecord,
        StepSummary,
        claim_out,
        rank_logger,
    )

    comm = Comm()
    where = f"config {args.config}" if args.config else "config from the flags"
    try:  # every input is checked on every rank before the first collective
        inputs, problem = _checked_inputs(args, comm.size), None
    except InputError as e:
        inputs, problem = None, str(e)
    except ConfigError as e:
        inputs, problem = None, f"{where}: {e}"
    except OSError as e:  # a path a node cannot search (EACCES), say
        inputs, problem = None, f"{e.filename}: {e.strerror}"
    _agree_on_inputs(comm, problem, None if inputs is None else inputs_digest(inputs))
    log = rank_logger(comm.rank, args.log_dir)  # --log-dir checked above
    tokenizer, train_tokens, val_tokens, vocab_size, config, notes = inputs
    # --data is read in place (memory-mapped): checked unchanged before each read of it
    read_data = FileWatch(args.data).check if args.data else lambda: None
    model_vocab = _get(config, "model.vocab_size") or vocab_size  # checked: >= vocab_size
    llama = _get(config, "model.model_type") == "llama"
    try:
        args.seed = config["seed"]  # the config's, unless --seed overrides it
        model_cfg = llama_config(args, config["model"], model_vocab) if llama else GPTConfig(
            model_vocab, args.seq_len, args.n_layer, args.n_head, args.d_model,
            _get(config, "model.vocab_multiple") or None)
        # the mesh first: a tensor-parallel model is split over its tp group as it is built
        mesh = Mesh(comm, tp=_get(config, "tensor_parallel.autotp_size") or 1,
                    pp=_get(config, "pipeline.stages") or 1, ep=_get(config, "moe.ep_size") or 1)
        common = {"seed": args.seed, "tp": mesh.tp_comm,
                  "dtype": np.float64 if args.precision == "fp64" else np.float32,
                  "sequence_parallel": _get(config, "tensor_parallel.sequence_parallel") is True}
        sparse = config.get("sparse_attention") or None
        model = Llama(model_cfg, sparse_attention=sparse, **common) if llama else GPT(
            model_cfg, sparse_attention=sparse, moe=config.get("moe") or None, **common)
        engine = Engine(model, config, comm, mesh=mesh)
    except (ValueError, MemoryError, NVMeError, OSError) as e:  # alike on every rank
        _exit_build_failure(e, where, comm.rank)
    for note in notes:
        log.info(note)
    cfg = engine.config
    rows = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps
    # every tensor and pipeline rank of a replica reads its replica's rows
    global_batch = rows * mesh.dp
    train_data = BatchSampler(train_tokens, args.seq_len, global_batch, mesh.dp_rank, mesh.dp,
                              seed=args.seed)
    val_data = BatchSampler(val_tokens, args.seq_len, global_batch, mesh.dp_rank, mesh.dp,
                            seed=args.seed + 1)
    total = llama_num_params(model_cfg) if llama else gpt_num_params(
        args.n_layer, args.d_model, model_vocab, args.seq_len, moe=config.get("moe") or None)
    log.info(f"zmpi train: {'Llama' if llama else 'GPT'} {total:,} params, "
             f"{count(comm.size, 'rank')} (dp {mesh.dp} x "
             f"pp {mesh.pp} x tp {mesh.tp}{f', ep {mesh.ep}' if mesh.ep > 1 else ''}), "
             f"{engine.strategy.name} "
             f"({stage_origin(args, config)}), {engine.dtype.name}, global batch "
             f"{global_batch} x {args.seq_len} tokens, {count(args.steps, 'step')}"
             + _attention_words(model, args.seq_len))

    out = Path(comm.bcast_object(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"))
    # with --save-every, a resumed run saves where it resumed from (unless --ckpt-dir)
    ckpt_dir = Path(args.ckpt_dir or (args.resume if args.save_every else None)
                    or out / "checkpoints")
    if args.init_from is not None and engine.experts is not None:
        _exit_bad_input(f"--init-from: Hugging Face weights into an expert-parallel run "
                        f"(moe.ep_size {mesh.ep}) are not built yet (docs/moe.md)")
    if args.init_from is not None:
        init_from(args, engine, log)
    first = _resume(args, engine, comm, log) if args.resume is not None else 0
    # --out is this run's own (a resumed run's: the run id its checkpoint recorded) or new,
    # and not another directory of the run's; rank 0 locks it for the run
    out_lock, refused = None, None
    if comm.rank == 0 and out.resolve() == ckpt_dir.resolve():
        refused = f"--out {out} is the checkpoint directory too: give two directories"
    elif comm.rank == 0:
        out_lock, refused = claim_out(out, engine.run_id)
    refused = comm.bcast_object(refused)
    if refused:
        _exit_bad_input(refused)
    if args.save_every:
        _claim(engine, ckpt_dir, args.overwrite_ckpt_dir, log)
    # run.json says "failed" if anything below raises (RunRecord.__exit__)
    # each MoE layer's expert load and drops per step, every stage's layers in block order
    experts = [layer.router.num_experts for layer in engine.moe.layers]
    if mesh.pp > 1:
        experts = [e for stage in mesh.pp_comm.allgather_object(experts) for e in stage]
    with RunRecord(out, comm, argv=sys.argv, config=cfg.to_dict(), model=vars(model_cfg),
                   engine=engine.describe(), first_step=first, run_id=engine.run_id,
                   lock=out_lock, columns=METRICS + _moe_columns(experts)) as record:
        guard = PreemptionGuard()
        summary = StepSummary()  # what the end needs; the rows go to metrics.csv only
        bar = tqdm(range(first, args.steps), disable=comm.rank != 0, file=sys.stdout,
                   mininterval=0.5, dynamic_ncols=True)
        start, skipped = time.perf_counter(), engine.scaler.skipped_steps  # before this run
        for step in bar:
            t0 = time.perf_counter()
            read_data()
            loss = engine.train_step(*train_data.sample(step))
            tokens_per_s = global_batch * args.seq_len / (time.perf_counter() - t0)
            summary.add(loss)
            moe = _moe_statistics(engine, mesh) if experts else []
            record.append((step, loss, tokens_per_s, engine.scaler.scale, engine.lr,
                           engine.scaler.skipped_steps,
                           *(x for load, dropped in moe for x in (dropped, *load.tolist()))))
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            if args.log_dir and step % cfg.steps_per_print == 0:
                log.info(f"step {step} loss {loss:.4f} tokens/s {tokens_per_s:.0f}")
            preempted = guard.requested(comm)
            if preempted or (args.save_every and ((step + 1) % args.save_every == 0
                                                  or step + 1 == args.steps)):
                t0, tag = time.perf_counter(), f"step{step + 1}"  # tags count steps done
                path = engine.save_checkpoint(ckpt_dir, tag, args.keep_last,
                                              async_=args.async_save and not preempted,
                                              client_state={"step": step + 1, "seed": args.seed})
                if args.log_dir or preempted:
                    log.info(f"{'started saving' if args.async_save else 'saved'} {path} "
                             f"({time.perf_counter() - t0:.2f} s)")
            if preempted:
                bar.close()
                engine.close()  # finishes the save
                log.info(f"zmpi train: {guard.received or 'a signal on another rank'}: stopped "
                         f"after {count(step + 1, 'step')} (checkpoint {tag}); go on "
                         f"with --resume {ckpt_dir}")
                record.close(status="preempted", last_step=step, checkpoint=str(ckpt_dir))
                return
        elapsed = time.perf_counter() - start
        engine.flush()  # a delayed update in flight lands before evaluation
        log.info(traffic_line(engine, summary.steps, engine.scaler.skipped_steps - skipped))
        profile = engine.phases.table(comm) if args.profile else None
        if profile:
            log.info("time per step by phase (ms):\n" + profile)
        read_data()
        val_loss = np.mean([engine.eval_loss(*val_data.sample(i)) for i in range(4)])
        mean_tps = summary.steps * global_batch * args.seq_len / elapsed
        log.info(f"loss {summary.first_loss:.3f} -> {summary.last_loss:.3f} (val {val_loss:.3f}); "
                 f"{mean_tps:,.0f} tokens/s over {elapsed:.1f} s")
        log.info(memory_table(engine, comm))

        if mesh.pp == 1:  # sampling runs the whole model on every rank
            prompt = (tokenizer.encode("ROMEO:\n") if tokenizer
                      else val_tokens[:8].astype(np.int64))
            ids = engine.model.generate(prompt[None, :], args.sample_tokens, temperature=0.8,
                                        rng=args.seed, vocab=vocab_size)[0]
            sample = tokenizer.decode(ids) if tokenizer else " ".join(map(str, ids.tolist()))
            log.info("--- sample ---\n" + sample)
        else:
            sample = f"(no sample: each of the {mesh.pp} pipeline stages holds part of the model)"
            log.info(sample)
        if comm.rank == 0:
            (out / "sample.txt").write_text(sample)
        memory, timing = engine.memory.snapshot(), engine.update_timing
        engine.close()  # finishes an --async-save save: its failure makes the run "failed"
        record.close(status="finished", val_loss=float(val_loss), tokens_per_s=mean_tps,
                     profile=profile, **summary.as_dict(), memory=memory,
                     optimizer_timing=timing)
        log.info(f"wrote {out}/run.json, metrics.csv, sample.txt")


def _moe_columns(experts: list[int]) -> tuple[str, ...]:
    """metrics.csv's columns for MoE layers of `experts` experts each (block order, j from
    0): moe<j>_dropped, the step's (token, choice) assignments over their expert's capacity,
    then moe<j>_load<e>, the assignments routed to expert e before drops, each summed over
    every rank's rows (`_moe_statistics`)."""
    return tuple(name for j, count in enumerate(experts) for name in (
        f"moe{j}_dropped", *(f"moe{j}_load{e}" for e in range(count))))


def _moe_statistics(engine, mesh) -> list:
    """The last step's [(load, dropped)] of every MoE layer in block order, summed over the
    data-parallel ranks (engine.moe.statistics); with pipeline stages, each stage's layers
    gathered in stage order. A collective: every rank calls it."""
    stats = engine.moe.statistics(mesh.dp_comm)
    if mesh.pp > 1:  # rank 0 writes metrics.csv; the stages hold different layers
        stats = [s for stage in mesh.pp_comm.allgather_object(stats) for s in stage]
    return stats


def _exit_build_failure(error, where: str, rank: int):
    """End `zmpi train` on what building the engine raised alike on every rank (the engine
    agrees on a failure of some ranks: zmpi.engine.checks.agreed_across_stages,
    zmpi.offload.files.open_on_every_rank): one line from rank 0, no traceback. Exit code 2
    for what the inputs ask (a config the engine refuses, a ConfigError or ValueError; a
    model that the config's memory_budget cannot hold, an OutOfMemory), 1 for what the
    machine lacks (the NVMe drive's space, an NVMeError; a file system, an OSError)."""
    if isinstance(error, (ValueError, MemoryError)):
        _exit_bad_input(f"{where}: {error}")
    said = (f"{error.filename}: {error.strerror}" if isinstance(error, OSError)
            and error.filename else error)
    if rank == 0:
        print(f"zmpi train: {said}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _attention_words(model, seq_len: int) -> str:
    """", sparse attention MODE (block b, x % of causal attention's blocks)" for the run's
    first line; "" for dense attention."""
    sparsity = model.sparse_attention
    if sparsity is None:
        return ""
    n = seq_len // sparsity.block
    kept = model_layout(sparsity, seq_len).sum() / (sparsity.num_heads * n * (n + 1) / 2)
    mode = next(m for m, cls in MODES.items() if isinstance(sparsity, cls))
    return f", sparse attention {mode} (block {sparsity.block}, {kept:.0%} of causal blocks)"


def _resume(args, engine, comm, log) -> int:
    """Load the checkpoint --resume names (or --ckpt-dir's); returns the step to go on from.
    A bad checkpoint ends the run on every rank with one line from rank 0 (and, if the newest
    checkpoint is damaged, the newest one that verifies as the way on)."""
    directory = args.resume or args.ckpt_dir or (Path(args.out) / "checkpoints" if args.out
                                                 else None)
    if directory is None:
        _exit_bad_input("--resume needs a directory, --ckpt-dir or --out")
    try:
        loaded = engine.load_checkpoint(directory, args.resume_tag,
                                        fallback=args.resume_fallback)
    except CheckpointError as e:
        if comm.rank == 0:
            print(f"zmpi train: cannot resume: {e}" + ("" if args.resume_tag else
                  _sound_alternative(directory)), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    saved_seed = loaded.client_state.get("seed", args.seed)
    notes = loaded.notes + ([f"the data seed is {args.seed} (the checkpoint had {saved_seed})"]
                            if saved_seed != args.seed else [])
    first = loaded.client_state.get("step")
    if first is None:  # saved by engine.save_checkpoint, not by zmpi train
        first = loaded.global_steps + engine.scaler.skipped_steps
        notes.append(f"the checkpoint records no zmpi train step; going on from step {first} "
                     "(its optimizer steps plus skipped steps)")
    elif type(first) is not int or first < 0:
        _exit_bad_input(f"cannot resume: {loaded.path}: client_state.step is {first!r}, not "
                        "a step")
    for note in notes:
        log.info(note)
    saved = loaded.mesh
    log.info(f"resumed from {loaded.path} (step {first}, saved by "
             f"{count(saved['dp'] * saved['pp'] * saved['tp'], 'rank')}, dp {saved['dp']} x pp "
             f"{saved['pp']} x tp {saved['tp']}, with {loaded.strategy}) on "
             f"{count(comm.size, 'rank')} "
             f"with {engine.strategy.name}")
    if first >= args.steps:
        _exit_bad_input(f"the checkpoint is at step {first}; ask for more --steps than that "
                        "to go on")
    return first


def _sound_alternative(directory) -> str:
    """When the newest checkpoint in `directory` does not load because it is damaged (it
    does not verify): the newest that verifies, as a hint to add to the error (rank 0,
    offline; reads each candidate whole)."""
    from zmpi.checkpoint import tools
    from zmpi.checkpoint.agreement import fallback_tags
    from zmpi.checkpoint.store import resolve_tag

    try:
        newest = resolve_tag(directory, None)
    except CheckpointError:
        newest = None
    try:
        sound = newest is not None and not tools.verify(directory, newest.name)
    except ValueError:  # a re-save's moved copy (.<tag>.partial): not a tag verify takes
        sound = False
    if sound:
        return ""  # the newest is sound: what failed (another model, say) is no damage
    for tag in fallback_tags(directory, newest):
        if not tools.verify(directory, tag):
            return (f"\n  the newest checkpoint that verifies is {Path(directory) / tag}: "
                    f"resume it with --resume-tag {tag}, or add --resume-fallback")
    return ""


def _claim(engine, ckpt_dir, overwrite, log) -> None:
    """Claim the checkpoint directory at start-up (with --save-every): another writer, another
    run's checkpoints or an unwritable directory end the run now (CheckpointError), not at
    the first save. (A save on preemption alone claims it when it saves.)"""
    held = engine.claim_checkpoint_dir(ckpt_dir, overwrite)
    for note in held.notes:
        log.info(note)
    if held.replace_others:
        log.info(f"--overwrite-ckpt-dir: the other run's checkpoints in {ckpt_dir} are deleted "
                 "once this run's first checkpoint is complete")

"""`zmpi train`'s inputs: the checks of its flags, the --data file and the config built from
them (zmpi.cli.config_from_flags). A bad input is an InputError (one line), which `zmpi train`
prints once, on rank 0, exiting with code 2 (`_exit_bad_input`)."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from zmpi.cli.config_from_flags import (
    DEFAULTS,
    MODEL_FLAGS,
    InputError,
    _read_config,
    build_config,
)
from zmpi.files import check_input, check_output_dir


def _rank() -> int:
    """This process's rank in MPI_COMM_WORLD; 0 outside an MPI launch (MPI is initialised only
    when the launcher's environment says it is one, or when it already is)."""
    import os

    launched = any(k in os.environ for k in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK",
                                             "PMI_SIZE", "SLURM_PROCID"))
    if not launched and "mpi4py.MPI" not in sys.modules:
        return 0
    from zmpi.comm import MPI  # zmpi.comm imports the backend before mpi4py.MPI

    return MPI.COMM_WORLD.Get_rank()


def _exit_bad_input(message: str):
    """End `zmpi train` on a bad input: `zmpi train: message` on rank 0's stderr only (every
    rank found the same problem), then SystemExit(2) on every rank, never a traceback."""
    if _rank() == 0:
        print(f"zmpi train: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def resolve_model_args(args) -> None:
    """--seq-len, --n-layer, --n-head and --d-model not given: the --config's `model` section
    (what `zmpi plan` writes; a Llama's num_hidden_layers, hidden_size and
    num_attention_heads), else DEFAULTS; a ConfigError naming the key if the section is
    not a valid one (a flag that overrides a key is noted by `build_config`)."""
    from zmpi.config import ConfigError, ModelConfig

    section = ModelConfig()
    if args.config:
        cfg = _read_config(args.config)
        given = cfg.get("model", {})
        if getattr(args, "model", None) is not None and isinstance(given, dict):
            given = {**given, "model_type": args.model}  # --model's family, as build_config
        try:
            section = ModelConfig.from_dict(given)
        except ConfigError as e:
            raise e.prefixed("model") from None
    for name in MODEL_FLAGS:  # a Llama's section names n_layer, d_model, n_head its own way
        if getattr(args, name) is None:
            value = section.shape_value(name)
            setattr(args, name, DEFAULTS[name] if value is None else value)


def check_args(args) -> None:
    """Every check of `zmpi train`'s flags and the config's model section that needs no
    data and no MPI (InputError or ConfigError, one line); fills the model flags
    (`resolve_model_args`). Run on every rank inside `_checked_inputs`, so a problem found
    on some ranks only ends them all alike."""
    resolve_model_args(args)
    check_train_args(args)
    if (args.resume_tag or args.resume_fallback) and args.resume is None:
        raise InputError("--resume-tag and --resume-fallback act only with --resume")
    if args.init_from is not None and args.resume is not None:
        raise InputError("--init-from and --resume: give one (--init-from starts a run from "
                         "weights, --resume goes on with one)")
    if args.overwrite_ckpt_dir and not args.save_every:
        raise InputError("--overwrite-ckpt-dir acts only with --save-every K")
    if args.vocab_size is not None and not args.data:
        raise InputError("--vocab-size acts only with --data (the shipped corpus has its own "
                         "vocabulary; a model's larger one is the config's model.vocab_size)")
    for flag, path in (("--out", args.out), ("--log-dir", args.log_dir)):
        try:  # a file, or /proc: the first write would be a traceback per rank
            if path is not None:
                check_output_dir(path, flag)
        except ValueError as e:
            raise InputError(str(e)) from None
    if args.out and args.resume is None and (Path(args.out) / "run.json").exists():
        raise InputError(f"--out {args.out} holds an earlier run (run.json): give another "
                         "directory, or --resume to go on with that run there")


INT_FLAGS = {  # dest: the least value the flag accepts
    "steps": 1, "batch": 1, "seq_len": 1, "n_layer": 1, "n_head": 1, "d_model": 1,
    "sample_tokens": 0, "warmup_steps": 1, "save_every": 0, "keep_last": 1,
    "shard_group_size": 1, "delay_update": 0,
    "vocab_size": 1,  # its largest: the --data file's ids' (uint16 or uint32), in load_tokens
}


def check_train_args(args) -> None:
    """The checks of `zmpi train`'s flags that need no file and no MPI; InputError (one line)
    on the first problem. The --data file, the config and their agreement with the flags are
    checked in `train` (`_checked_inputs`)."""
    for name, least in INT_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise InputError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    if args.d_model % args.n_head:
        raise InputError(f"--n-head {args.n_head} does not divide --d-model {args.d_model}")
    if not args.save_every and (args.keep_last is not None or args.async_save):
        raise InputError("--keep-last and --async-save act only with --save-every K")


def _check_sparse_layout(resolved, seq_len: int, n_head: int) -> None:
    """The config's sparse layout at --seq-len for the model's heads: seq_len a multiple of
    the block and every query block row keeping a key block (ConfigError, one line)."""
    from zmpi.config import ConfigError
    from zmpi.nn.sparsity import model_layout

    sparsity = resolved.sparse_attention.sparsity(n_head)
    if sparsity is None:
        return
    try:
        model_layout(sparsity, seq_len)
    except ValueError as e:
        raise ConfigError("sparse_attention", f"at --seq-len {seq_len}: {e}") from None


def _checked_inputs(args, world_size: int):
    """(tokenizer or None, train tokens, validation tokens, vocab size, config dict, notes):
    the data (--data, else Tiny Shakespeare) and the config (build_config), with what the
    engine would find wrong only later checked now: InputError or ConfigError, one line."""
    from zmpi.config import Config, ConfigError
    from zmpi.data import CharTokenizer, load_text, load_tokens, train_val_split
    from zmpi.zero import get_strategy

    check_args(args)
    if args.data:  # a binary token file, memory-mapped
        try:
            check_input(args.data, "--data")  # a FIFO or a device: the map would hang
        except ValueError as e:
            raise InputError(str(e)) from None
        try:
            tokens, vocab_size = load_tokens(args.data, args.vocab_size)
        except (OSError, ValueError) as e:
            raise InputError(f"--data {args.data}: {e}") from None
        tokenizer, source = None, f"--data {args.data}"
    else:
        text = load_text()
        tokenizer = CharTokenizer(text)
        tokens, vocab_size = tokenizer.encode(text), tokenizer.vocab_size
        source = "the Tiny Shakespeare corpus"
    train_tokens, val_tokens = train_val_split(tokens, 0.1)
    if min(len(train_tokens), len(val_tokens)) < args.seq_len + 1:
        raise InputError(f"{source}: {len(tokens)} tokens are too few for --seq-len "
                         f"{args.seq_len}: the training part (the first 90%, "
                         f"{len(train_tokens)}) and the validation part (the last 10%, "
                         f"{len(val_tokens)}) each need seq_len + 1 = {args.seq_len + 1}")
    notes = []
    config = build_config(args, world_size, notes)
    resolved = Config.from_dict(config)
    config["model"] = resolved.model.to_dict()  # its shape as ints: vocab_size 1e3 is 1000
    tp = resolved.tensor_parallel
    if tp.sequence_parallel and tp.autotp_size > 1 and args.seq_len % tp.autotp_size:
        raise InputError(f"--seq-len {args.seq_len} is not divisible by the tensor-parallel "
                         f"size {tp.autotp_size}: sequence parallelism gives every tensor rank "
                         "an equal share of the positions")
    _check_sparse_layout(resolved, args.seq_len, args.n_head)
    resolved.moe.layer_experts(args.n_layer)  # the MoE blocks are in the model
    planned = resolved.model.vocab_size
    if planned is not None and planned < vocab_size:
        raise ConfigError("model.vocab_size", f"{planned} is smaller than the vocabulary of "
                          f"{source} ({vocab_size})")
    dp = world_size // (resolved.tensor_parallel.autotp_size * resolved.pipeline.stages)
    resolved = resolved.resolve_batch(dp)  # what the engine checks
    try:  # "package.module:Class" imports (runs) that module here, as the engine would
        strategy = get_strategy(resolved.strategy_name)
    except ValueError as e:
        raise ConfigError("zero_optimization.strategy", str(e)) from None
    _check_stage_agrees(config, strategy)
    _check_nvme_paths(resolved)
    _check_plausible_sizes(args, resolved, planned or vocab_size, world_size)
    return tokenizer, train_tokens, val_tokens, vocab_size, config, notes


def llama_config(args, section: dict, vocab_size: int):
    """The LlamaConfig of --model llama: the shape flags (resolved from the model section's
    num_hidden_layers, hidden_size and num_attention_heads where not given), the vocabulary,
    and the section's Llama keys (max_position_embeddings: seq_len where not given); the
    model's ValueError where it refuses the shape."""
    from zmpi.config.sections import ModelConfig
    from zmpi.models.llama import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.d_model, num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head, seq_len=args.seq_len,
        vocab_multiple=section.get("vocab_multiple"),
        **{"max_position_embeddings": args.seq_len,
           **{k: section[k] for k in ModelConfig.LLAMA_ONLY if k in section}})


def _host_memory() -> int:
    """Bytes of physical memory of this machine."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_plausible_sizes(args, resolved, vocab: int, world_size: int) -> None:
    """Sizes no machine of this kind can hold, refused before anything is allocated (an
    InputError naming the flags and keys): the model's states, at 16 bytes a parameter (fp32
    master, Adam's m and v, a parameter and a gradient; a GPT's parameters by
    zmpi.models.gpt_counts.gpt_num_params, the `moe` section's MoE blocks included, a Llama's
    by zmpi.models.llama.llama_num_params) beyond the memory of `world_size` such machines
    and, with NVMe offload, the drive's free space; or one micro-batch's logits,
    (micro-batch, seq_len, vocab / tp) in fp32, beyond one machine's memory.
    `--n-layer 1000000000` grew memory with no first line, `--batch 1000000000` was an
    ArrayMemoryError per rank, `vocab_size: 1e12` NumPy's message naming no key."""
    import os
    import shutil

    from zmpi.config import ConfigError
    from zmpi.models.gpt_counts import gpt_num_params
    from zmpi.models.llama import llama_num_params
    from zmpi.words import count

    memory = _host_memory()
    d, tp, moe = args.d_model, resolved.tensor_parallel.autotp_size, resolved.moe
    llama = resolved.model.model_type == "llama"
    if llama:
        try:  # the shapes ModelConfig leaves to the model (a head size RoPE cannot rotate)
            params = llama_num_params(llama_config(args, resolved.model.to_dict(), vocab))
        except ValueError as e:
            raise ConfigError("model", str(e)) from None
    else:
        params = gpt_num_params(args.n_layer, d, vocab, args.seq_len, moe=moe)
    room, where = world_size * memory, f"the memory of {count(world_size, 'rank')} of this " \
        f"machine ({_gib(memory)} each)"
    zero = resolved.zero_optimization
    for section in (zero.offload_optimizer, zero.offload_param):
        if section.nvme:  # its directory checked (_check_nvme_paths), made when it is not
            drive = Path(os.path.abspath(section.nvme_path))
            while not drive.exists():
                drive = drive.parent
            room += shutil.disk_usage(drive).free
            where += f" and the free space of {section.nvme_path}"
    if 16 * params > room:
        experts = f", moe.num_experts {_show_experts(moe)}" if moe.enabled else ""
        raise InputError(f"the {'Llama' if llama else 'model'} (n_layer {args.n_layer:,}, "
                         f"d_model {d:,}, vocab_size {vocab:,}{experts}: {params:,} "
                         f"parameters) needs at least {_gib(16 * params)} for its states (16 "
                         f"bytes a parameter), more than {where}: check --n-layer, --d-model"
                         + (", model.vocab_size and moe.num_experts" if experts
                            else " and model.vocab_size"))
    micro = resolved.train_micro_batch_size_per_gpu
    logits = 4 * micro * args.seq_len * -(-vocab // tp)
    if logits > memory:
        raise InputError(f"a micro-batch of {micro:,} sequences (train_micro_batch_size_per_gpu"
                         f", of a global batch of {resolved.train_batch_size:,}) needs "
                         f"{_gib(logits)} for its logits alone ({micro:,} x seq_len "
                         f"{args.seq_len:,} x vocab_size {vocab:,} x 4 bytes), more than this "
                         f"machine's memory ({_gib(memory)}): check --batch, "
                         "train_micro_batch_size_per_gpu and model.vocab_size")


def _show_experts(moe) -> str:
    experts = moe.num_experts
    return str(list(experts)) if isinstance(experts, tuple) else f"{experts:,}"


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def stage_origin(args, config: dict) -> str:
    """Where the ZeRO stage (or strategy) of `config` (build_config's) came from, for the
    run's first line: a flag, the --config's key, or a default: without --config zmpi
    train's DEFAULT_STAGE, with one that gives no stage DeepSpeed's 0."""
    zero = config.get("zero_optimization") or {}
    if args.strategy is not None or args.stage is not None:
        return "--strategy" if args.strategy is not None else "--stage"
    if not args.config:
        return "zmpi train's default without --config"
    for key in ("strategy", "stage"):
        if zero.get(key) is not None:
            return f"zero_optimization.{key} in {args.config}"
    return f"DeepSpeed's default: {args.config} gives no zero_optimization.stage"


def _check_stage_agrees(config: dict, strategy) -> None:
    """A config (or flags) that names both a ZeRO stage and a strategy sharding otherwise
    (e.g. stage 1 and "stage3") is a ConfigError: the strategy would win without a word."""
    from zmpi.config import ConfigError

    zero = config.get("zero_optimization", {})
    if "stage" not in zero or zero.get("strategy") is None:
        return
    shards = (strategy.shard_parameters, strategy.shard_gradients, strategy.shard_optimizer)
    implied = 3 if shards[0] else 2 if shards[1] else 1 if shards[2] else 0
    if zero["stage"] != implied:
        raise ConfigError("zero_optimization.stage",
                          f"{zero['stage']} contradicts the strategy {zero['strategy']!r}, which "
                          f"shards as ZeRO stage {implied}: give one of them")


def _check_nvme_paths(resolved) -> None:
    """The NVMe tier's directories, checked on every rank before the engine builds (a node
    without one would otherwise fail alone)."""
    from zmpi.config import ConfigError
    from zmpi.offload.files import NVMeError, check_nvme_dir

    zero = resolved.zero_optimization
    for name, section in (("offload_optimizer", zero.offload_optimizer),
                          ("offload_param", zero.offload_param)):
        if section.nvme:
            try:
                check_nvme_dir(section.nvme_path)
            except NVMeError as e:
                raise ConfigError(f"zero_optimization.{name}.nvme_path", str(e)) from None


def inputs_digest(inputs) -> str:
    """What `_agree_on_inputs` compares across ranks: a hash of the resolved config dict, the
    vocabulary size and the token counts (`_checked_inputs`'s tuple), not of the tokens."""
    _, train_tokens, val_tokens, vocab_size, config, _ = inputs
    said = json.dumps([config, vocab_size, len(train_tokens), len(val_tokens)],
                      sort_keys=True, default=str)
    return hashlib.sha256(said.encode()).hexdigest()


def _agree_on_inputs(comm, problem: str | None, digest: str | None = None) -> None:
    """The ranks exchange the outcome of their own input checks and the `inputs_digest` of
    what they read (one allgather, before any collective of training): a problem on any
    rank (on some only, e.g. a file missing on one node), or ranks that read different
    configs or data (another file of the same name on another node), end every rank with
    exit code 2 and one line from rank 0."""
    found = comm.allgather_object((problem, digest))
    failed = [r for r, (p, _) in enumerate(found) if p is not None]
    if failed:
        only = "" if len(failed) == comm.size else \
            f" (on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} only)"
        _exit_bad_input(found[failed[0]][0] + only)
    differ = [r for r, (_, d) in enumerate(found) if d != found[0][1]]
    if differ:
        _exit_bad_input(f"the ranks read different inputs: the config, or the data's size, on "
                        f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                        "differs from rank 0's (each node reads its own copy of the files: "
                        "give every node the same ones)")

"""`zmpi plan`: the fastest layouts of a GPT on a cluster that fit its memory (zmpi.plan), with
their memory and time, and the best one written as a config `zmpi train` runs as is."""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from zmpi.cli.estimate import moe_flag
from zmpi.cli.inputs import _rank
from zmpi.config import ConfigError
from zmpi.config.sparse import sparse_attention_flag
from zmpi.files import check_output, write_atomic
from zmpi.models.gpt import default_vocab_multiple
from zmpi.models.gpt_counts import gpt_num_params
from zmpi.models.llama import llama_num_params
from zmpi.plan.hardware import parse_size
from zmpi.plan.layout import MODELS, PRECISIONS, Job, to_config
from zmpi.plan.measure import load_hardware
from zmpi.plan.search import RESERVE, plan
from zmpi.words import count


def add_parser(sub) -> None:
    """The `plan` subcommand's flags."""
    p = sub.add_parser("plan", help="choose dp x pp x tp, ZeRO stage, offload, recompute and "
                       "micro-batch for a GPT on a cluster (docs/plan.md)")
    p.add_argument("--model", choices=MODELS, default="gpt", help="the model family "
                   "(llama: --n-head query heads, docs/models.md)")
    p.add_argument("--n-kv-head", type=int, default=None,
                   help="a Llama's key/value heads (default: --n-head)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="a Llama's SwiGLU hidden units (default: 8/3 d rounded up to 8)")
    p.add_argument("--tie-word-embeddings", action="store_true",
                   help="a Llama whose LM head reads the token embedding")
    p.add_argument("--moe", metavar="E|JSON", default=None,
                   help="a GPT with mixture-of-experts blocks of E experts each in every block, "
                   "or a moe section as JSON without ep_size: the plan searches the "
                   "expert-parallel degree (docs/plan.md#mixture-of-experts)")
    for flag, text in (("--n-layer", "transformer blocks"), ("--d-model", "hidden size"),
                       ("--n-head", "attention heads"), ("--seq-len", "sequence length"),
                       ("--global-batch", "sequences per optimizer step"),
                       ("--nodes", "nodes"), ("--gpus-per-node", "GPUs (ranks) per node")):
        p.add_argument(flag, type=int, required=True, help=text)
    p.add_argument("--vocab", "--vocab-size", dest="vocab", type=int, required=True,
                   help="vocabulary size")
    p.add_argument("--precision", choices=PRECISIONS, default="fp16",
                   help="parameter and gradient storage (default fp16)")
    p.add_argument("--sparse-attention", metavar="MODE|JSON", default=None,
                   help="block-sparse attention: a mode at DeepSpeed's defaults (fixed, "
                   "bigbird, ...) or a sparse_attention section as JSON; the activations count "
                   "its kept blocks and the config written carries it (docs/sparse-attention.md)")
    p.add_argument("--hardware", default="a100",
                   help="a100, h100, h200, v100, cpu, this (measure this machine), or a JSON file "
                   "(docs/plan.md#hardware; default a100)")
    p.add_argument("--device-memory", metavar="SIZE", default=None,
                   help="memory per device, e.g. 80GB (default: the hardware's)")
    p.add_argument("--host-memory", metavar="SIZE", default=None,
                   help="host memory per node, e.g. 1TB (default: the hardware's)")
    p.add_argument("--top", type=int, default=5, help="how many layouts to print (default 5)")
    p.add_argument("--out", default="plan.json",
                   help="where the best layout's config goes (default plan.json)")
    p.add_argument("--save-hardware", metavar="FILE", default=None,
                   help="also write the hardware used (e.g. --hardware this, measured) as JSON")
    p.add_argument("--json", action="store_true",
                   help="print the job, hardware and candidates as JSON instead of a table")


def _sparse_section(flag: str | None) -> str | None:
    """--sparse-attention as the Job's canonical JSON section (None without it); ValueError
    naming the key if it is no layout."""
    if flag is None:
        return None
    try:
        section = sparse_attention_flag(flag).to_dict()
    except ConfigError as e:
        raise ValueError(f"--sparse-attention: {e}") from None
    return json.dumps(section, sort_keys=True)


def _moe_section(flag: str | None) -> str | None:
    """--moe as the Job's canonical JSON section (None without it); ValueError naming the
    flag if it is no section."""
    if flag is None:
        return None
    try:
        return json.dumps(moe_flag(flag), sort_keys=True)
    except ConfigError as e:
        raise ValueError(f"--moe {flag}: {e}") from None


def run(args) -> None:
    """`zmpi plan`: exits with code 2 and one line on a bad input, 1 if no layout fits.
    Under mpiexec (`--hardware this` then measures on every rank) rank 0 alone reports and
    writes; the other ranks end once the hardware is measured."""
    try:
        job = Job(args.n_layer, args.d_model, args.n_head, args.vocab, args.seq_len,
                  args.global_batch, args.nodes, args.gpus_per_node, args.precision,
                  _sparse_section(args.sparse_attention), model=args.model,
                  n_kv_head=args.n_kv_head, intermediate_size=args.intermediate_size,
                  tie_word_embeddings=args.tie_word_embeddings, moe=_moe_section(args.moe))
        if args.top < 1:
            raise ValueError(f"--top must be >= 1, got {args.top}")
        device = None if args.device_memory is None else \
            parse_size(args.device_memory, "--device-memory")
        host = None if args.host_memory is None else parse_size(args.host_memory, "--host-memory")
        _check_outputs(args)
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
        hw = load_hardware(args.hardware, progress=say)
        # the vocabulary padded as zmpi pads it on this hardware: what a run allocates
        job = dataclasses.replace(job, vocab_multiple=default_vocab_multiple(hw.on_gpu))
        if hw.on_gpu and job.gpus_per_node > hw.devices_per_node:
            raise ValueError(f"--gpus-per-node {job.gpus_per_node}: the {hw.name} hardware has "
                             f"{hw.devices_per_node} devices per node (its node's links); give "
                             "a hardware file for larger nodes")
    except ValueError as e:
        if _rank() == 0:
            print(f"zmpi plan: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if _rank() != 0:
        return
    if args.save_hardware:
        _write(args.save_hardware, hw.save)
    start = time.perf_counter()
    try:
        result = plan(job, hw, device, host, args.top,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"zmpi plan: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    seconds = time.perf_counter() - start
    if not result.considered:
        print(f"zmpi plan: no layout of {count(job.world_size, 'rank')} splits the global batch "
              f"{job.global_batch}: the data-parallel ranks (the ranks over tp x pp, tp dividing "
              f"the {job.n_head} heads within a node, pp at most the {job.n_layer + 2} units) "
              "must divide it; give another --global-batch or fewer ranks", file=sys.stderr)
        raise SystemExit(2)
    if args.json:
        print(json.dumps({"job": job.__dict__, "hardware": hw.to_dict(),
                          "considered": result.considered, "fitting": result.fitting,
                          "rejected": result.rejected, "seconds": seconds,
                          "candidates": [c.to_dict() for c in result.best]}, indent=2))
    else:
        _print_table(job, hw, result, device, seconds)
    if not result.best:
        print("zmpi plan: no layout fits; give more nodes, more memory, or a smaller model or "
              "batch", file=sys.stderr)
        raise SystemExit(1)
    config = json.dumps(to_config(job, result.best[0].layout), indent=2) + "\n"
    _write(args.out, lambda path: write_atomic(Path(path), config.encode()))
    launch = (f"mpiexec -n {job.world_size} python -m zmpi.cli train --config "
              f"{shlex.quote(args.out)}")
    print(f"wrote {args.out} (layout 1); run it: {launch}",
          file=sys.stderr if args.json else sys.stdout)


def _check_outputs(args) -> None:
    """ValueError before any work if --out or --save-hardware cannot be written
    (zmpi.files.check_output: a directory, a device or FIFO, a read-only or missing
    directory), or if two of the files would be one: the plan over the saved hardware, or
    over the hardware read."""
    paths = {"--out": args.out}
    if args.save_hardware is not None:
        paths["--save-hardware"] = args.save_hardware
    for flag, path in paths.items():
        check_output(path, flag)
    if args.save_hardware is not None and \
            Path(args.out).resolve() == Path(args.save_hardware).resolve():
        raise ValueError(f"--out and --save-hardware name one file, {args.out}: give two")
    if Path(args.hardware).is_file():
        for flag, path in paths.items():
            if Path(path).resolve() == Path(args.hardware).resolve():
                raise ValueError(f"{flag} {path} is the --hardware file it would replace")


def _write(path: str, write) -> None:
    """write(path), a failure of the disk (full, say: checked writable at the start) one line
    and exit code 1; the file is then as it was (written whole or not at all)."""
    try:
        write(path)
    except OSError as e:
        print(f"zmpi plan: {path}: not written: {e.strerror or e}", file=sys.stderr)
        raise SystemExit(1) from None


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}"


def _print_table(job: Job, hw, result, device, seconds) -> None:
    if job.llama is None:
        psi = gpt_num_params(job.n_layer, job.d_model, job.vocab_size, job.seq_len,
                             moe=job.moe_section)
        name = "GPT" if job.moe is None else \
            f"GPT with {count(len(job.moe_section.layer_experts(job.n_layer)), 'MoE block')}"
    else:
        c = job.llama
        psi, name = llama_num_params(c), (f"Llama ({c.num_key_value_heads} key/value heads, "
                                          f"SwiGLU {c.intermediate_size})")
    device = hw.device_memory if device is None else device
    print(f"{name} {count(job.n_layer, 'layer')}, d {job.d_model}, {count(job.n_head, 'head')}, "
          f"vocab {job.vocab_size}, seq {job.seq_len}: {psi / 1e9:.4g} B parameters, "
          f"{job.precision}; batch {job.global_batch}; {job.nodes} x {job.gpus_per_node} = "
          f"{count(job.world_size, 'rank')} of {hw.name} ({_gb(device)} GB "
          f"{'each' if hw.on_gpu else 'per node'}, plans use {RESERVE:.0%})")
    rejected = ", ".join(f"{n} need{'s' if n == 1 else ''} more {why}"
                         for why, n in result.rejected.items() if n)
    print(f"{result.considered} layouts considered in {seconds:.1f} s, {result.fitting} fit"
          + (f" ({rejected})" if rejected else ""))
    if not result.best:
        return
    width = max(len(c.layout.describe()) for c in result.best)
    print(f"{'#':>2}  {'layout':<{width}} {'dev GB':>7} {'host GB':>7} {'step s':>8} "
          f"{'tokens/s':>10} {'TFLOP/s/GPU':>11}")
    for i, c in enumerate(result.best, 1):
        tflops = c.model_flops / c.time.total / job.world_size / 1e12
        print(f"{i:>2}  {c.layout.describe():<{width}} {_gb(c.memory.device):>7} "
              f"{_gb(c.memory.host):>7} {c.time.total:>8.4g} {c.tokens_per_s:>10.4g} "
              f"{tflops:>11.4g}")
    best = result.best[0]
    m, t = best.memory, best.time
    print(f"layout 1, per rank of pipeline stage {m.stage} (GB): model states "
          f"{_gb(m.model_state['device'])} on the device and {_gb(m.model_state['host'])} on "
          f"the host, activations {_gb(m.activation['device'])} and ZeRO buffers beyond them "
          f"{_gb(m.transient)} at the peak {_gb(m.device)}")
    print("layout 1, per step (s): " + ", ".join(
        f"{k} {v:.4g}" for k, v in t.to_dict().items() if k != "total"))

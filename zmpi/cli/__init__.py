"""The `zmpi` command.

    mpiexec -n 2 python -m zmpi.cli train --stage 3          # what `make demo` runs
    mpiexec -n 4 python -m zmpi.cli train --config configs/gpt_stage2_fp16.json --steps 200
    python -m zmpi.cli estimate --params 7.5e9 --world-size 64   # the ZeRO paper's Fig. 1
    python -m zmpi.cli plan --n-layer 24 --d-model 2304 --n-head 24 --vocab 51200 \
        --seq-len 2048 --global-batch 512 --nodes 4 --gpus-per-node 8 --hardware a100
    mpiexec -n 2 python -m zmpi.cli train --stage 2 --offload-optimizer --delay-update
    mpiexec -n 2 python -m zmpi.cli train --save-every 100 --ckpt-dir ckpt --steps 300
    mpiexec -n 4 python -m zmpi.cli train --resume ckpt --steps 600   # any world size
    python -m zmpi.cli ckpt inspect ckpt        # also: verify, consolidate ckpt out.h5
    python -m zmpi.cli ckpt import-hf gpt2-dir ckpt   # and export-hf ckpt dir: transformers'
    python -m zmpi.cli data prepare --tokenizer tokenizer.json corpus.txt data/train.bin

`train` trains a character-level GPT on the shipped Tiny Shakespeare corpus with any ZeRO
stage, shows a progress bar on rank 0 (loss, tokens/s), prints every rank's measured
model-state memory next to the paper's formula, samples some text, and writes the run's config,
git revision, environment, metrics and sample to `--out` (default runs/<time>). With
`--save-every K` it saves a sharded checkpoint every K steps and at the end; `--resume` goes
on from the newest one, at any world size and stage. `ckpt` inspects, verifies and
consolidates checkpoints without MPI.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

from zmpi.checkpoint import CheckpointError
from zmpi.cli import ckpt, data, estimate, hf, plan, train
from zmpi.cli.config_from_flags import (
    DEFAULT_STAGE,
    DEFAULTS,
    MODEL_FLAGS,
    MOE_FLAGS,
    SCHEDULE_FLAGS,
)
from zmpi.cli.inputs import _rank
from zmpi.config import RECOMPUTE
from zmpi.config.sections import ModelConfig
from zmpi.data import DataChanged
from zmpi.offload.files import NVMeError
from zmpi.runinfo import RecordError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error (every rank parses the same argv) is one line, printed by
    rank 0 only: `zmpi train: argument --steps: invalid int value: 'x'`, exit code 2."""

    def error(self, message):
        if _rank() == 0:
            print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr,
                  flush=True)
        raise SystemExit(2)


def _repeated_flags(argv) -> list[str]:
    """The --flags that `argv` gives more than once (before a lone --)."""
    seen, repeated = set(), []
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            if name in seen and name not in repeated:
                repeated.append(name)
            seen.add(name)
    return repeated


def main(argv=None) -> None:
    parser = _Parser(prog="zmpi", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a char-level GPT on Tiny Shakespeare")
    t.add_argument("--config", help="DeepSpeed-style JSON config (flags below override it)")
    t.add_argument("--stage", type=int, choices=range(4),
                   help=f"ZeRO stage (default: without --config {DEFAULT_STAGE}; with --config its "
                   "zero_optimization.stage, and 0 where it gives none, as in DeepSpeed)")
    t.add_argument("--strategy", help="a registered partition strategy, an installed "
                   "entry point, or package.module:ClassName (overrides the stage)")
    t.add_argument("--tp", type=int, metavar="T", default=None,
                   help="tensor-parallel degree of the process mesh (tensor_parallel."
                   "autotp_size): each GPT block split over T ranks by heads and features")
    t.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="with --tp T > 1: sequence parallelism (tensor_parallel."
                   "sequence_parallel): LayerNorms and residual adds on a 1/T shard of each "
                   "sequence; --seq-len a multiple of T. No effect at T = 1")
    t.add_argument("--pp", type=int, metavar="P", default=None,
                   help="pipeline-parallel degree of the process mesh (pipeline.stages): the "
                   "GPT's units cut into P stages, micro-batches (the config's "
                   "gradient_accumulation_steps) pipelined by "
                   "the config's pipeline.schedule (default 1f1b)")
    t.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="activation recompute (activation_checkpointing.recompute): selective "
                   "drops the attention probabilities, full keeps only each unit's input; the "
                   "same gradients, less activation memory, more compute (default none)")
    t.add_argument("--sparse-attention", metavar="MODE", default=None,
                   choices=("none", "dense", "fixed", "variable", "bigbird", "bslongformer",
                            "local"),
                   help="block-sparse attention (the config's sparse_attention section) with "
                   "that mode's DeepSpeed defaults (block 16), or the config's keys where it "
                   "names the same mode; none: dense attention. --seq-len a multiple of the "
                   "block (docs/sparse-attention.md)")
    for flag, key, kind, meta, say in MOE_FLAGS:
        t.add_argument(flag, type=kind, metavar=meta, default=None, help=f"{say} (moe.{key}; "
                       "docs/moe.md)")
    t.add_argument("--shard-group-size", type=int, metavar="G", default=None,
                   help="hybrid strategies: shard over groups of G ranks (default: a node)")
    t.add_argument("--precision", choices=("fp32", "fp16", "bf16", "fp64"), default=None,
                   help="parameter/gradient storage; overrides the config's fp16/bf16 "
                   "sections (default: from --config, else fp32). fp64: a float64 model, "
                   "master and Adam state, for parity checks: any number of ranks trains as "
                   "one process does, to rounding (docs/stages.md)")
    t.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    t.add_argument("--batch", type=int, default=None,
                   help="sequences per optimizer step over all ranks and accumulation steps "
                   f"(default: the config's train_batch_size, else {DEFAULTS['batch']})")
    t.add_argument("--lr", type=float, default=None, help=f"default {DEFAULTS['lr']}")
    t.add_argument("--lr-schedule", choices=SCHEDULE_FLAGS, default=None,
                   help="DeepSpeed schedule to --lr (warm-up from 0, log-shaped as DeepSpeed's "
                   "default; decay/cosine end at --steps); default: the config's, else constant")
    t.add_argument("--warmup-steps", type=int, metavar="W", default=None,
                   help="warm-up steps of the schedule (alone: WarmupLR)")
    t.add_argument("--model", choices=("gpt", "llama"), default=None,
                   help="the model family (model.model_type; default: the config's, else "
                   "gpt): llama is RMSNorm, grouped-query attention with RoPE, SwiGLU and an "
                   "untied head, its model section in transformers' LlamaConfig names "
                   "(docs/models.md)")
    for name in MODEL_FLAGS:
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None,
                       help=f"the model's {name} (model.{name}, a Llama's model."
                       f"{ModelConfig.LLAMA_NAMES.get(name, name)}; default: the config's, else "
                       f"{DEFAULTS[name]})")
    t.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: master weights, Adam state and update on the host "
                   "(sets zero_optimization.offload_optimizer.device=cpu; stages 1-3)")
    t.add_argument("--offload-param", action="store_true",
                   help="stage 3: parameter shards on the host (offload_param.device=cpu)")
    t.add_argument("--delay-update", type=int, metavar="WARMUP", default=None,
                   help="one-step delayed update after WARMUP synchronous steps (implies "
                   "--offload-optimizer; the paper uses 40)")
    t.add_argument("--seed", type=int, default=None,
                   help="model init and data order (default: the config's seed, else 0)")
    t.add_argument("--sample-tokens", type=int, default=200)
    t.add_argument("--data", metavar="FILE.bin", help="train on a flat uint16 token file "
                   "(nanoGPT's format; uint32 where its meta.json says so, as zmpi data "
                   "prepare writes; memory-mapped; the last 10%% is validation) instead of "
                   "Tiny Shakespeare")
    t.add_argument("--vocab-size", type=int, default=None,
                   help="the vocabulary of --data (default: meta.json or meta.pkl beside it)")
    t.add_argument("--profile", action="store_true",
                   help="print (and save in run.json) each rank's time per step by phase: "
                   "forward, backward, step, optimizer, waited-for communication (the "
                   "first step, a warm-up, left out when there are more), and per unit, with "
                   "full recompute its recomputes' (activation_checkpointing.profile)")
    t.add_argument("--out", help="output directory (default runs/<time>)")
    t.add_argument("--log-dir", help="every rank logs to LOG_DIR/rank<r>.log")
    t.add_argument("--save-every", type=int, metavar="K", default=0,
                   help="save a checkpoint every K steps and at the end (default: never)")
    t.add_argument("--ckpt-dir", help="checkpoint directory (default OUT/checkpoints)")
    t.add_argument("--keep-last", type=int, metavar="K", default=None,
                   help="keep only the K newest checkpoints (default: all)")
    t.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background thread while training goes on")
    t.add_argument("--resume", nargs="?", const="", default=None, metavar="DIR",
                   help="go on from the newest checkpoint in DIR (default: --ckpt-dir), "
                   "continuing its run; with --save-every, DIR is where it saves unless "
                   "--ckpt-dir")
    t.add_argument("--resume-tag", metavar="TAG", default=None,
                   help="with --resume: this checkpoint instead of the newest")
    t.add_argument("--resume-fallback", action="store_true",
                   help="with --resume: if the newest checkpoint does not load, the newest one "
                   "that does")
    t.add_argument("--overwrite-ckpt-dir", action="store_true",
                   help="start a new run in a checkpoint directory that holds another run's "
                   "checkpoints: they are deleted once this run's first one is complete "
                   "(without this flag such a directory is refused)")
    t.add_argument("--init-from", metavar="DIR", default=None,
                   help="start from the weights of a transformers model directory (its model "
                   "must be this run's): fresh optimizer state, step 0 (docs/checkpoints.md)")
    e = sub.add_parser("estimate", help="model-state memory per rank from the ZeRO formulas")
    e.add_argument("--params", type=float, default=None,
                   help="the model's parameter count Psi (e.g. 7.5e9); or give a GPT shape")
    for flag, text in (("--n-layer", "layers"), ("--d-model", "hidden size"),
                       ("--vocab-size", "vocabulary"), ("--seq-len", "context length")):
        default = estimate.SHAPE_DEFAULTS.get(flag[2:].replace("-", "_"))
        e.add_argument(flag, type=int, default=None,
                       help=f"GPT shape instead of --params: {text}"
                       + ("" if default is None else f" (default {default})"))
    e.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                   help="the shape's family (default gpt); llama: RMSNorm, grouped-query "
                   "attention, SwiGLU, untied head, needs --n-head (docs/models.md)")
    e.add_argument("--n-kv-head", type=int, default=None, metavar="KV",
                   help="with --model llama: key/value heads (default --n-head)")
    e.add_argument("--intermediate-size", type=int, default=None, metavar="F",
                   help="with --model llama: SwiGLU's hidden units (default 8/3 d_model, up to "
                   "a multiple of 8)")
    e.add_argument("--tie-word-embeddings", action="store_true",
                   help="with --model llama: the output head tied to the token embedding")
    e.add_argument("--vocab-multiple", type=int, default=1, metavar="M",
                   help="with a GPT shape: the vocabulary padded to a multiple of M x --tp, as "
                   "allocated (zmpi pads to 128 on a GPU: docs/gpu.md; default 1, unpadded)")
    e.add_argument("--world-size", type=int, required=True,
                   help="ranks N (data-parallel ranks: N / --tp)")
    e.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel degree: each rank holds 1/T of the split parameters "
                   "(exactly, for a GPT shape; Psi / T for --params), ZeRO partitions that over "
                   "N / T ranks (default 1)")
    e.add_argument("--micro-batch", type=int, default=None, metavar="B",
                   help="with a GPT shape: sequences per rank per micro-step, for the "
                   "activation memory per rank (docs/activation-memory.md) and, with --tp, "
                   "the tensor-parallel traffic per step")
    e.add_argument("--n-head", type=int, default=None,
                   help="with --micro-batch: attention heads (default: d_model / 64, GPT-2's "
                   "64-channel heads, and at least --tp)")
    e.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="with --micro-batch: the activation recompute policy the activation "
                   "memory is for (default none)")
    e.add_argument("--partition-activations", action="store_true",
                   help="with --recompute full and --tp above 1: each kept input split over "
                   "the tensor ranks (activation_checkpointing.partition_activations)")
    e.add_argument("--cpu-checkpointing", action="store_true",
                   help="with --recompute full: the kept inputs on the host "
                   "(activation_checkpointing.cpu_checkpointing)")
    e.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp and --micro-batch: the traffic of sequence parallelism "
                   "(reduce-scatters and allgathers in place of the blocks' allreduces) and its "
                   "activations (the LayerNorms' on the sequence shard)")
    e.add_argument("--sparse-attention", metavar="MODE|JSON", default=None,
                   help="with --micro-batch: block-sparse attention's activations, a mode at "
                   "DeepSpeed's defaults (fixed, bigbird, ...) or a sparse_attention section "
                   "as JSON (docs/sparse-attention.md)")
    e.add_argument("--moe", metavar="E|JSON", default=None,
                   help="with a GPT shape: mixture-of-experts blocks of E experts each in every "
                   "block, or a moe config section as JSON (docs/moe.md); their experts count "
                   "in Psi (each tensor rank's share with --tp), and at its ep_size above 1 "
                   "their states per rank over the data-parallel size / ep ranks holding the "
                   "same experts (offloaded as the dense ones with the offload flags); with "
                   "--micro-batch (--tp 1) their activations and, at ep_size above 1, the "
                   "all-to-all per micro-batch")
    e.add_argument("--stage", type=int, choices=range(4), default=None,
                   help="one ZeRO stage (default: all four)")
    e.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16",
                   help="fp16/bf16: 2-byte params and grads; fp32: 4-byte; K = 12 either way "
                   "(zmpi keeps fp32 master weights, Adam m and v); activations: 2-byte with "
                   "fp16 (as on a GPU), 4-byte with bf16 and fp32 (default fp16)")
    e.add_argument("--param-bytes", type=int, default=None,
                   help="bytes per parameter and per gradient (overrides --precision)")
    e.add_argument("--optimizer-bytes", type=int, default=None,
                   help="optimizer bytes per parameter K (overrides --precision)")
    e.add_argument("--offload-optimizer", action="store_true",
                   help="ZeRO-Offload: master weights, Adam state and gradient shard on the host")
    e.add_argument("--offload-param", action="store_true",
                   help="stage 3 parameter shards on the host")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_parser(sub)
    c = sub.add_parser("ckpt", help="inspect, verify or consolidate a checkpoint, or exchange "
                       "it with transformers (no MPI)")
    csub = c.add_subparsers(dest="ckpt_command", required=True)
    for name, text in (("inspect", "print the manifest: step, world size, dtypes, files"),
                       ("verify", "check every checksum; exit code 0 if sound, else 1"),
                       ("consolidate", "one file of full fp32 tensors (tied weights once)")):
        p = csub.add_parser(name, help=text)
        p.add_argument("directory", help="checkpoint directory (the one holding `latest`)")
        if name == "consolidate":
            p.add_argument("out", help="output file (.h5, or .npz with --npz)")
            p.add_argument("--npz", action="store_true", help="write a NumPy .npz")
        p.add_argument("--tag", help="which checkpoint (default: the one `latest` names)")
    hf.add_parsers(csub)
    data.add_parser(sub)
    args = parser.parse_args(argv)
    for flag in _repeated_flags(sys.argv[1:] if argv is None else argv):
        if _rank() == 0:  # a wrapper's appended flag overrides, but never unnoticed
            print(f"zmpi: {flag} given more than once: the last one counts", file=sys.stderr,
                  flush=True)
    if args.command == "train":
        try:
            train.train(args)
        except CheckpointError as e:  # raised alike on every rank: the ranks agree first
            if _rank() == 0:
                print(f"zmpi train: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except (NVMeError, RecordError, DataChanged) as e:  # this rank's drive failed in a
            from zmpi.comm.faults import fail_alone  # step, or --out's, or its --data file
            # changed (on its node only, perhaps): its peers cannot know

            fail_alone(f"zmpi train: {e}", 1)
    else:
        with _reader_may_close():
            if args.command == "ckpt":
                (hf.run if args.ckpt_command in hf.COMMANDS else ckpt.ckpt)(args)
            elif args.command == "plan":
                plan.run(args)
            elif args.command == "data":
                data.run(args)
            else:
                try:
                    estimate.estimate(args)
                except estimate.Refused as e:
                    print(e, file=sys.stderr, flush=True)
                    raise SystemExit(2) from None


@contextlib.contextmanager
def _reader_may_close():
    """A command whose reader stops early (`zmpi ckpt inspect DIR | head`): exit quietly with
    status 1, as the Python documentation's recipe does, instead of a BrokenPipeError
    traceback (stdout flushed here, then sent to /dev/null so the exit's flush cannot raise)."""
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None

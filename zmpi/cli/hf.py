"""`zmpi ckpt import-hf|export-hf` and `zmpi train --init-from`: weights exchanged with
transformers' model directories (zmpi.checkpoint.hf). The two ckpt commands run offline,
without MPI."""
from __future__ import annotations

import sys

from zmpi.checkpoint import CheckpointError

COMMANDS = ("import-hf", "export-hf")
DTYPES = ("float16", "bfloat16", "float32", "float64")


def add_parsers(csub) -> None:
    """The two commands, under `zmpi ckpt`'s sub-parsers `csub`."""
    p = csub.add_parser("import-hf", help="a transformers model directory (config.json, "
                        "model.safetensors) as a zmpi checkpoint that any layout loads")
    p.add_argument("directory", help="the model directory (save_pretrained's)")
    p.add_argument("out", help="the checkpoint directory to write (new or empty)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter storage dtype (default: the directory's); master weights "
                   "float32 (float64 with float64)")
    p = csub.add_parser("export-hf", help="a checkpoint of any layout as a transformers model "
                        "directory (AutoModelForCausalLM.from_pretrained loads it)")
    p.add_argument("directory", help="checkpoint directory (the one holding `latest`)")
    p.add_argument("out", help="the model directory to write (config.json, "
                   "generation_config.json, model.safetensors)")
    p.add_argument("--tag", help="which checkpoint (default: the one `latest` names)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the weights' dtype (default: the checkpoint's parameter dtype)")
    p.add_argument("--n-head", type=int, default=None,
                   help="attention heads, for a GPT-2 checkpoint whose config has no model "
                   "section (saved by a script, not zmpi train; a Llama's must have one)")


def run(args) -> None:
    """zmpi ckpt import-hf|export-hf: exit code 2 on a bad argument (an output that cannot be
    written, a --n-head that disagrees), 1 on a problem of the directory, the checkpoint or
    the disk: one line each."""
    from zmpi.checkpoint import hf

    try:
        if args.ckpt_command == "import-hf":
            path = hf.import_hf(args.directory, args.out, args.dtype)
        else:
            path = hf.export_hf(args.directory, args.out, args.tag, args.dtype, args.n_head)
        print(f"wrote {path}")
    except (CheckpointError, ValueError) as e:
        print(f"zmpi ckpt {args.ckpt_command}: {e}", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, CheckpointError) else 2) from None


def init_from(args, engine, log) -> None:
    """zmpi train --init-from DIR: the weights of a transformers directory, after the engine
    is built (a collective; not with --resume: zmpi.cli.inputs.check_args)."""
    from zmpi.checkpoint import hf

    log.info(hf.init_from(engine, args.init_from))  # a CheckpointError on every rank

"""`zmpi ckpt inspect|verify|consolidate`: checkpoints offline, without MPI."""
from __future__ import annotations

import sys

from zmpi.checkpoint import CheckpointError
from zmpi.words import count


def ckpt(args) -> None:
    """zmpi ckpt inspect|verify|consolidate: offline, no MPI. Exit code 2 on a bad argument
    (a tag that is no file name, an output consolidate cannot write), 1 on any problem of the
    checkpoint or the disk."""
    from zmpi.checkpoint import tools

    try:
        if args.ckpt_command == "inspect":
            print(tools.inspect(args.directory, args.tag))
        elif args.ckpt_command == "verify":
            problems = tools.verify(args.directory, args.tag)
            for problem in problems:
                print(problem)
            print(count(len(problems), "problem") if problems else "ok: every checksum matches")
            for note in tools.runs_note(args.directory, args.tag):
                print(f"note: {note}")
            raise SystemExit(1 if problems else 0)
        else:
            out = tools.consolidate(args.directory, args.out, args.tag, args.npz)
            print(f"wrote {out}")
    except (CheckpointError, ValueError) as e:
        print(f"zmpi ckpt {args.ckpt_command}: {e}", file=sys.stderr)
        raise SystemExit(1 if isinstance(e, CheckpointError) else 2) from None

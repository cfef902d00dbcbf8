"""`zmpi data prepare`: a text corpus tokenized with a local tokenizer.json into the token file
`zmpi train --data` reads, and its meta.json (zmpi.data.prepare). Offline, without MPI."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    """`zmpi data` and its `prepare` command, under the zmpi parser's sub-parsers `sub`."""
    d = sub.add_parser("data", help="prepare token files for zmpi train --data (no MPI)")
    dsub = d.add_subparsers(dest="data_command", required=True)
    p = dsub.add_parser("prepare", help="tokenize a UTF-8 text file with a tokenizer.json "
                        "(the tokenizers package: pip install 'zmpi[data]') into FILE.bin and "
                        "meta.json beside it")
    p.add_argument("--tokenizer", required=True, metavar="FILE",
                   help="a Hugging Face tokenizer.json (a local file; nothing is fetched)")
    p.add_argument("corpus", help="the UTF-8 text file, read in pieces that end at line ends")
    p.add_argument("out", help="the token file to write (uint16 ids for a vocabulary of up to "
                   "65536, else uint32); meta.json goes beside it")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (and a meta.json for other tokens)")


def run(args) -> None:
    """zmpi data prepare: prints what it wrote; a bad input is one line, exit code 2."""
    from zmpi.data.prepare import prepare

    try:
        info = prepare(args.tokenizer, args.corpus, args.out, args.overwrite)
    except ValueError as e:
        print(f"zmpi data prepare: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {info['out']}: {info['tokens']:,} tokens, {info['dtype']}, vocab_size "
          f"{info['vocab_size']:,} ({info['meta']})")

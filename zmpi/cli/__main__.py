"""`python -m zmpi.cli ...`, or `python zmpi/cli/__main__.py ...` (how the tests launch it
under mpiexec): the `zmpi` command, zmpi.cli.main."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if not __package__ and sys.path and Path(sys.path[0] or ".").resolve() == HERE:
    del sys.path[0]  # run by path: its train.py, report.py, ... are not top-level modules

from zmpi.cli import main  # noqa: E402

if __name__ == "__main__":
    main()

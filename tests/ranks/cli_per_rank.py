"""`zmpi` with every "{rank}" in its arguments replaced by this process's rank (the launcher's
PMI_RANK, read before MPI starts), so a test can give each rank a file of its own:

    mpiexec -n 2 python tests/ranks/cli_per_rank.py train --config c{rank}.json
"""
import os
import sys

from zmpi.cli import main

sys.argv[1:] = [arg.replace("{rank}", os.environ.get("PMI_RANK", "0")) for arg in sys.argv[1:]]
main()

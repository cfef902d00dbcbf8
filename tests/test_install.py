"""How zmpi is installed and launched: MPI is an extra (the mpich wheel on a workstation, the
site's MPI on a cluster, `make test MPI=system`), the Makefile's targets pass their options on,
and the SLURM job script keeps its log and starts every MPI program inside a job step."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import REPO_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def _make(*args) -> subprocess.CompletedProcess:
    """What `make ARGS` would run, as if nothing were installed yet (-B: every target).
    Without the calling make's MAKELEVEL and MAKEFLAGS (`make test` runs this suite), so
    that the output is the same as from a shell: no "Entering directory" lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-n", "-B", "--no-print-directory", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


def test_mpi_is_an_extra_not_a_dependency():
    """A source-built mpi4py satisfies zmpi: pip warned "zmpi requires mpich" when the wheel
    was a dependency."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if re.match(r"mpich\b", d)]
    assert any(d.startswith("mpi4py") for d in project["dependencies"])
    assert project["optional-dependencies"]["mpich"] == ["mpich>=4.2"]
    assert not any("mpich" in d for d in project["optional-dependencies"]["gpu"])


def test_make_installs_the_mpich_wheel_unless_mpi_is_system():
    wheel = _make("install", "MPI=wheel").stdout
    assert "-e '.[dev,mpich]'" in wheel and ".venv/bin/python" in wheel
    assert _make("install").stdout == wheel  # the default
    system = _make("test", "MPI=system").stdout
    assert "MPICC=$(command -v mpicc) .venv-system/bin/python -m pip install" in system
    assert "--no-binary=mpi4py 'mpi4py>=4.0'" in system and "-e '.[dev]'" in system
    assert "mpich" not in system and ".venv/" not in system
    assert system.rstrip().endswith(".venv-system/bin/python -m pytest -q --durations=15")
    assert "mpiexec -n 2 .venv-system/bin/python -m zmpi.cli train" in _make(
        "demo", "MPI=system").stdout
    bad = _make("test", "MPI=openmpi")
    assert bad.returncode != 0
    assert "MPI=openmpi: give MPI=wheel (the mpich wheel, the default) or MPI=system" in bad.stderr


def test_make_passes_a_strategy_to_the_suite_and_the_tables():
    out = _make("test-strategy", "STRATEGY=mine", "STRATEGY_MODULE=plugins/mine.py").stdout
    assert "-m pytest -q tests/test_zero.py --strategy mine" in out
    assert "--strategy-module plugins/mine.py" in out
    tables = _make("tables", "NP=4", "STRATEGY_MODULE=plugins/mine.py").stdout
    assert "--out results/zero_tables_n4_mine" in tables  # not the committed tables
    assert "--strategy-module plugins/mine.py" in tables
    assert "--out results/zero_tables_n4 " in _make("tables", "NP=4").stdout + " "
    done = subprocess.run(["make", "-o", ".venv/.installed", "test-strategy"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)  # -o: installs nothing
    assert done.returncode == 2 and "give STRATEGY=name" in done.stdout


SBATCH = REPO_ROOT / "experiments" / "slurm" / "train.sbatch"


def test_the_job_script_keeps_its_log_and_runs_mpi_in_job_steps():
    """SLURM creates no directory for --output: a log under runs/, which a fresh clone lacks,
    was lost. MPI_Init outside srun fails on some systems: every python runs under srun."""
    text = SBATCH.read_text()
    tracked = set(subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True,
                                 text=True).stdout.split())
    directories = {Path(p).parent.as_posix() for p in tracked}
    for option, path in re.findall(r"^#SBATCH --(output|error)=(\S+)", text, re.M):
        parent = path.rpartition("/")[0]
        assert not parent or parent in directories, f"--{option}={path}: no {parent}/ in a clone"
    commands = re.sub(r"\\\n\s*", " ", text)  # continuation lines joined
    for line in commands.splitlines():
        words = line.split("#")[0].split()
        if "python" in words:
            assert words[0] == "srun", line
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)

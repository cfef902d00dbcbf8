"""The committed results match the code: every result that regenerates in under a minute
(experiments/freshness.py's FAST: the memory and traffic tables, the lab table, zmpi plan
against the published runs) is made again and compared with results/ file by file, byte for
byte (run.json aside: its time and revision), so a stale figure fails the build. The slower
ones name the revision and command that made them, and freshness.py tells which are older than
the code they depend on (`make reproduce` prints it)."""
import json
import subprocess
import sys

import pytest
from mpi_util import REPO_ROOT, launch_mpi

sys.path.insert(0, str(REPO_ROOT / "experiments"))
import freshness  # noqa: E402

ENV = {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'experiments'}"}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(freshness.FAST))
def test_a_fast_committed_result_is_what_this_code_makes(name, tmp_path):
    ranks, args, script = freshness.FAST[name]
    out = tmp_path / name
    args = [str(out) if a == f"results/{name}" else a for a in args]
    result = launch_mpi(REPO_ROOT / script, ranks, args=args, timeout=120, env=ENV)
    assert result.returncode == 0, result.describe()
    committed = REPO_ROOT / "results" / name
    files = sorted(p.name for p in committed.iterdir() if p.name != "run.json")
    assert files == sorted(p.name for p in out.iterdir() if p.name != "run.json")
    for file in files:
        want, got = (committed / file).read_text(), (out / file).read_text()
        assert got == want, (f"results/{name}/{file} is stale: `make reproduce` (or mpiexec -n "
                             f"{ranks} python {script} --out results/{name}) remakes it\n{got}")


def test_every_committed_result_names_its_revision_and_script():
    for folder in sorted(p for p in (REPO_ROOT / "results").iterdir() if p.is_dir()
                         and p.name != "figures"):
        meta = json.loads((folder / "run.json").read_text())
        assert meta.get("git_revision"), folder.name
        assert freshness.script_of(folder) is not None, folder.name


def test_freshness_says_when_a_result_is_older_than_its_code(tmp_path, monkeypatch):
    """A result made at a revision is current until a file its script imports changes, and a
    change elsewhere does not make it stale."""
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "exp.py").write_text("import helper\n")
    (tmp_path / "experiments" / "helper.py").write_text("X = 1\n")
    (tmp_path / "unrelated.py").write_text("")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    made = git("rev-parse", "HEAD")
    result = tmp_path / "results" / "exp"
    result.mkdir(parents=True)
    (result / "run.json").write_text(json.dumps({"git_revision": made + "+dirty",
                                                 "argv": ["experiments/exp.py"]}))
    monkeypatch.setattr(freshness, "REPO_ROOT", tmp_path)
    assert freshness.dependencies(tmp_path / "experiments" / "exp.py") == (
        "experiments/exp.py", "experiments/helper.py", "models")
    verdict, detail = freshness.stale(result)
    assert verdict == "current" and "with uncommitted changes" in detail
    (tmp_path / "unrelated.py").write_text("Y = 2\n")
    git("commit", "-q", "-am", "two")
    assert freshness.stale(result)[0] == "current"
    (tmp_path / "experiments" / "helper.py").write_text("X = 2\n")
    git("commit", "-q", "-am", "three")
    verdict, detail = freshness.stale(result)
    assert verdict == "older than the code" and detail.endswith(": experiments/helper.py")
    (result / "run.json").write_text(json.dumps({"git_revision": "0" * 40, "argv": ["x.py"]}))
    assert freshness.stale(result) == ("unknown", f"made at {'0' * 12}; no script named")

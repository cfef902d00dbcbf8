"""Whether the committed results match the code: which regenerate fast enough to compare in CI,
and which of the others were made at a revision older than the code they depend on.

    python experiments/freshness.py          # one line per results/ folder (make report)

Every folder of results/ has a run.json that names the revision it was made at (`git_revision`,
"+dirty" when the tree had uncommitted changes) and the command (`argv`). FAST lists those that
regenerate in under a minute, deterministically (no timings): tests/test_committed_results.py
makes each again and compares every file but run.json byte for byte, so a stale figure fails
the build. For the rest, `stale` finds the newest commit that changed a file the experiment's
script imports (its repository modules, found by `modulefinder`, and models/) and says the
result is older than the code when its revision does not contain that commit.
"""
from __future__ import annotations

import json
import modulefinder
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "results"

# results/ folder: (ranks, the command's arguments after the script, the script)
FAST = {
    **{f"zero_tables_n{n}": (n, ["--out", f"results/zero_tables_n{n}"],
                             "experiments/zero_tables.py") for n in (1, 2, 3, 4)},
    "plan_published": (1, ["--out", "results/plan_published"], "experiments/plan_published.py"),
    "memory_published": (1, ["--out", "results/memory_published"],
                         "experiments/memory_published.py"),
}
# the folders whose run.json names no command: the script that made them
SCRIPTS = {"gpu_counts": "experiments/bench_gpu.py", "gpu_h100_n1": "experiments/bench_gpu.py"}


def script_of(folder: Path) -> Path | None:
    """The experiment script that made results/`folder`: its run.json's argv[0] (run from the
    repository or from experiments/), or SCRIPTS'; None if neither says."""
    if folder.name in SCRIPTS:
        return REPO_ROOT / SCRIPTS[folder.name]
    argv = json.loads((folder / "run.json").read_text()).get("argv") or [None]
    if argv[0] is None:
        return None
    script = REPO_ROOT / "experiments" / Path(argv[0]).name
    return script if script.is_file() else None


@cache
def dependencies(script: Path) -> tuple[str, ...]:
    """The repository files `script` runs: itself, every module of this repository it imports
    (directly or not, at any depth, including imports inside functions) and models/ (installed
    as zmpi.models), as paths relative to the repository, sorted."""
    finder = modulefinder.ModuleFinder(path=[str(REPO_ROOT), str(REPO_ROOT / "experiments")])
    finder.run_script(str(script))
    files = {Path(m.__file__).resolve() for m in finder.modules.values() if m.__file__}
    files = {f.relative_to(REPO_ROOT).as_posix() for f in files if f.is_relative_to(REPO_ROOT)}
    return tuple(sorted(files | {"models"}))


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)


def stale(folder: Path) -> tuple[str, str]:
    """(verdict, detail) of results/`folder`: "current" (its revision contains every change of
    the code it depends on), "older than the code" (naming the newest change it lacks),
    or "unknown" (no revision, no script, or a revision this clone does not have)."""
    revision = json.loads((folder / "run.json").read_text()).get("git_revision") or ""
    base, dirty = revision.removesuffix("+dirty"), revision.endswith("+dirty")
    made = f"made at {base[:12] or 'an unknown revision'}" + (" with uncommitted changes"
                                                              if dirty else "")
    script = script_of(folder)
    if script is None or not base:
        return "unknown", made + ("" if script else "; no script named")
    last = _git("log", "-1", "--format=%H %cs", "--", *dependencies(script)).stdout.split()
    if not last:
        return "unknown", made + "; its code has no history here"
    known = _git("cat-file", "-e", f"{base}^{{commit}}").returncode == 0
    if not known:
        return "unknown", made + ", a revision this clone does not have"
    if _git("merge-base", "--is-ancestor", last[0], base).returncode == 0:
        return "current", made
    changed = _git("diff", "--name-only", base, last[0], "--", *dependencies(script)).stdout
    files = changed.split()
    return "older than the code", (
        f"{made}; {script.relative_to(REPO_ROOT).as_posix()}'s code changed since, last in "
        f"{last[0][:12]} ({last[1]}): {', '.join(files[:3])}"
        + (f" and {len(files) - 3} more" if len(files) > 3 else ""))


def report(folders=None) -> list[str]:
    """One line per results/ folder: compared in CI (FAST), or its `stale` verdict."""
    lines = []
    for folder in folders or sorted(p for p in RESULTS.iterdir() if (p / "run.json").is_file()):
        if folder.name in FAST:
            lines.append(f"{folder.name}: regenerated and compared by make test "
                         "(tests/test_committed_results.py)")
        else:
            verdict, detail = stale(folder)
            lines.append(f"{folder.name}: {verdict} ({detail})")
    return lines


if __name__ == "__main__":
    lines = report()
    old = sum(": older than the code" in line for line in lines)
    print("\n".join(lines))
    print(f"{old} of {len(lines)} committed results are older than the code they depend on"
          + (" (make reproduce remakes them)" if old else ""), file=sys.stderr)

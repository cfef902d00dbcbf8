"""The examples of README.md and docs/*.md: found, run as a reader would, and their shown output
compared (the docs suite, tests/test_docs_examples.py; `make test-docs`).

An example is a fenced ```bash, ```python or ```json block:

- bash: run by `bash -e` (a failing command fails it), as one script;
- python: saved as a file and run by `python FILE` (`mpiexec -n N python FILE` with `ranks N`);
- json: a config, or a fragment of one (wrapped in braces), run by `zmpi train --config FILE
  --steps 2 --sample-tokens 0` (under `mpiexec -n N` with `ranks N`): zmpi takes it and
  trains with it.

The examples of one page run in order in one fresh directory (a page's later commands use what
its earlier ones wrote), with the venv of the running Python first on PATH, one BLAS thread,
links to the repository's `.venv`, `Makefile`, `pyproject.toml`, `configs/` and
`experiments/`, and a hard timeout each (300 s unless its marker says otherwise).

A block without a language right after an example (blank lines and a marker between at most)
is what the example prints: every one of its lines must appear in the example's output
(stdout and stderr together), in order; other lines may come between. Text must be equal
(runs of spaces count as one); numbers without a decimal point or exponent must be equal;
other numbers may differ by RTOL relatively (1%, or the block's `rtol`) or by one unit of
the last digit shown. A line `...` stands for any lines; a line ending in `...` for any end.

A marker is an HTML comment on the last non-blank line before a block, `<!-- docs: KEY VALUE;
KEY VALUE -->`, visible in the page's source:

    skip REASON       not run (a cluster, a GPU, a long benchmark): the reason is shown
    xfail REASON      run, and expected to fail for the defect REASON names (passing is an
                      error, so the mark goes when the defect does); a REASON runs to the
                      marker's end
    ranks N           python and json examples under `mpiexec -n N`
    file NAME         the python example saved as NAME (the page's later commands use it)
    exit N            the example's expected exit status (default 0)
    timeout S         its hard timeout in seconds
    same-as PATH      the block is the repository's file PATH, verbatim (not run)
  on an output block:
    command CMD       the output of CMD, run here (for output shown away from its command)
    rtol X            numbers' relative tolerance
    timings A, B      a number with A or B right before or after it (`8.52it/s`, `70.4 s`,
                      `tok_s=19,256`: it/s, s, tok_s=) is a time or rate: not compared
                      (tqdm's `it/s` also matches its `s/it`, below one a second)

`python tests/docs_examples.py` lists every example and skip with its reason, and the counts.
"""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / "README.md"] + sorted((REPO_ROOT / "docs").glob("*.md"))
RUNNABLE = ("bash", "python", "json")
RUN_KEYS = ("skip", "xfail", "ranks", "file", "exit", "timeout", "same-as")
REASONS = ("skip", "xfail")  # the last key of a marker: the reason may hold semicolons
OUTPUT_KEYS = ("command", "rtol", "timings")
RTOL = 0.01
TIMEOUT = 300
LINKED = (".venv", "Makefile", "pyproject.toml", "configs", "experiments")
FENCE = re.compile(r"^(```+)(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*docs:(.*?)-->\s*$")


class MarkerError(ValueError):
    """A docs marker that cannot be read: its page and line, and what is wrong."""


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    lang: str
    text: str
    marks: dict = field(default_factory=dict)
    after_block: bool = False  # only blank lines and a marker between it and the block above

    @property
    def where(self) -> str:
        page = self.page.relative_to(REPO_ROOT) if self.page.is_relative_to(REPO_ROOT) \
            else self.page
        return f"{page}:{self.line}"


@dataclass
class Example:
    """A runnable block (or an output block's `command`), with the output it shows if any."""

    block: Block
    output: Block | None = None

    @property
    def marks(self) -> dict:
        return self.block.marks

    @property
    def skip(self) -> str | None:
        return self.marks.get("skip")


def parse_marker(text: str, where: str) -> dict:
    """`KEY VALUE; KEY VALUE` -> {key: value}; an unknown key, a missing value or a bad
    number is a MarkerError naming `where`."""
    marks, parts = {}, text.split(";")
    while parts:
        key, _, value = parts.pop(0).strip().partition(" ")
        if key in REASONS:  # a reason runs to the marker's end, semicolons and all
            value, parts = ";".join([value, *parts]), []
        value = value.strip()
        if not key:
            continue
        if key not in RUN_KEYS + OUTPUT_KEYS:
            raise MarkerError(f"{where}: unknown docs marker {key!r} (known: "
                              f"{', '.join(RUN_KEYS + OUTPUT_KEYS)})")
        if not value:
            raise MarkerError(f"{where}: docs marker {key!r} needs a value")
        try:
            marks[key] = {"ranks": int, "exit": int, "timeout": float, "rtol": float,
                          "timings": lambda v: [s.strip() for s in v.split(",")]
                          }.get(key, str)(value)
        except ValueError:
            raise MarkerError(f"{where}: docs marker {key}: {value!r} is not a number") from None
    return marks


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the marker on the last non-blank line before it."""
    found, lines, i = [], page.read_text().split("\n"), 0
    while i < len(lines):
        fence = FENCE.match(lines[i].strip())
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip() == fence.group(1)), len(lines))
        above = [line.strip() for line in lines[:i] if line.strip()]
        block = Block(page, i + 1, fence.group(2), "\n".join(lines[i + 1:end]) + "\n")
        marker = MARKER.match(above[-1]) if above else None
        if marker:
            block.marks = parse_marker(marker.group(1), block.where)
            above.pop()
        block.after_block = bool(above) and above[-1].startswith("```")
        found.append(block)
        i = end + 1
    return found


def examples(page: Path) -> list[Example]:
    """The page's examples in order: runnable blocks with the output block after each, and
    output blocks that name their own `command`. A marker out of place is a MarkerError."""
    found = []
    for block in blocks(page):
        keys = set(block.marks)
        if block.lang in RUNNABLE:
            if keys & set(OUTPUT_KEYS):
                raise MarkerError(f"{block.where}: docs markers {sorted(keys & set(OUTPUT_KEYS))}"
                                  f" belong on the output block")
            found.append(Example(block))
        elif block.lang == "" and "command" in keys:
            if keys - set(OUTPUT_KEYS) - {"skip", "xfail", "exit", "timeout"}:
                raise MarkerError(f"{block.where}: docs marker {sorted(keys)}: not for a "
                                  f"command's output")
            found.append(Example(Block(page, block.line, "bash", block.marks["command"] + "\n",
                                       block.marks), block))
        elif block.lang == "" and block.after_block and found and found[-1].output is None:
            if keys - set(OUTPUT_KEYS):
                raise MarkerError(f"{block.where}: docs markers {sorted(keys)} on an output "
                                  f"block (only {', '.join(OUTPUT_KEYS)})")
            found[-1].output = block
        elif keys:
            raise MarkerError(f"{block.where}: docs marker on a block that is neither an "
                              f"example nor an example's output")
    for ex in found:
        if ex.skip is not None and set(ex.marks) - {"skip", *OUTPUT_KEYS}:
            raise MarkerError(f"{ex.block.where}: a skipped example takes no other marker")
    return found


# ---- running ----

def workdir_links(path: Path) -> None:
    """The repository's entries a reader's commands use, linked into the page's directory.
    Refused while .venv is older than pyproject.toml: a page's `make` would install the
    repository again from the page's directory."""
    stamp, project = REPO_ROOT / ".venv" / ".installed", REPO_ROOT / "pyproject.toml"
    if stamp.exists() and stamp.stat().st_mtime < project.stat().st_mtime:
        raise RuntimeError(".venv is older than pyproject.toml: run make install first")
    for name in LINKED:
        if (REPO_ROOT / name).exists() and not (path / name).exists():
            (path / name).symlink_to(REPO_ROOT / name)


def environment() -> dict:
    """The reader's shell: the running venv first on PATH, one BLAS thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONFAULTHANDLER="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("ZMPI_BACKEND", "numpy")
    return env


def command(example: Example, cwd: Path) -> list[str]:
    """The command line that runs `example` in `cwd`, writing the file it needs there."""
    block = example.block
    launch = ["mpiexec", "-n", str(example.marks["ranks"])] if "ranks" in example.marks else []
    if block.lang == "bash":
        script = cwd / f"example_{block.line}.sh"
        script.write_text(block.text)
        return ["bash", "-e", script.name]
    if block.lang == "python":
        name = example.marks.get("file", f"example_{block.line}.py")
        (cwd / name).write_text(block.text)
        return launch + ["python", name]
    name = f"example_{block.line}.json"
    (cwd / name).write_text(json.dumps(as_config(block.text), indent=1))
    return launch + ["zmpi", "train", "--config", name, "--steps", "2", "--sample-tokens", "0",
                     "--out", f"run_{block.line}"]


def as_config(text: str) -> dict:
    """A JSON block as the config it is, or is a fragment of (keys without the braces)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads("{" + text + "}")


def _no_core_files() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run(example: Example, cwd: Path) -> tuple[int | None, str, float]:
    """(exit status or None on the timeout, stdout and stderr together, seconds)."""
    from mpi_util import finish_mpi  # kills the whole job, mpiexec's ranks included

    proc = subprocess.Popen(command(example, cwd), cwd=cwd, env=environment(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_no_core_files)
    proc.started = time.monotonic()
    result = finish_mpi(proc, example.marks.get("timeout", TIMEOUT))
    return result.returncode, result.stdout, result.seconds


def check(example: Example, cwd: Path) -> str | None:
    """Run `example` in `cwd` (or compare it with its file); None, or what went wrong."""
    if "same-as" in example.marks:
        file = REPO_ROOT / example.marks["same-as"]
        if not file.is_file():
            return f"same-as {example.marks['same-as']}: no such file"
        return None if file.read_text() == example.block.text else \
            f"differs from {example.marks['same-as']}"
    status, out, seconds = run(example, cwd)
    expected = example.marks.get("exit", 0)
    if status != expected:
        why = "timed out" if status is None else f"exit status {status}, not {expected}"
        return f"{why} after {seconds:.0f} s; output:\n{out[-4000:]}"
    if example.output is not None:
        marks = example.output.marks
        problems = compare(example.output.text, out, marks.get("rtol", RTOL),
                           marks.get("timings", ()))
        if problems:
            return (f"output differs from {example.output.where}:\n" + "\n".join(problems)
                    + f"\n--- output ---\n{out[-4000:]}")
    return None


def page_timeout(page: Path) -> float:
    """The longest a page's examples may take together: the sum of their timeouts."""
    return sum(ex.marks.get("timeout", TIMEOUT) for ex in examples(page) if ex.skip is None)


# ---- comparing output ----

NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def line_pattern(expected: str) -> re.Pattern:
    """A regex for an expected line: its text literal (runs of spaces as any run), each number
    a group, a trailing `...` anything."""
    text, tail = expected.strip(), ""
    if text.endswith("...") and text != "...":
        text, tail = text[:-3].rstrip(), r".*"
    parts, pos = [], 0
    for m in NUMBER.finditer(text):
        parts.append(_literal(text[pos:m.start()]) + r"(\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)")
        pos = m.end()
    parts.append(_literal(text[pos:]))
    return re.compile("".join(parts) + (r"\s*" + tail if tail else ""))


def _literal(text: str) -> str:
    """`text` as a regex: runs of spaces any run; tqdm's rate `it/s` either way round (below
    one iteration a second tqdm prints `1.23s/it`)."""
    return r"\s+".join(re.escape(word).replace("it/s", "(?:it/s|s/it)")
                       for word in re.split(r"\s+", text)).replace(
        r"\s+\s+", r"\s+") if text.strip() else (r"\s+" if text else "")


def numbers_close(expected: str, actual: str, rtol: float) -> bool:
    """Integers equal; other numbers within rtol, or one unit of the expected's last digit."""
    e, a = float(expected.replace(",", "")), float(actual.replace(",", ""))
    mantissa = re.split(r"[eE]", expected)[0]
    if "." not in mantissa and mantissa == expected:
        return e == a
    decimals = len(mantissa.partition(".")[2])
    exponent = int(re.split(r"[eE]", expected)[1]) if re.search(r"[eE]", expected) else 0
    return abs(a - e) <= max(rtol * abs(e), 10.0 ** (exponent - decimals) * (1 + 1e-9))


def is_timing(text: str, number: re.Match, timings) -> bool:
    """Whether one of `timings` stands right before or after the number (a space between
    allowed; a word must end there): `8.52it/s`, `70.4 s`, `tok_s=19,256` with it/s, s, tok_s=."""
    before, after = text[:number.start()].rstrip(" "), text[number.end():].lstrip(" ")
    return any(before.endswith(t) or after.startswith(t) and not (
        t[-1].isalnum() and after[len(t):len(t) + 1].isalnum()) for t in timings)


def compare(expected: str, actual: str, rtol: float = RTOL, timings=()) -> list[str]:
    """The expected lines not found, in order, among the actual ones (see the module's
    docstring); an empty list when all are."""
    lines = [line.strip() for line in re.split(r"[\r\n]", actual) if line.strip()]
    problems, at = [], 0
    for want in (line.strip() for line in expected.split("\n")):
        if want in ("", "..."):
            continue
        pattern, near = line_pattern(want), None
        numbers = [(m.group(), is_timing(want, m, timings)) for m in NUMBER.finditer(
            want.removesuffix("..."))]
        for k in range(at, len(lines)):
            m = pattern.fullmatch(lines[k])
            if m is None:
                continue
            if all(timed or numbers_close(w, got, rtol)
                   for (w, timed), got in zip(numbers, m.groups(), strict=True)):
                at = k + 1
                break
            near = near or lines[k]
        else:
            problems.append(f"  expected: {want}\n" +
                            (f"  got:      {near}" if near else "  (no line like it)"))
    return problems


# ---- the inventory ----

def inventory() -> tuple[list[Example], list[Example]]:
    """(the examples that run, the skipped ones) over every page."""
    found = [ex for page in PAGES for ex in examples(page)]
    return [ex for ex in found if ex.skip is None], [ex for ex in found if ex.skip is not None]


def run_page(page: Path, cwd: Path, log=print, lines=None) -> list[str]:
    """Run the page's examples in order in `cwd` (those at `lines` only, if given): what went
    wrong, one entry per example (an xfail example that passes is one: its mark must go)."""
    workdir_links(cwd)
    found = {ex.block.line for ex in examples(page)}
    failures = [f"{page.name}:{n}: no example starts there" for n in sorted(set(lines or ()) -
                                                                           found)]
    for ex in examples(page):
        if ex.skip is not None or lines and ex.block.line not in lines:
            continue
        started = time.monotonic()
        problem = check(ex, cwd)
        log(f"{ex.block.where}: {'ok' if problem is None else 'FAILED'} "
            f"in {time.monotonic() - started:.1f} s")
        if "xfail" in ex.marks:
            if problem is None:
                failures.append(f"{ex.block.where}: passes now; remove its mark "
                                f"'xfail {ex.marks['xfail']}'")
        elif problem is not None:
            failures.append(f"{ex.block.where}: {problem}")
    return failures


def main(argv: list[str]) -> int:
    """No arguments: the inventory. `--run PAGE[:LINE,LINE]...` (paths from the repository's
    root): run those pages' examples (those at LINE only) here, each page in a fresh
    temporary directory."""
    if argv[:1] == ["--run"]:
        import tempfile

        failures = []
        for name in argv[1:]:
            page, _, lines = name.partition(":")
            with tempfile.TemporaryDirectory(prefix="zmpi-docs-") as cwd:
                failures += run_page(REPO_ROOT / page, Path(cwd),
                                     lines={int(n) for n in lines.split(",") if n})
        print("\n\n".join(failures) or "all ran as shown")
        return 1 if failures else 0
    runnable, skipped = inventory()
    for ex in runnable:
        extra = f"  (xfail: {ex.marks['xfail']})" if "xfail" in ex.marks else ""
        shown = "  + output" if ex.output else ""
        print(f"run   {ex.block.where} {ex.block.lang}{shown}{extra}")
    for ex in skipped:
        print(f"skip  {ex.block.where} {ex.block.lang}: {ex.skip}")
    compared = sum(ex.output is not None for ex in runnable)
    print(f"{len(runnable) + len(skipped)} examples: {len(runnable)} run ({compared} with "
          f"their output compared), {len(skipped)} skipped")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except MarkerError as e:
        sys.exit(f"docs_examples: {e}")

"""README.md and docs/*.md: every relative link and anchor resolves, each page has one title
and sensible headings, every page is reachable from the README, and the code examples of the
README and docs/layers.md run as written. (docs/strategies.md's example: test_strategies_doc.py.)"""
import os
import re
import subprocess
import sys

import pytest
from mpi_util import REPO_ROOT

PAGES = [REPO_ROOT / "README.md"] + sorted((REPO_ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)


def outside_fences(text: str) -> str:
    """The text with fenced code blocks blanked out; lines kept in place."""
    out, fence = [], None
    for line in text.split("\n"):
        marker = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and marker:
            fence = marker.group(1)[0] * 3
            line = ""
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            line = ""
        out.append(line)
    return "\n".join(out)


def prose(text: str) -> str:
    """The text outside fenced code blocks, without inline code: where links can be."""
    return re.sub(r"`+[^`\n]*`+", "", outside_fences(text))


def headings(text: str) -> list[tuple[int, str]]:
    return [(len(m.group(1)), m.group(2).strip())
            for m in re.finditer(r"^(#{1,6})\s+(.*?)\s*#*\s*$", outside_fences(text), re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text only, lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path) -> set[str]:
    seen, out = {}, set()
    for _, title in headings(path.read_text()):
        base = slug(title)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    html = re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text())
    return out | set(html)


def links(path) -> list[str]:
    text = prose(path.read_text())
    return LINK.findall(text) + REF_LINK.findall(text)


def resolve(page, target):
    """(file, anchor) a relative link points at; None for an external link."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
        return None
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page.resolve()
    return file, anchor


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_and_anchors_resolve(page):
    problems = []
    for target in links(page):
        resolved = resolve(page, target)
        if resolved is None:
            continue
        file, anchor = resolved
        if not file.is_relative_to(REPO_ROOT.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: {file.relative_to(REPO_ROOT)} does not exist")
        elif anchor:
            if file.suffix != ".md":
                problems.append(f"{target}: an anchor into a file that is not markdown")
            elif anchor not in anchors(file):
                problems.append(f"{target}: no heading #{anchor} in "
                                f"{file.relative_to(REPO_ROOT)}")
    assert not problems, f"{page.relative_to(REPO_ROOT)}:\n" + "\n".join(problems)


def test_links_are_found():
    assert sum(len(links(page)) for page in PAGES) > 30
    assert links(REPO_ROOT / "README.md")[:1] == ["docs/failures.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_one_title_and_no_skipped_heading_levels(page):
    levels = [level for level, _ in headings(page.read_text())]
    assert levels and levels[0] == 1 and levels.count(1) == 1, (page.name, levels)
    for before, after in zip(levels, levels[1:], strict=False):
        assert after <= before + 1, (page.name, levels)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [(REPO_ROOT / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        todo += [r[0] for r in map(lambda t: resolve(page, t), links(page)) if r]
    missing = [p.name for p in PAGES if p.resolve() not in seen]
    assert not missing, f"docs pages no link leads to from README.md: {missing}"


def test_slug_matches_github():
    assert slug("5. Throughput and scaling (against PyTorch on the same work)") == \
        "5-throughput-and-scaling-against-pytorch-on-the-same-work"
    assert slug("Reproducing the papers' tables") == "reproducing-the-papers-tables"
    assert slug("ZeRO-Offload") == "zero-offload"


def python_blocks(path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_layer_example_runs():
    """docs/layers.md: the Gain layer and its check, as written."""
    (code,) = python_blocks(REPO_ROOT / "docs" / "layers.md")
    exec(compile(code, "docs/layers.md", "exec"), {})


def test_readme_examples_run():
    """README.md's engine example (one rank, as `python example.py`) and its model lines."""
    blocks = python_blocks(REPO_ROOT / "README.md")
    assert len(blocks) == 2 and "engine.train_step" in blocks[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", ZMPI_BACKEND="numpy",
               PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "adam_m" in out.stdout, out.stdout[-2000:]

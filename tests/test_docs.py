"""README.md and docs/*.md: every relative link and anchor resolves, each page has one title
and sensible headings, every page is reachable from the README, and the docs suite's markers read
(the suite itself, which runs every example: test_docs_examples.py, make test-docs)."""
import re

import pytest
from docs_examples import MarkerError, compare, examples, inventory, run_page
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


def test_every_example_is_found_and_its_markers_read():
    """The docs suite's inventory (tests/docs_examples.py): every marker reads, every skip
    gives its reason, and the examples the suite runs are there (it runs them: make test-docs)."""
    runnable, skipped = inventory()
    assert len(runnable) >= 35 and all(ex.skip.strip() for ex in skipped)
    by_page = {ex.block.where.split(":")[0] for ex in runnable}
    assert {"README.md", "docs/checkpoints.md", "docs/layers.md", "docs/plan.md"} <= by_page
    assert sum(ex.output is not None for ex in runnable) >= 6


def test_marker_errors(tmp_path):
    page = tmp_path / "page.md"
    for text, error in [("<!-- docs: skp x -->\n```bash\nls\n```\n", "unknown docs marker 'skp'"),
                        ("<!-- docs: skip -->\n```bash\nls\n```\n", "'skip' needs a value"),
                        ("<!-- docs: ranks two -->\n```python\n1\n```\n", "not a number"),
                        ("<!-- docs: rtol 0.1 -->\n```bash\nls\n```\n", "the output block"),
                        ("<!-- docs: ranks 2; skip a -->\n```python\n1\n```\n", "no other"),
                        ("<!-- docs: rtol 0.1 -->\n```\nlisting\n```\n", "neither")]:
        page.write_text(text)
        with pytest.raises(MarkerError, match=error):
            examples(page)


def test_output_block_follows_its_example(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\necho 1\n```\n\n<!-- docs: rtol 0.5 -->\n```\n1\n```\n"
                    "text\n\n```\nlisting\n```\n"
                    "<!-- docs: command echo 2; timings s -->\n```\n2 s\n```\n")
    first, second = examples(page)
    assert first.output.text == "1\n" and first.output.marks == {"rtol": 0.5}
    assert second.block.text == "echo 2\n" and second.output.marks["timings"] == ["s"]


def test_run_page_reports_each_failure(tmp_path):
    """The runner: a shown output that differs, an exit status, an xfail that passes now and a
    timeout are each a failure; an expected exit status and a matching output are not."""
    page = tmp_path / "page.md"
    page.write_text("```bash\necho 'loss 2.204'\n```\n\n```\nloss 2.25\n```\n\n"
                    "<!-- docs: exit 3 -->\n```bash\nexit 3\n```\n\n"
                    "```bash\nfalse\necho never\n```\n\n"
                    "<!-- docs: xfail a known defect -->\n```bash\ntrue\n```\n\n"
                    "<!-- docs: timeout 1 -->\n```bash\nsleep 30\n```\n\n"
                    "```python\nprint(6 * 7)\n```\n\n```\n42\n```\n")
    work = tmp_path / "work"
    work.mkdir()
    failures = run_page(page, work, log=lambda line: None)
    assert [f.split(": ", 1)[0].rsplit(":", 1)[1] for f in failures] == ["1", "14", "20", "25"]
    assert "expected: loss 2.25" in failures[0] and "exit status 1, not 0" in failures[1]
    assert "passes now" in failures[2] and "timed out" in failures[3]


@pytest.mark.parametrize("expected, actual, ok", [
    ("loss 4.189 -> 2.204", "loss 4.189 -> 2.2071", False),    # beyond 1e-3 and one unit
    ("loss 4.189 -> 2.204", "loss 4.19 -> 2.205", True),       # one unit of the last digit
    ("loss 4.189 -> 2.204", "note\nloss   4.189 ->  2.204\nmore", True),   # spaces, lines
    ("809,856 params", "809,857 params", False),               # integers are equal
    ("1.244e+08 parameters", "1.2441e+08 parameters", True),
    ("a\nb", "b\na", False),                                  # in order
    ("2 shard files, 11.40 MiB: ...", "2 shard files, 11.40 MiB: x, y", True),
    ("line one\n...\nline two", "line one\nx\nline two", True),
    ("8.52it/s, loss=2.204, tok_s=19,256", "9.1it/s, loss=2.204, tok_s=1,256", True),
    ("8.52it/s, loss=2.204", "8.52it/s, loss=2.5", False),     # only the timings vary
    ("8.52it/s, loss=2.204", "1.23s/it, loss=2.204", True),    # tqdm below 1 it/s
])
def test_output_comparison(expected, actual, ok):
    problems = compare(expected, actual, rtol=1e-3, timings=["it/s", "tok_s="])
    assert (problems == []) == ok, problems

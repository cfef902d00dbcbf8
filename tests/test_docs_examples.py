"""The docs suite (`make test-docs`, not part of `make test`): every example of README.md and
docs/*.md runs as written, each page's in order in a fresh directory, and where a page shows
an example's output the output is compared (tests/docs_examples.py says how; `python
tests/docs_examples.py` lists the examples and the skipped ones with their reasons)."""
import pytest
from docs_examples import PAGES, REPO_ROOT, examples, run_page

pytestmark = pytest.mark.docs


@pytest.mark.parametrize("page", [p for p in PAGES if any(ex.skip is None for ex in examples(p))],
                         ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_page_examples_run_as_shown(page, tmp_path):
    failures = run_page(page, tmp_path)
    assert not failures, "\n\n".join(failures)

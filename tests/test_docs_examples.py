"""The docs suite (`make test-docs`, not part of `make test`): every example of README.md and
docs/*.md runs as written, each page's in order in a fresh directory, and where a page shows
an example's output the output is compared (tests/docs_examples.py says how; `python
tests/docs_examples.py` lists the examples and the skipped ones with their reasons)."""
import pytest
from docs_examples import PAGES, REPO_ROOT, examples, page_timeout, run_page

pytestmark = pytest.mark.docs

RUN = [pytest.param(page, id=str(page.relative_to(REPO_ROOT)),
                    marks=pytest.mark.timeout(page_timeout(page) + 60))  # each example has its own
       for page in PAGES if any(ex.skip is None for ex in examples(page))]


@pytest.mark.parametrize("page", RUN)
def test_page_examples_run_as_shown(page, tmp_path):
    failures = run_page(page, tmp_path)
    assert not failures, "\n\n".join(failures)

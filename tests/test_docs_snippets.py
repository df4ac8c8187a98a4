"""The other half of the README's and the site's snippets (see test_docs.py), run as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from snippets import RUNNABLE, Snippet, run_as_written


@pytest.mark.slow
@pytest.mark.parametrize("snippet", RUNNABLE[1::2], ids=lambda s: s.id)
def test_readme_snippet_runs_as_written(snippet: Snippet, tmp_path: Path) -> None:
    run_as_written(snippet, tmp_path)

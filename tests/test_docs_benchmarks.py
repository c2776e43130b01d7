"""docs/benchmarks.md is rendered from docs/benchmarks/*.json by benchmarks/render_docs.py: the committed
page is what the script writes, every table row carries a command, and every data file is rendered or
linked from a page."""

import re
from pathlib import Path

import pytest

pytest.importorskip("tabulate")

from benchmarks import render_docs

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_page_is_the_rendered_one():
    assert (ROOT / "docs" / "benchmarks.md").read_text() == render_docs.render(), (
        "docs/benchmarks.md is stale: run python benchmarks/render_docs.py"
    )


def test_every_table_row_carries_its_command():
    rows = [line for line in render_docs.render().splitlines() if line.startswith("| ") and "---" not in line]
    data = [row for row in rows if not row.startswith("| provider ") and "command" not in row]
    assert data and all("`python -m " in row for row in data), [r for r in data if "`python -m " not in r][:3]


def test_every_data_file_is_rendered_or_linked():
    pages = "".join(path.read_text() for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    linked = set(re.findall(r"benchmarks/([\w.-]+\.(?:json|png|txt))", pages))
    files = {path.name for path in (ROOT / "docs" / "benchmarks").iterdir()}
    assert files <= linked, sorted(files - linked)


def test_every_number_in_the_readme_is_in_the_benchmark_data():
    text = (ROOT / "README.md").read_text()
    data = " ".join(path.read_text() for path in (ROOT / "docs" / "benchmarks").glob("*.json"))
    numbers = set(re.findall(r"(?<![\w.-])\d+(?:\.\d+)?(?!\w)", text))
    missing = [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", data)]
    assert not missing, sorted(missing)


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().split()) <= 1200


def test_the_docs_stay_short():
    """The pages state contracts; measurement history lives in git and docs/benchmarks/."""
    assert sum(len(path.read_text().split()) for path in (ROOT / "docs").glob("*.md")) <= 15000

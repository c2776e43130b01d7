"""Every relative link and every repository path that the README and docs/ name exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:inductor_ext|tests|docs|examples|scripts)/[\w./-]+\.(?:py|md|json|png|cpp|txt|sh|toml))`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(doc):
    text = doc.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of this page
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(target)
    missing += [path for path in PATH.findall(text) if "*" not in path and not (ROOT / path).exists()]
    assert not missing, f"{doc.name} names what does not exist: {missing}"


def test_every_benchmark_file_is_named_by_the_docs():
    """``docs/benchmarks/`` holds current numbers only: each file (or, for a plot, its JSON) is linked."""
    text = "".join(doc.read_text() for doc in DOCS)
    unnamed = [
        path.name
        for path in sorted((ROOT / "docs" / "benchmarks").iterdir())
        if path.name not in text and path.with_suffix(".json").name not in text
    ]
    assert not unnamed, f"docs/benchmarks files no doc names: {unnamed}"

"""The repository passes its linters and cites no work sessions or issue numbers.

``ruff check``, ``ruff format --check`` and ``mypy inductor_ext`` (settings and the pinned
versions in pyproject.toml) run on the checkout as CI runs the
tests. Tracked text files state facts, not the history of the work: no "session N" or
"issue N"; upstream issues are cited as ``owner/repo#N``.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CITATION = "session ?[0-9]+|issue ?[0-9]+"
"""Extended regex, matched case-insensitively by ``git grep -i -E``."""


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy", "inductor_ext"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_linter_passes(command: list[str]) -> None:
    run = _run([sys.executable, "-m", *command])
    assert run.returncode == 0, f"{' '.join(command)} exited {run.returncode}:\n{run.stdout}\n{run.stderr}"


def test_citation_pattern_allows_upstream_references() -> None:
    word_s, word_i = "sess" + "ion", "iss" + "ue"  # spelled apart so this file does not match itself
    pattern = re.compile(CITATION, re.IGNORECASE)
    for cited in (f"{word_s} 13", f"({word_s.title()}9)", f"{word_i} 5's targets", f"{word_i.upper()}3"):
        assert pattern.search(cited), cited
    for upstream in ("pytorch/pytorch#167931", "triton-lang/triton#5123", f"a pytest {word_s}", f"{word_i}s/123"):
        assert not pattern.search(upstream), upstream


def test_tracked_text_files_cite_no_sessions_or_issue_numbers() -> None:
    if _run(["git", "rev-parse", "--is-inside-work-tree"]).returncode != 0:
        pytest.skip("not a git checkout: no tracked files to search")
    # -I: binary files (plots) are not searched
    run = _run(["git", "grep", "-I", "-n", "-i", "-E", CITATION])
    assert run.returncode in (0, 1), run.stderr  # 1: no match
    assert run.returncode == 1, (
        "tracked files cite work sessions or issue numbers (state the fact instead; "
        f"upstream issues as owner/repo#N):\n{run.stdout[-20000:]}"
    )

"""Docstrings and comments of ``inductor_ext/`` state contracts, not measurements.

A device name or a timing stays in a docstring or comment only where it decides a default, and then
the same docstring or comment block names the committed benchmark file it comes from
(``docs/benchmarks/<name>.json``). The words looked for: ``H100``, ``H200``, ``measured`` and ``ms``
as a unit.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "inductor_ext"

WORDS = re.compile(r"\b(?:[Hh]100|[Hh]200|[Mm]easured)\b|\bms\b")
"""``ms`` only in lower case: a unit, not an abbreviation in a name (``_ms`` is one word to ``\\b``)."""
SOURCE = re.compile(r"docs/benchmarks/[\w.-]+\.json")
MOST = 15
"""At most this many occurrences in the whole package, each beside its source."""


def text_blocks(source: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of every docstring (any string statement: module, class, function and
    attribute docstrings) and every comment block of ``source``: a comment after code on its line, or
    comments that have consecutive lines to themselves."""
    blocks = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    comments: list[tuple[int, list[str]]] = []
    previous_whole_line = -1  # the line of the last comment that had a line to itself
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line, whole_line = token.start[0], token.line.lstrip().startswith("#")
        if whole_line and previous_whole_line == line - 1:
            comments[-1][1].append(token.string)
        else:
            comments.append((line, [token.string]))
        previous_whole_line = line if whole_line else -1
    return blocks + [(line, "\n".join(lines)) for line, lines in comments]


def occurrences(source: str, root: Path = ROOT) -> list[tuple[int, str, bool]]:
    """``(line of the block, word, whether the block names an existing docs/benchmarks JSON)`` of each
    device or timing word in a docstring or comment of ``source``."""
    found = []
    for line, text in text_blocks(source):
        cited = any((root / path).is_file() for path in SOURCE.findall(text))
        found += [(line, word, cited) for word in WORDS.findall(text)]
    return found


def package_occurrences() -> list[tuple[str, int, str, bool]]:
    return [
        (path.relative_to(ROOT).as_posix(), line, word, cited)
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, word, cited in occurrences(path.read_text())
    ]


def _report(found: list[tuple[str, int, str, bool]]) -> str:
    return "\n".join(
        f"{path}:{line}: {word!r}{'' if cited else ' (names no docs/benchmarks JSON)'}"
        for path, line, word, cited in found
    )


def test_the_scan_finds_docstrings_and_comment_blocks() -> None:
    bench = min((ROOT / "docs" / "benchmarks").glob("*.json")).relative_to(ROOT).as_posix()
    source = (
        f'"""Module: 3 ms on the H200 ({bench})."""\n'
        "x_ms = 1  # a 2 ms copy\n"
        "# measured once\n"
        "# and again\n"
        "def f():\n"
        '    """Takes 1 ms, H100."""\n'
        "y = 'ms H200 in a string is code, not prose'\n"
        "# docs/benchmarks/no_such_file.json: 4 ms\n"
        "z = 2\n"
        "# 5 ms a step, in\n"
        f"# {bench}\n"
    )
    assert sorted(occurrences(source)) == [
        (1, "H200", True),
        (1, "ms", True),
        (2, "ms", False),
        (3, "measured", False),
        (6, "H100", False),
        (6, "ms", False),
        (8, "ms", False),
        (10, "ms", True),
    ]


def test_device_and_timing_words_are_few_and_cite_their_benchmark() -> None:
    found = package_occurrences()
    uncited = [entry for entry in found if not entry[3]]
    assert len(found) <= MOST and not uncited, (
        f"{len(found)} device or timing words in docstrings and comments (at most {MOST}); state the contract "
        "instead, or name the docs/benchmarks/*.json that a default's number comes from:\n" + _report(found)
    )

"""The key that versions Inductor's compile caches by our code, options and route decisions.

Inductor's FX graph cache does not hash registered lowerings, and the AOTAutograd cache does not hash
the traced op bodies' route decisions: both would serve a graph compiled under other rules. Both hash
the ``uuid()`` of our joint and post-grad custom passes (:class:`inductor_ext.inductor.pipeline.InductorPasses`),
which is :func:`cache_key`: the package version, the code of every module that decides what gets traced
or generated (ops, kernels, passes, route choice, options, tuning, the patches of torch our compiles
apply) and the compile's own state. The code is hashed as its syntax tree without docstrings, so an
edit of a comment or a docstring keeps users' caches.
"""

import ast
import functools
import hashlib
from pathlib import Path

from inductor_ext.version import __version__

_PACKAGE = Path(__file__).resolve().parent.parent
_VERSIONED_DIRS = ("library", "ops", "kernels", "inductor", "tuning", "_compat")


def code_fingerprint(source: str) -> str:
    """``source``'s syntax tree without docstrings, as text: equal for sources that differ only in
    comments, docstrings, blank lines or formatting."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.cache
def source_digest() -> str:
    """sha256 of the package version and the code of the modules that shape compiled graphs."""
    digest = hashlib.sha256(__version__.encode())
    for directory in _VERSIONED_DIRS:
        for path in sorted((_PACKAGE / directory).rglob("*.py")):  # subpackages too (inductor/rewrites)
            digest.update(path.relative_to(_PACKAGE).as_posix().encode())
            digest.update(code_fingerprint(path.read_text()).encode())
    return digest.hexdigest()


def cache_key(state: str, chained: object = None) -> str:
    """The compile's key: our code, its ``state`` (options and route decisions) and a chained user pass's key."""
    return hashlib.sha256(f"{source_digest()}|{state}|{chained}".encode()).hexdigest()

"""The backend's modules share helpers only through public names, and check ops by identity.

Each module under ``inductor_ext/inductor/`` is parsed with :mod:`ast`: a name it imports from
another ``inductor_ext`` module must not start with an underscore (dunders such as ``__version__`` aside; a private
module such as ``inductor_ext._compat`` may be imported, from where tests/test_layering.py allows; its private names
may not).
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inductor_ext.inductor import graph_queries
from inductor_ext.inductor.rewrites import REWRITES

PACKAGE_DIR = Path(__file__).resolve().parent.parent.parent / "inductor_ext"
INDUCTOR_MODULES = sorted((PACKAGE_DIR / "inductor").rglob("*.py"))


def _is_module(name: str) -> bool:
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_imports(path: Path, source: str | None = None) -> list[str]:
    """``line: module.name`` for each private name of another package module that ``path`` imports."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    package = ".".join(parts if parts[-1] == "__init__" else parts[:-1]).removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        if base != "inductor_ext" and not base.startswith("inductor_ext."):
            continue
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.endswith("__")  # dunders are public
            if private and not _is_module(f"{base}.{alias.name}"):
                found.append(f"{node.lineno}: {base}.{alias.name}")
    return found


@pytest.mark.parametrize("path", INDUCTOR_MODULES, ids=lambda p: str(p.relative_to(PACKAGE_DIR.parent)))
def test_no_private_names_imported(path: Path) -> None:
    found = private_imports(path)
    assert not found, f"{path.relative_to(PACKAGE_DIR.parent)} imports private names:\n" + "\n".join(found)


def test_the_checker_sees_private_names() -> None:
    source = (
        "from inductor_ext.inductor.causal_mask import NotCausal, _prove_causal\n"
        "from .graph_queries import _METADATA_ATTRS\n"
        "from inductor_ext import _compat\n"
        "from torch._dynamo.utils import _private\n"
    )
    found = private_imports(PACKAGE_DIR / "inductor" / "example.py", source)
    assert found == [
        "1: inductor_ext.inductor.causal_mask._prove_causal",
        "2: inductor_ext.inductor.graph_queries._METADATA_ATTRS",
    ]


def test_rewrite_order_is_unchanged() -> None:
    assert list(REWRITES) == [
        "rms_norm_hf_llama",
        "rms_norm_gemma",
        "rms_norm_torch",
        "add_rms_norm",
        "layer_norm",
        "glu",
        "cross_entropy",
        "rope_hf",
        "embedding",
    ]


def _node(graph: torch.fx.Graph, op: str, target: object) -> torch.fx.Node:
    x = graph.placeholder("x")
    return graph.call_method(target, (x,)) if op == "call_method" else graph.call_function(target, (x,))


@pytest.mark.parametrize(
    ("op", "target", "random"),
    [
        ("call_function", torch.ops.aten.rand.default, True),
        ("call_function", torch.ops.aten.bernoulli.p, True),
        ("call_function", torch.ops.aten.native_dropout.default, True),
        ("call_function", torch.ops.aten.rand, True),  # an overload packet
        ("call_function", torch.ops.aten.add.Tensor, False),
        ("call_function", torch.rand_like, True),
        ("call_function", F.dropout, True),
        ("call_function", F.normalize, False),  # "normal" in its name, no randomness
        ("call_function", torch.tril, False),
        ("call_method", "uniform_", True),
        ("call_method", "bernoulli", True),
        ("call_method", "size", False),
    ],
)
def test_is_random_by_identity(op: str, target: object, random: bool) -> None:
    assert graph_queries.is_random(_node(torch.fx.Graph(), op, target)) is random


def test_ops_declare_their_in_place_outputs() -> None:
    """The op modules that launch the backward kernels declare what the donated-buffer pass may alias."""
    import inductor_ext.ops  # noqa: F401  (the op modules fill the registry on import)
    from inductor_ext.kernels.cross_entropy import cross_entropy_bwd_kernel, scale_rows_kernel
    from inductor_ext.kernels.glu import glu_bwd_kernel
    from inductor_ext.library import registration

    pairs = {
        kernel: [(p.input, p.output) for p in arguments]
        for kernel, arguments in registration.OUTPUTS_OVER_DONATED.items()
    }
    assert pairs == {
        cross_entropy_bwd_kernel.fn: [("LOGITS", "DLOGITS")],
        glu_bwd_kernel.fn: [("GATE", "DGATE"), ("UP", "DUP")],
        scale_rows_kernel: [("X", "OUT")],
    }

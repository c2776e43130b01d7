"""Every import inside the package points down the layer stack (data flows down: kernels, library, ops, then
inductor, then models, runtime and bench), and no module imports another package's private module.

Each module of ``inductor_ext`` is parsed with :mod:`ast`; its imports, function-local ones and
``importlib.import_module("inductor_ext....")`` included, may name modules of its own layer or
of a layer below it, never one above. A private module (a path component that starts with ``_``,
dunders aside: ``inductor_ext.ops._layout``, ``inductor_ext._compat.torch_fixes``) may be imported only
from inside the package that holds it (``inductor_ext.ops`` and its subpackages; ``inductor_ext``).
"""

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "inductor_ext"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("inductor_ext.bench",),
    # The package facade (inductor_ext/__init__.py) re-exports runtime's export, nn, ops and registers the backend.
    # The standalone tuner's command line (python -m inductor_ext.tuning; inductor_ext.autotune, its former name)
    # traces models through the backend's rewrites and times routes, as the backend does.
    (
        "inductor_ext",
        "inductor_ext.runtime",
        "inductor_ext.models",
        "inductor_ext.tuning.cli",
        "inductor_ext.tuning.__main__",
        "inductor_ext.autotune",
    ),
    # Route timing compiles an op's math with the backend's options; the backend's route planner calls it.
    ("inductor_ext.inductor", "inductor_ext.tuning.routes"),
    ("inductor_ext.nn", "inductor_ext.reference"),
    ("inductor_ext.ops",),
    # the op-definition core under the op files: registration launches through launch
    ("inductor_ext.library",),
    ("inductor_ext.library.launch",),
    # what the launches read: first-launch tuning and its settings, the database and its kernel configs
    # (and the timing, random inputs and rank agreement that route timing uses)
    ("inductor_ext.tuning",),
    ("inductor_ext.kernels",),
    # the search spaces the kernels' autotuners prune to: they import only Triton
    ("inductor_ext.tuning.search_spaces",),
    (
        "inductor_ext.version",
        "inductor_ext.runtime.tensor_file",  # leaves of runtime: they import nothing of the package
        "inductor_ext.runtime.cxx_runtime",
        "inductor_ext._compat",
        "inductor_ext.env",
    ),
)
"""Top to bottom. A module belongs to the layer of its longest matching prefix."""


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) for every package module that ``path`` (or ``source`` standing in for it) imports."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((node.lineno, target if is_module(target) else base))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
        ):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                # f"inductor_ext.bench.{op}": the package its constant prefix names
                found.append((node.lineno, str(arg.values[0].value).rstrip(".").rpartition(".")[0] or "?"))
    return [(line, module) for line, module in found if module == "inductor_ext" or module.startswith("inductor_ext.")]


def private_owner(module: str) -> str | None:
    """The package that may import ``module`` when it is private (the path up to its first component
    that starts with ``_``, dunders aside), or None for a public module."""
    parts = module.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[:index])
    return None


def private_imports(path: Path, source: str | None = None) -> list[str]:
    """``line: module`` for each private module of another package that ``path`` (or ``source``) imports."""
    name = module_name(path)
    found = []
    for line, target in imported_modules(path, source):
        owner = private_owner(target)
        if owner is not None and name != owner and not name.startswith(owner + "."):
            found.append(f"{line}: {target}")
    return found


MODULES = sorted(PACKAGE_DIR.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    for path in MODULES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE_DIR.parent)))
def test_imports_point_down(path: Path) -> None:
    name = module_name(path)
    upward = [
        f"{path.relative_to(PACKAGE_DIR.parent)}:{line} imports {target} "
        f"(layer {layer_of(target)} {LAYERS[layer_of(target)]} is above layer {layer_of(name)} {LAYERS[layer_of(name)]})"
        for line, target in imported_modules(path)
        if layer_of(target) < layer_of(name)
    ]
    assert not upward, "imports that point upward:\n" + "\n".join(upward)


def test_the_checker_sees_upward_and_lazy_imports() -> None:
    """The parser finds module-level, function-local, relative and importlib imports."""
    source = (
        "import importlib\n"
        "from inductor_ext.tuning.database import TuningDatabase\n"
        "def f():\n"
        "    from ..inductor import backend\n"
        "    return importlib.import_module('inductor_ext.tuning.cli.tune')\n"
    )
    path = PACKAGE_DIR / "ops" / "example.py"
    found = {module for _, module in imported_modules(path, source)}
    assert found == {"inductor_ext.tuning.database", "inductor_ext.inductor.backend", "inductor_ext.tuning.cli.tune"}
    assert [layer_of(module) < layer_of("inductor_ext.ops.example") for module in sorted(found)] == [True, True, False]


def test_the_tuning_package_spans_layers_by_longest_prefix() -> None:
    """``inductor_ext.tuning``'s modules sit where their imports put them: the search spaces under the
    kernels, the database and first-launch tuning under the launches, route timing beside the backend,
    the command line above it."""
    order = ["tuning.cli.main", "tuning.routes", "library.launch", "tuning.first_launch", "kernels.rms_norm",
             "tuning.search_spaces.norm"]  # fmt: skip
    layers = [layer_of(f"inductor_ext.{name}") for name in order]
    assert layers == sorted(layers) and len(set(layers)) == len(layers), dict(zip(order, layers))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE_DIR.parent)))
def test_private_modules_stay_in_their_package(path: Path) -> None:
    found = private_imports(path)
    assert not found, (
        f"{path.relative_to(PACKAGE_DIR.parent)} imports private modules of another package "
        "(make the module public, or move the importer into its package):\n" + "\n".join(found)
    )


def test_the_checker_sees_private_modules_of_other_packages() -> None:
    """From ``inductor`` the op package's private modules are out of bounds, however they are imported;
    ``inductor_ext._compat`` (private to the whole package) is not; from inside ``ops`` all are allowed."""
    source = (
        "import inductor_ext.ops._layout\n"
        "from inductor_ext.ops import _reduce\n"
        "from inductor_ext.ops._split_gemm import float32_mm\n"
        "from inductor_ext import _compat\n"
        "from inductor_ext._compat import torch_fixes\n"
        "from inductor_ext.library import registration\n"
        "def f():\n"
        "    from ..ops._gradient_tie import tied_to_gradient\n"
    )
    assert private_imports(PACKAGE_DIR / "inductor" / "example.py", source) == [
        "1: inductor_ext.ops._layout",
        "2: inductor_ext.ops._reduce",
        "3: inductor_ext.ops._split_gemm",
        "8: inductor_ext.ops._gradient_tie",
    ]
    assert private_imports(PACKAGE_DIR / "ops" / "example.py", source) == []
    assert private_imports(PACKAGE_DIR / "ops" / "sub" / "example.py", source.replace("..ops", "...ops")) == []
    assert private_owner("inductor_ext.ops.__init__") is None
    assert private_owner("inductor_ext._compat.torch_fixes") == "inductor_ext"


def test_the_package_never_imports_the_repository_benchmarks() -> None:
    """``benchmarks/`` is not in the wheel: nothing installed may import it."""
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "benchmarks" or n.startswith("benchmarks.") for n in names), (path, node.lineno)

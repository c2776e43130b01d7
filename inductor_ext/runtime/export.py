"""AOTInductor export of models that use fastops ops, and loading the result.

``export`` runs ``torch.export`` (fastops ops stay real ops in the exported program),
decides each fastops call's route as the ``fastops_inductor`` backend does (our
Triton kernels, compiled into the package as cubins, or Inductor's code from the op's
math; the tuning database is read when it has the shapes), and compiles the program
into a ``.pt2`` package (``aot_compile``, ``package_aoti``). Packages run from Python
(:func:`load`) or from C++ with no Python (:mod:`inductor_ext.runtime.cpp_runner`).
"""

import json
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch._inductor.package import package_aoti
from torch.export.pt2_archive._package import PT2ArchiveReader, load_pt2
from torch.export.pt2_archive.constants import AOTINDUCTOR_DIR

from inductor_ext.inductor.recipe import CompileRecipe
from inductor_ext.runtime.cxx_runtime import carries_static_cxx_runtime, promote_cxx_runtime
from inductor_ext.runtime.package_inputs import METADATA_KEY, ExpectedInputs, check_contiguous, record_inputs
from inductor_ext.runtime.shared_weights import read_weights, share_weights


class ExportError(ValueError):
    """The model cannot be exported as one graph (the message says where and why)."""


_EXPORT_FAILURES = (
    torch._dynamo.exc.Unsupported,
    torch._dynamo.exc.UserError,
    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode,
)


def export_program(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    *,
    kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` with our checks and errors (:class:`ExportError` where the graph breaks)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"inductor_ext.export: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"inductor_ext.export: args must be a tuple of example inputs, got {type(args).__name__}")
    try:
        return torch.export.export(model, args, kwargs=dict(kwargs or {}), dynamic_shapes=dynamic_shapes)
    except _EXPORT_FAILURES as error:
        raise ExportError(
            f"inductor_ext.export: {type(model).__name__} cannot be exported as one graph "
            f"({type(error).__name__}); torch.export says:\n{error}"
        ) from error


def compile_program(program: torch.export.ExportedProgram, options: Mapping[str, Any] | None = None) -> list[Any]:
    """AOTInductor's files for ``program`` (what ``torch._inductor.package.package_aoti`` bundles as one
    model of a package), with our graph rewrites and route decisions; ``options`` as :func:`export`'s.
    The model's metadata records what its inputs must be (:mod:`inductor_ext.runtime.package_inputs`)."""
    inputs = record_inputs(program)
    recipe = CompileRecipe.prepare(program.graph_module, "export", options, default_multi_kernel=None)
    # AOTInductor always emits C++; so, as for the cpp_wrapper option (docs/backend.md), tune at compile
    # time explicitly: multi-kernel asserts without it on some versions
    patches = {**recipe.patches, "aot_inductor.package": True}
    # a dict of its own: AOTInductor adds its entries to the one it is given
    patches["aot_inductor.metadata"] = {**patches.get("aot_inductor.metadata", {})}
    if inputs is not None:
        patches["aot_inductor.metadata"][METADATA_KEY] = inputs
    patches.pop("cpp_wrapper", None)
    patches.setdefault("triton.autotune_at_compile_time", True)
    args, kwargs = program.example_inputs or ((), {})
    with recipe.tracing():
        files = torch._inductor.aot_compile(program.module(), args, kwargs, options=patches)
    assert isinstance(files, list), "aot_compile with aot_inductor.package returns the package's files"
    return files


def export(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    path: str | Path,
    *,
    kwargs: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    options: Mapping[str, Any] | None = None,
) -> Path:
    """Export ``model(*args, **kwargs)`` to the AOTInductor package ``path`` (``.pt2``) and return its path.

    ``dynamic_shapes`` is ``torch.export``'s. ``options`` takes the backend's
    ``fastops.*`` options (docs/backend.md) and Inductor config patches. What is frozen
    at export: every route decision and every kernel config, chosen at the example
    shapes; Inductor's multi-kernel is off unless ``fastops.multi_kernel`` is passed.
    """
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"inductor_ext.export: path must end in .pt2 (an AOTInductor package), got {path.name!r}")
    program = export_program(model, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes)
    files = compile_program(program, options)
    path.parent.mkdir(parents=True, exist_ok=True)
    package_aoti(str(path), files)
    return path


class Package:
    """A loaded AOTInductor package: call it with arguments shaped as the exported example's.

    An AOTInductor package reads each tensor input as the example it was compiled for, without checking
    it: another batch at a static size gives garbage rows, a strided view such as ``ids[:, :n]`` is read
    as if it were contiguous (seen as a garbage second row of a prompt slice). A call checks each tensor
    against the inputs the package recorded at export (:mod:`inductor_ext.runtime.package_inputs`: device type,
    dtype, static sizes, dynamic sizes' ranges) and refuses non-contiguous ones (every :func:`export`
    example here is contiguous) rather than copy them, since a copy of an input the package updates in
    place (a KV cache) would drop the update; each error names the argument. A package exported before
    the record existed gets the layout check only. Other attributes (``get_metadata``, ...) are the loader's.
    """

    def __init__(self, runner: Any, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        self._runner = runner
        self._weights = weights  # the package's shared weights, which the runner uses but does not own
        self._inputs = ExpectedInputs.of(runner.get_metadata())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._inputs is not None:
            self._inputs.check(args, kwargs)
        else:
            for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
                for index, tensor in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(tensor, torch.Tensor):
                        check_contiguous(f"{name}[{index}]" if isinstance(value, (list, tuple)) else name, tensor)
        return self._runner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def load(path: str | Path, device: torch.device | str | None = None) -> Package:
    """The callable of an AOTInductor package (its model ``"model"``), as a :class:`Package`; ``device`` as
    :func:`load_models`'.

    A package whose wrapper carries its own static libstdc++ (as some compilers link it: docs/export.md)
    crashes in a process that loaded the shared one locally; for such a package only, the process's C++
    runtime is made global first (:func:`inductor_ext.runtime.cxx_runtime.promote_cxx_runtime`).
    """
    models = load_models(path, device)
    if "model" not in models:
        raise ValueError(f"inductor_ext.load: {path} has no model named 'model' (it has {sorted(models)})")
    return models["model"]


def _package_device_type(path: str | Path) -> str:
    """The device type a package's models were compiled for (their ``AOTI_DEVICE_KEY``), read from the
    archive without loading them."""
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"inductor_ext.load: {path} is not an AOTInductor package: not a zip archive (truncated or corrupt, "
            "or another kind of file)"
        )
    try:
        with PT2ArchiveReader(str(path)) as reader:
            for name in reader.get_file_names():
                if name.startswith(AOTINDUCTOR_DIR) and name.endswith("_metadata.json"):
                    return str(json.loads(reader.read_string(name))["AOTI_DEVICE_KEY"])
    except RuntimeError as error:  # torch's archive reader: a zip file that is not a .pt2 archive, or unreadable
        raise ValueError(
            f"inductor_ext.load: {path} is not an AOTInductor package ({str(error).splitlines()[0]})"
        ) from error
    raise ValueError(f"inductor_ext.load: {path} holds no AOTInductor model")


def load_models(
    path: str | Path, device: torch.device | str | None = None, *, single_threaded: bool = False
) -> dict[str, Package]:
    """Every model of a package by name (:func:`export` writes one, ``"model"``; a generation package
    more), loaded once each (``torch._inductor.aoti_load_package`` loads them all to return one). A
    package that stores its weights once for all its models (:mod:`inductor_ext.runtime.shared_weights`) has
    them read onto its device once and given to every model.

    ``device``: where the models run, of the device type they were compiled for (a CUDA package on
    ``cuda:N``); default, that type's default device. Any other type is refused: the models' code is
    that device's (a CPU package called with meta tensors crashed the process). ``single_threaded``:
    AOTInductor's runner without its per-call thread synchronisation (no CUDA event recorded and
    waited on per call), for a caller that calls each model from one thread at a time; a call can then
    be captured in a CUDA graph."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"inductor_ext.load: no package at {path}")
    own = _package_device_type(path)
    try:
        target = torch.device(own if device is None else device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"inductor_ext.load: device must be a torch.device or its name, got {device!r}") from error
    if target.type != own:
        raise ValueError(
            f"inductor_ext.load: device must be of the package's device type {own!r} (its code is compiled for "
            f"it; a CUDA package runs on any cuda:N), got {device!r}"
        )
    try:
        if carries_static_cxx_runtime(path):
            promote_cxx_runtime()
    except zipfile.BadZipFile as error:  # e.g. a CRC error in a library of the package
        raise ValueError(f"inductor_ext.load: {path} is a corrupt AOTInductor package ({error})") from error
    # the loader takes an index for a CUDA device only (a CPU model refuses any)
    index = -1 if target.index is None or target.type == "cpu" else target.index
    runners = load_pt2(str(path), device_index=index, run_single_threaded=single_threaded).aoti_runners
    if not runners:
        raise ValueError(f"inductor_ext.load: {path} holds no AOTInductor model")
    weights = read_weights(path, target)
    if weights is not None:
        for runner in runners.values():
            share_weights(runner, weights)
    return {name: Package(runner, weights) for name, runner in runners.items()}

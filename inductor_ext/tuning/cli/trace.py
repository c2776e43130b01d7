"""The fastops op calls a model will make, found without weights and without running it.

The model is built on the ``meta`` device (parameters have shapes and dtypes, no
storage) and called on meta inputs under ``torch.compile`` with a capturing backend:
Dynamo hands it each graph, the backend applies the ``fastops_inductor`` rewrites
(:func:`inductor_ext.inductor.rewrites.apply_rewrites`) and collects every fastops
forward op call with its arguments' shapes and dtypes. The captured graphs then run
on meta tensors, which computes nothing. Calls are deduplicated by (op, signature).

Tracing runs with autograd on by default (the calls of a training step: ops whose
signature depends on it, like fused linear cross-entropy's ``grad_*`` flags, then match
what the backend sees when compiling a training step); ``grad=False`` gives inference calls.
"""

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from inductor_ext.inductor.rewrites import apply_rewrites
from inductor_ext.tuning.cli.calls import OpCall, dedup, meta_call, parse_dtype
from inductor_ext.tuning.routes import fastops_calls


def trace_calls(
    model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], grad: bool = True
) -> list[OpCall]:
    """The rewritten fastops calls of ``model(*args, **kwargs)`` (meta model and inputs)."""
    found: list[OpCall] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        apply_rewrites(gm)
        found.extend(meta_call(family, values) for family, values in fastops_calls(gm))
        return gm.forward

    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=capture, dynamic=False)(*args, **kwargs)
    return dedup(found)


def calls_from_entry(entry: str, grad: bool = True) -> list[OpCall]:
    """Trace the model of an entry ``module:function`` returning ``(model, example_input_shapes)``.

    The function is called under ``torch.device("meta")``, so parameters made without an
    explicit device are never allocated (a model that has real ones anyway is moved to
    meta). Input shapes are a sequence (positional inputs) or a dict (keyword inputs) of
    either a shape tuple (default dtype) or a ``(shape, dtype)`` pair, dtype a
    ``torch.dtype`` or its name.
    """
    function = _load_entry(entry)
    with torch.device("meta"):
        result = function()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ValueError(f"entry {entry!r} must return (model, example_input_shapes), got {type(result).__name__}")
    model, shapes = result
    if any(t.device.type != "meta" for t in (*model.parameters(), *model.buffers())):
        model = model.to("meta")
    where = f"entry {entry!r}"
    if isinstance(shapes, Mapping):
        kwargs = {name: _meta_input(spec, f"{where}, input {name!r}") for name, spec in shapes.items()}
        return trace_calls(model, (), kwargs, grad)
    if isinstance(shapes, (list, tuple)):
        args = [_meta_input(spec, f"{where}, input {i}") for i, spec in enumerate(shapes)]
        return trace_calls(model, args, {}, grad)
    raise ValueError(f"{where}: example_input_shapes must be a list/tuple or a dict, got {type(shapes).__name__}")


def calls_from_hf_config(path: Path, batch: int, seq: int, dtype: torch.dtype, grad: bool = True) -> list[OpCall]:
    """Trace ``AutoModelForCausalLM.from_config`` of a local config (a directory or its
    ``config.json``) on ``input_ids`` and ``labels`` of shape (batch, seq): the loss included.

    The KV cache is off (``use_cache=False``): a training step has none, and transformers'
    ``DynamicCache`` creates its empty buffers outside the meta device."""
    try:
        import transformers  # type: ignore[import-not-found]
    except ImportError:
        raise ValueError("--hf-config needs transformers (pip install 'inductor-ext[hf]')") from None
    if not path.exists():
        raise ValueError(f"HF config {path} does not exist (a local directory or config.json is expected)")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, use_cache=False)
    except (OSError, ValueError) as error:
        raise ValueError(f"HF config {path}: {error}") from error
    with torch.device("meta"):
        # transformers >= 4.56 names the argument ``dtype`` (5.x warns on ``torch_dtype``)
        dtype_arg = "torch_dtype" if transformers.__version__.startswith(("2.", "3.", "4.")) else "dtype"
        model = transformers.AutoModelForCausalLM.from_config(config, **{dtype_arg: dtype})
    inputs: dict[str, Any] = {
        n: torch.empty((batch, seq), dtype=torch.int64, device="meta") for n in ("input_ids", "labels")
    }
    inputs["use_cache"] = False
    return trace_calls(model, (), inputs, grad)


def _load_entry(entry: str) -> Callable[[], Any]:
    module_name, sep, function_name = entry.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"entry {entry!r} must be written module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"entry {entry!r}: cannot import module {module_name!r} ({error})") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"entry {entry!r}: module {module_name!r} has no function {function_name!r}")  # noqa: TRY004
    return function


def _meta_input(spec: Any, where: str) -> torch.Tensor:
    if isinstance(spec, (list, tuple)) and all(isinstance(s, int) for s in spec):
        shape, dtype = spec, torch.get_default_dtype()
    elif isinstance(spec, (list, tuple)) and len(spec) == 2 and isinstance(spec[0], (list, tuple, torch.Size)):
        shape, dtype = spec[0], spec[1]
    else:
        raise ValueError(f"{where}: expected a shape tuple or a (shape, dtype) pair, got {spec!r}")
    try:
        return torch.empty(tuple(shape), dtype=parse_dtype(dtype), device="meta")
    except (ValueError, TypeError, RuntimeError) as error:
        raise ValueError(f"{where}: {error}") from error

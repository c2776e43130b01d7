"""``export_generation``: an HF causal LM's prefill and decode step as one AOTInductor package.

The package holds :class:`~inductor_ext.runtime.generation.step.GenerationStep` as several graphs over one copy
of the weights (:mod:`inductor_ext.runtime.shared_weights`):

- ``"model"``: a dynamic batch (1..``max_batch_size``) and a dynamic number of new tokens
  (1..``max_seq_len``): the prefill is a call with the prompt's tokens, a decode step at any batch a
  call with one token per sequence; Inductor's multi-kernel picks each reduction's variant at run time.
- ``"decode_batch_<n>"`` for each ``n`` of ``decode_batch_sizes`` (default: 1): a decode step at
  batch ``n`` with static shapes, which the runtimes use for that batch. Each compiles in a worker
  process while this one compiles the dynamic graph (:mod:`inductor_ext.runtime.compile_worker`). At batch 1 every projection
  is a matrix-vector product: with static shapes Inductor writes it as a reduction that it fuses with
  its neighbours (the norm before it, the SiLU after it) and tunes by coordinate descent, where the
  dynamic graph calls cuBLAS.

The caller owns the KV cache, which every call updates in place. What the runtime needs to allocate
the cache and stop generating is stored as the package's metadata (read by
:func:`inductor_ext.runtime.generation.load_generation` and by the C++ loop, ``csrc/generate.cpp``).
"""

import contextlib
import inspect
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, SupportsIndex

import torch

from inductor_ext.inductor.options import parse_options
from inductor_ext.runtime.compile_worker import CompileJob
from inductor_ext.runtime.export import compile_program, export_program
from inductor_ext.runtime.generation.attention import check_attention_choice
from inductor_ext.runtime.generation.cache_layout import kv_cache_shape
from inductor_ext.runtime.generation.metadata import decode_graph_name, encode
from inductor_ext.runtime.generation.step import GenerationStep
from inductor_ext.runtime.shared_weights import program_weights, write_package

GRAPH_OPTIONS = {"aot_inductor.compile_wrapper_opt_level": "O0"}
"""Options of every graph of the package (``options`` passed to ``export_generation`` override them): the
host code that launches the kernels compiled without optimisation, which compiles faster (export split,
docs/export.md); a decode step's launches are replayed as a CUDA graph by both loops, so the host code's
speed no longer shows there, and the prefill's launches run ahead of its kernels."""

DECODE_GRAPH_OPTIONS = {"coordinate_descent_tuning": True, "fastops.route": "inductor"}
"""Options of the static decode graphs (``options`` passed to ``export_generation`` override them):
matrix-vector products as tuned reductions, and the norms in Inductor's code so that they fuse into
them: at batch 1 the Llama-3.2-1B shape decodes 1.21x faster than with the dynamic graph's cuBLAS
calls (C++ loop, docs/benchmarks/generate_llama-3.2-1b_prompt2048.json, ``package_cpp`` against
``package_cpp_dynamic``)."""


def _generation_setting(model: torch.nn.Module, name: str) -> Any:
    """``name`` as ``generate`` reads it: from the model's generation config when it has one (a ``None``
    there means none, even where the model's config names one), else from its config."""
    generation_config = getattr(model, "generation_config", None)
    return getattr(generation_config if generation_config is not None else model.config, name, None)


def _eos_token_ids(model: torch.nn.Module) -> list[int]:
    eos = _generation_setting(model, "eos_token_id")
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _pad_token_id(model: torch.nn.Module) -> int | None:
    """The id written after a sequence's end: the pad token, else the first end token (as ``generate`` does)."""
    pad = _generation_setting(model, "pad_token_id")
    eos = _eos_token_ids(model)
    return int(pad) if pad is not None else eos[0] if eos else None


_CONFIG_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
"""The fields of an HF causal LM's ``config`` that the export reads (the cache's shape, the logits' width)."""


def _check_arguments(
    model: object,
    path: object,
    max_batch_size: object,
    max_seq_len: object,
    options: object,
    attention: object,
    decode_batch_sizes: object,
) -> tuple[int, int, list[int]]:
    """``export_generation``'s arguments checked before any work (tracing and compiling take minutes): a
    ``TypeError`` or ``ValueError`` that names the argument. Returns ``max_batch_size`` and ``max_seq_len``
    as Python ints and ``decode_batch_sizes`` as a sorted list of distinct Python ints."""

    def integer(value: object, name: str) -> int:
        """``value`` as a Python int: an int or an integer type with ``__index__`` (numpy's), not a bool."""
        if not isinstance(value, bool) and isinstance(value, SupportsIndex):
            try:
                return operator.index(value)
            except TypeError:  # __index__ refused: a float or multi-element tensor, numpy's bool
                pass
        raise TypeError(f"export_generation: {name} must be an integer, got {value!r} ({type(value).__name__})")

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"export_generation: model must be a torch.nn.Module (an HF causal LM), got {type(model).__name__}"
        )
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(
            f"export_generation: model must be an HF causal LM with a config; {type(model).__name__} has no config"
        )
    missing = [field for field in _CONFIG_FIELDS if getattr(config, field, None) is None]
    if missing:
        raise TypeError(
            f"export_generation: model must be an HF causal LM; its config ({type(config).__name__}) has no "
            f"{', '.join(missing)}"
        )
    for field in _CONFIG_FIELDS:
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"export_generation: model.config.{field} must be a positive integer, got {value!r}")
    try:
        accepted = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a signature inspect cannot read: left to the trace
        accepted = None
    if (
        accepted is not None
        and "input_ids" not in accepted
        and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    ):
        raise TypeError(
            f"export_generation: model must be an HF causal LM whose forward takes input_ids; "
            f"{type(model).__name__}.forward takes ({', '.join(accepted)})"
        )
    parameters = list(model.parameters())
    if not parameters:
        raise ValueError(f"export_generation: model ({type(model).__name__}) has no parameters")
    devices = sorted({str(p.device) for p in parameters})
    if len(devices) > 1:
        raise ValueError(f"export_generation: model's parameters must be on one device, got {', '.join(devices)}")
    if not parameters[0].is_floating_point():
        raise ValueError(
            "export_generation: model's first parameter (whose dtype the KV cache takes) must be floating point, "
            f"got {parameters[0].dtype}"
        )

    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise TypeError(f"export_generation: path must be a str or os.PathLike, got {type(path).__name__}")
    if Path(path).suffix != ".pt2":
        raise ValueError(f"export_generation: path must end in .pt2 (an AOTInductor package), got {path}")
    if Path(path).is_dir():
        raise ValueError(f"export_generation: path {path} is a directory; it must name a .pt2 file")

    max_batch_size = integer(max_batch_size, "max_batch_size")
    max_seq_len = integer(max_seq_len, "max_seq_len")
    if max_batch_size < 1:
        raise ValueError(f"export_generation: max_batch_size must be >= 1, got {max_batch_size}")
    if max_seq_len < 2:
        raise ValueError(f"export_generation: max_seq_len must be >= 2, got {max_seq_len}")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_seq_len > limit:
        raise ValueError(
            f"export_generation: max_seq_len {max_seq_len} exceeds the model's max_position_embeddings {limit}"
        )

    check_attention_choice(attention, "export_generation")

    if options is not None:
        if not isinstance(options, Mapping):
            raise TypeError(
                f"export_generation: options must be None or a Mapping (option name -> value), "
                f"got {type(options).__name__}"
            )
        names = [name for name in options if not isinstance(name, str)]
        if names:
            raise TypeError(f"export_generation: options' names must be strings, got {names!r}")
        try:
            _, inductor_options = parse_options(options, default_multi_kernel=None)
        except (TypeError, ValueError) as error:
            raise ValueError(f"export_generation: options: {error}") from error
        import torch._inductor.config as inductor_config

        unknown = sorted(name for name in inductor_options if not hasattr(inductor_config, name))
        if unknown:
            raise ValueError(
                f"export_generation: options {unknown} are neither fastops.* options nor Inductor config options"
            )

    if isinstance(decode_batch_sizes, (str, bytes)) or not isinstance(decode_batch_sizes, Iterable):
        raise TypeError(
            "export_generation: decode_batch_sizes must be an iterable of integers (e.g. (1, 4) or ()), "
            f"got {decode_batch_sizes!r} ({type(decode_batch_sizes).__name__})"
        )
    sizes = sorted({integer(n, "each of decode_batch_sizes") for n in decode_batch_sizes})
    if any(not 1 <= n <= max_batch_size for n in sizes):
        raise ValueError(
            f"export_generation: decode_batch_sizes must be integers in 1..max_batch_size ({max_batch_size}), "
            f"got {sizes}"
        )
    if sizes and bool((options or {}).get("freezing")):
        raise ValueError(
            "export_generation: freezing folds the weights into each graph; pass decode_batch_sizes=() with it"
        )
    return max_batch_size, max_seq_len, sizes


def export_generation(
    model: torch.nn.Module,
    path: str | Path,
    *,
    max_batch_size: int,
    max_seq_len: int,
    options: Mapping[str, Any] | None = None,
    attention: str = "sdpa",
    decode_batch_sizes: Sequence[int] = (1,),
) -> Path:
    """Export ``model`` (an HF causal LM) for generation to the package ``path`` (``.pt2``); returns its path.

    ``max_seq_len`` bounds prompt plus generated tokens (the cache's length); ``max_batch_size`` the
    sequences generated together. ``options`` are :func:`inductor_ext.export`'s (the backend's
    ``fastops.*`` options and Inductor config patches). The model runs in its own dtype and device.
    ``attention`` (for a model that runs SDPA; :mod:`inductor_ext.runtime.generation.attention`): ``"sdpa"``
    (default), transformers' SDPA attention, which repeats the key/value heads of a grouped-query model;
    ``"folded_sdpa"``, SDPA on the cache's own key/value heads with the query heads folded into rows;
    ``"decode_attention"``, our decode-attention op (what each costs and saves: the attention module's
    docstring).
    ``decode_batch_sizes``: the batches that get a static decode graph (module docstring); each adds
    a compile to the export, not a copy of the weights. Inductor's ``freezing`` option folds the weights
    into each graph, so it needs ``decode_batch_sizes=()`` (one graph that holds its weights).
    """
    max_batch_size, max_seq_len, decode_batch_sizes = _check_arguments(
        model, path, max_batch_size, max_seq_len, options, attention, decode_batch_sizes
    )
    frozen = bool((options or {}).get("freezing"))
    config: Any = model.config
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype

    def example(batch: int, length: int) -> dict[str, Any]:
        layers, kinds, *layer_shape = kv_cache_shape(config, batch, max_seq_len)
        return {
            "input_ids": torch.zeros(batch, length, dtype=torch.long, device=device),
            "position_ids": torch.arange(length, device=device).expand(batch, length).contiguous(),
            "cache_position": torch.arange(length, device=device),
            "attention_mask": torch.ones(batch, max_seq_len, dtype=torch.long, device=device),
            # each layer's keys and values a tensor of its own, as the runtimes' views of one cache are to
            # the graph (disjoint): views of one example tensor made tracing prove, for every pair of the
            # 2 x layers mutated inputs, that they do not overlap, with symbolic sizes (a third of the
            # dynamic graph's compile on the CPU, 16 layers: docs/export.md)
            "kv_cache": [torch.zeros(layer_shape, dtype=dtype, device=device) for _ in range(layers * kinds)],
        }

    # the dynamic graph's example: at least 2 rows and 2 tokens (export specialises dimensions of size 0 or 1)
    batch, length = min(2, max_batch_size), 2
    # Dim.DYNAMIC hints, not named Dims: on CUDA tracing adds always-true guards on the token count
    # (min(128*t, 512*t) == 128*t) that torch.export rejects for a named Dim; hints keep them as checks
    # (ranges of at least 1..3: export takes a range 1..2 with an example of 2 for a static size; the
    # runtimes check the package's own maximum)
    rows = {0: torch.export.Dim.DYNAMIC(min=1, max=max(max_batch_size, 3))} if max_batch_size > 1 else {}
    tokens = torch.export.Dim.DYNAMIC(min=1, max=max(max_seq_len, 3))
    dynamic_shapes = {
        "input_ids": {**rows, 1: tokens},
        "position_ids": {**rows, 1: tokens},
        "cache_position": {0: tokens},
        "attention_mask": rows or None,
        "kv_cache": [rows or None] * (2 * config.num_hidden_layers),
    }
    names = ("input_ids", "position_ids", "cache_position", "attention_mask", "kv_cache")
    metadata = {
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "kv_cache_shape": list(kv_cache_shape(config, max_batch_size, max_seq_len)),
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "vocab_size": int(config.vocab_size),
        "eos_token_ids": _eos_token_ids(model),
        "pad_token_id": _pad_token_id(model),
        "decode_batch_sizes": decode_batch_sizes,
    }
    patches = {**GRAPH_OPTIONS, **(options or {})}
    patches["aot_inductor.metadata"] = {**patches.get("aot_inductor.metadata", {}), **encode(metadata)}
    if not frozen:
        patches["aot_inductor.package_constants_in_so"] = False
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            step = GenerationStep(model, attention=attention)
            program = export_program(step, tuple(example(batch, length).values()),
                                     dynamic_shapes=tuple(dynamic_shapes[name] for name in names))  # fmt: skip
            statics = {decode_graph_name(n): export_program(step, tuple(example(n, 1).values()))
                       for n in decode_batch_sizes}  # fmt: skip
            with contextlib.ExitStack() as jobs:
                # each static graph compiles in a worker process while this one compiles the dynamic graph
                started = {name: jobs.enter_context(CompileJob(static, {**DECODE_GRAPH_OPTIONS, **patches}, name))
                           for name, static in statics.items()}  # fmt: skip
                models = {"model": compile_program(program, patches)}
                models.update({name: job.result() for name, job in started.items()})
                return write_package(Path(path), models, None if frozen else program_weights(program))
    finally:
        model.train(was_training)

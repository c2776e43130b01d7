"""Generation from an exported package: an HF causal LM's prefill and decode step over a static KV
cache (:func:`export_generation`, which needs transformers), run from Python (:func:`load_generation`,
which does not) or from C++ (``inductor_ext/csrc/generate.cpp``)."""

from typing import Any

from inductor_ext.runtime.generation.runtime import GenerationPackage, load_generation

__all__ = ["GenerationPackage", "export_generation", "load_generation"]


def __getattr__(name: str) -> Any:
    if name == "export_generation":  # imported on first use: it imports transformers
        from inductor_ext.runtime.generation.export import export_generation

        return export_generation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

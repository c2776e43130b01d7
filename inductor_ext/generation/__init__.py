"""Generation from an exported package: an HF causal LM's prefill and decode step over a static KV
cache (:func:`export_generation`), run from Python (:func:`load_generation`) or from C++
(``inductor_ext/csrc/generate.cpp``)."""

from inductor_ext.generation.export import export_generation
from inductor_ext.generation.runtime import GenerationPackage, load_generation

__all__ = ["GenerationPackage", "export_generation", "load_generation"]

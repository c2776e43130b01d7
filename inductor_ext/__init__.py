"""inductor_ext: fused Triton kernels for LLM training and inference, as real PyTorch operators.

Importing the package registers the ``torch.ops.fastops.*`` operators and the
``fastops_inductor`` torch.compile backend. It does not initialise CUDA. The plain-PyTorch
references of the ops are in :mod:`inductor_ext.reference`.
"""

from typing import Any

from inductor_ext import models, nn
from inductor_ext.inductor import backend as _backend  # noqa: F401  (registers "fastops_inductor")
from inductor_ext.ops import (
    LoraProjection,
    Nf4Weight,
    add_rms_norm,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_,
    cross_entropy,
    decode_attention,
    embedding,
    fused_linear_cross_entropy,
    geglu,
    geglu_packed,
    layer_norm,
    lora_linear,
    lora_mlp,
    lora_qkv,
    nf4_dequantize,
    rms_norm,
    swiglu,
    swiglu_packed,
    vocab_parallel_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy,
)
from inductor_ext.runtime.export import ExportError, export, load
from inductor_ext.version import __version__


def __getattr__(name: str) -> Any:
    """``export_generation`` and ``load_generation`` (:mod:`inductor_ext.runtime.generation`), imported on first use."""
    if name in ("export_generation", "load_generation"):
        from inductor_ext.runtime import generation

        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ExportError",
    "LoraProjection",
    "Nf4Weight",
    "__version__",
    "add_rms_norm",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_",
    "cross_entropy",
    "decode_attention",
    "embedding",
    "export",
    "export_generation",
    "fused_linear_cross_entropy",
    "geglu",
    "geglu_packed",
    "layer_norm",
    "load",
    "load_generation",
    "lora_linear",
    "lora_mlp",
    "lora_qkv",
    "models",
    "nf4_dequantize",
    "nn",
    "rms_norm",
    "swiglu",
    "swiglu_packed",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy",
]

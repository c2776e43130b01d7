"""inductor_ext: fused Triton kernels for LLM training and inference, as real PyTorch operators.

Importing the package registers the ``torch.ops.fastops.*`` operators and the
``fastops_inductor`` torch.compile backend. It does not initialise CUDA.
"""

from typing import Any

from inductor_ext import models, nn
from inductor_ext.inductor import backend as _backend  # noqa: F401  (registers "fastops_inductor")
from inductor_ext.ops import (
    LoraProjection,
    Nf4Weight,
    add_rms_norm,
    add_rms_norm_ref,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_,
    apply_rotary_pos_emb_ref,
    cross_entropy,
    cross_entropy_ref,
    decode_attention,
    decode_attention_ref,
    embedding,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
    geglu,
    geglu_packed,
    geglu_ref,
    layer_norm,
    layer_norm_ref,
    lora_linear,
    lora_linear_ref,
    lora_mlp,
    lora_mlp_ref,
    lora_qkv,
    lora_qkv_ref,
    nf4_dequantize,
    rms_norm,
    rms_norm_ref,
    swiglu,
    swiglu_packed,
    swiglu_ref,
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
    "add_rms_norm_ref",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_",
    "apply_rotary_pos_emb_ref",
    "cross_entropy",
    "cross_entropy_ref",
    "decode_attention",
    "decode_attention_ref",
    "embedding",
    "export",
    "export_generation",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_ref",
    "geglu",
    "geglu_packed",
    "geglu_ref",
    "layer_norm",
    "layer_norm_ref",
    "load",
    "load_generation",
    "lora_linear",
    "lora_linear_ref",
    "lora_mlp",
    "lora_mlp_ref",
    "lora_qkv",
    "lora_qkv_ref",
    "models",
    "nf4_dequantize",
    "nn",
    "rms_norm",
    "rms_norm_ref",
    "swiglu",
    "swiglu_packed",
    "swiglu_ref",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy",
]

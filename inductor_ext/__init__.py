"""inductor_ext: fused Triton kernels for LLM training and inference, as real PyTorch operators.

Importing the package registers the ``torch.ops.fastops.*`` operators and the
``fastops_inductor`` torch.compile backend. It does not initialise CUDA.
"""

from inductor_ext import models, nn
from inductor_ext.export import ExportError, export, load
from inductor_ext.inductor import backend as _backend  # noqa: F401  (registers "fastops_inductor")
from inductor_ext.ops import (
    LoraProjection,
    add_rms_norm,
    add_rms_norm_ref,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_,
    apply_rotary_pos_emb_ref,
    cross_entropy,
    cross_entropy_ref,
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
    rms_norm,
    rms_norm_ref,
    swiglu,
    swiglu_packed,
    swiglu_ref,
    vocab_parallel_cross_entropy,
    vocab_parallel_fused_linear_cross_entropy,
)
from inductor_ext.version import __version__

__all__ = [
    "ExportError",
    "LoraProjection",
    "__version__",
    "add_rms_norm",
    "add_rms_norm_ref",
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_",
    "apply_rotary_pos_emb_ref",
    "cross_entropy",
    "cross_entropy_ref",
    "export",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_ref",
    "geglu",
    "geglu_packed",
    "geglu_ref",
    "layer_norm",
    "layer_norm_ref",
    "load",
    "lora_linear",
    "lora_linear_ref",
    "lora_mlp",
    "lora_mlp_ref",
    "lora_qkv",
    "lora_qkv_ref",
    "models",
    "nn",
    "rms_norm",
    "rms_norm_ref",
    "swiglu",
    "swiglu_packed",
    "swiglu_ref",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_fused_linear_cross_entropy",
]

"""Registered fastops operators (importing this module registers them)."""

from inductor_ext.library.sharding import register_sharding_rules as _register_sharding_rules
from inductor_ext.ops.cross_entropy import cross_entropy, cross_entropy_ref
from inductor_ext.ops.decode_attention import decode_attention, decode_attention_ref
from inductor_ext.ops.embedding import embedding
from inductor_ext.ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)
from inductor_ext.ops.glu import (
    geglu,
    geglu_packed,
    geglu_ref,
    swiglu,
    swiglu_packed,
    swiglu_ref,
)
from inductor_ext.ops.layer_norm import layer_norm, layer_norm_ref
from inductor_ext.ops.lora import (
    LoraProjection,
    lora_linear,
    lora_linear_ref,
    lora_mlp,
    lora_mlp_ref,
    lora_qkv,
    lora_qkv_ref,
)
from inductor_ext.ops.nf4 import Nf4Weight, nf4_dequantize
from inductor_ext.ops.rms_norm import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from inductor_ext.ops.rope import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_,
    apply_rotary_pos_emb_ref,
)
from inductor_ext.ops.sum_of_products import sum_of_products as _sum_of_products  # noqa: F401  (registers the op)
from inductor_ext.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_fused_linear_cross_entropy

_register_sharding_rules()  # the rules the op modules above declared

__all__ = ["add_rms_norm", "add_rms_norm_ref", "rms_norm", "rms_norm_ref"]
__all__ += ["cross_entropy", "cross_entropy_ref", "vocab_parallel_cross_entropy"]
__all__ += ["vocab_parallel_fused_linear_cross_entropy"]
__all__ += ["fused_linear_cross_entropy", "fused_linear_cross_entropy_ref"]
__all__ += ["layer_norm", "layer_norm_ref"]
__all__ += ["geglu", "geglu_packed", "geglu_ref", "swiglu", "swiglu_packed", "swiglu_ref"]
__all__ += ["apply_rotary_pos_emb", "apply_rotary_pos_emb_", "apply_rotary_pos_emb_ref"]
__all__ += ["LoraProjection", "lora_linear", "lora_linear_ref", "lora_mlp", "lora_mlp_ref", "lora_qkv", "lora_qkv_ref"]
__all__ += ["Nf4Weight", "nf4_dequantize"]
__all__ += ["decode_attention", "decode_attention_ref"]
__all__ += ["embedding"]

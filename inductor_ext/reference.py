"""The plain-PyTorch references of the fastops ops, the math tests compare the kernels against.

Each is defined beside the op it checks (``inductor_ext/ops/<op>.py``) and gathered here; they are not
in the top-level ``inductor_ext`` namespace. Called on float32 or float64 inputs they give the
reference values the tests measure relative errors against.
"""

from inductor_ext.ops.cross_entropy import cross_entropy_ref
from inductor_ext.ops.decode_attention import decode_attention_ref
from inductor_ext.ops.document_attention import document_causal_mask_ref
from inductor_ext.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_ref
from inductor_ext.ops.glu import geglu_ref, swiglu_ref
from inductor_ext.ops.layer_norm import layer_norm_ref
from inductor_ext.ops.lora import lora_linear_ref, lora_mlp_ref, lora_qkv_ref
from inductor_ext.ops.rms_norm import add_rms_norm_ref, rms_norm_ref
from inductor_ext.ops.rope import apply_rotary_pos_emb_ref

__all__ = [
    "add_rms_norm_ref",
    "apply_rotary_pos_emb_ref",
    "cross_entropy_ref",
    "decode_attention_ref",
    "document_causal_mask_ref",
    "fused_linear_cross_entropy_ref",
    "geglu_ref",
    "layer_norm_ref",
    "lora_linear_ref",
    "lora_mlp_ref",
    "lora_qkv_ref",
    "rms_norm_ref",
    "swiglu_ref",
]

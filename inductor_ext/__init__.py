"""inductor_ext: fused Triton kernels for LLM training and inference, as real PyTorch operators.

Importing the package registers the ``torch.ops.fastops.*`` operators and the
``fastops_inductor`` torch.compile backend. It does not initialise CUDA.
"""

from inductor_ext import nn
from inductor_ext.export import ExportError, export, load
from inductor_ext.inductor import backend as _backend  # registers "fastops_inductor"
from inductor_ext.ops import rms_norm, rms_norm_ref
from inductor_ext.ops import cross_entropy, cross_entropy_ref
from inductor_ext.ops import fused_linear_cross_entropy, fused_linear_cross_entropy_ref
from inductor_ext.ops import layer_norm, layer_norm_ref
from inductor_ext.ops import geglu, geglu_packed, geglu_ref, swiglu, swiglu_packed, swiglu_ref
from inductor_ext.ops import apply_rotary_pos_emb, apply_rotary_pos_emb_, apply_rotary_pos_emb_ref

from inductor_ext.version import __version__

__all__ = ["ExportError", "__version__", "export", "load", "nn", "rms_norm", "rms_norm_ref"]
__all__ += ["cross_entropy", "cross_entropy_ref"]
__all__ += ["fused_linear_cross_entropy", "fused_linear_cross_entropy_ref"]
__all__ += ["layer_norm", "layer_norm_ref"]
__all__ += ["geglu", "geglu_packed", "geglu_ref", "swiglu", "swiglu_packed", "swiglu_ref"]
__all__ += ["apply_rotary_pos_emb", "apply_rotary_pos_emb_", "apply_rotary_pos_emb_ref"]

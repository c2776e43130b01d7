"""Rewrites of common PyTorch spellings into fastops ops, on the Dynamo (torch-level) graph.

The backend runs every registered rewrite over the graph Dynamo hands it, before
AOTAutograd: a rewritten call becomes a fastops forward op, so AOTAutograd
differentiates it with the op's registered backward, and forward and backward both
run on the fastops ops (then on our kernels or Inductor's code, per the route).

One module per family: :mod:`.norms` (HF Llama and Gemma RMSNorm, ``torch.rms_norm``, a
residual add into an RMSNorm, LayerNorm), :mod:`.glu` (SwiGLU/GeGLU), :mod:`.cross_entropy`,
:mod:`.rope`, :mod:`.embedding`; :mod:`.registry` holds the registry (:func:`register_rewrite`,
:func:`apply_rewrites`) and the builders they share, :mod:`inductor_ext.inductor.graph_queries`
the graph queries. The rewrites apply in the order the modules are imported below. Matching is
structural and conservative: anything unexpected (another reduction dim, a tensor eps, a weight
of another shape) leaves the graph unchanged.
"""

# Import order is rewrite order (kept as before the split): the norms first (add_rms_norm rewrites the
# RMSNorm rewrites' output), then GLU, cross-entropy, RoPE, the embedding.
# isort: off
from inductor_ext.inductor.rewrites import norms  # noqa: F401  registers its rewrites
from inductor_ext.inductor.rewrites import glu  # noqa: F401  registers its rewrite
from inductor_ext.inductor.rewrites import cross_entropy  # noqa: F401  registers its rewrite
from inductor_ext.inductor.rewrites import rope  # noqa: F401  registers its rewrite
from inductor_ext.inductor.rewrites import embedding  # noqa: F401  registers its rewrite

# isort: on
from inductor_ext.inductor.rewrites.registry import REWRITES, Rewrite, apply_rewrites, register_rewrite

__all__ = ["REWRITES", "Rewrite", "apply_rewrites", "register_rewrite"]

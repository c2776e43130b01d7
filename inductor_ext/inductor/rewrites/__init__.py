"""Rewrites of common PyTorch spellings into fastops ops, on the Dynamo (torch-level) graph.

The backend runs every rewrite of :data:`REWRITES`, in its order, over the graph Dynamo hands it,
before AOTAutograd: a rewritten call becomes a fastops forward op, so AOTAutograd differentiates it
with the op's registered backward, and forward and backward both run on the fastops ops (then on
our kernels or Inductor's code, per the route).

One module per family: :mod:`.norms` (HF Llama and Gemma RMSNorm, ``torch.rms_norm``, a residual
add into an RMSNorm, LayerNorm), :mod:`.glu` (SwiGLU/GeGLU), :mod:`.cross_entropy`, :mod:`.rope`,
:mod:`.embedding`; each rewrite is the function of its name there. :mod:`.registry` runs them
(:func:`~.registry.run_rewrites`) and holds the builders they share,
:mod:`inductor_ext.inductor.graph_queries` the graph queries. Matching is structural and
conservative: anything unexpected (another reduction dim, a tensor eps, a weight of another shape)
leaves the graph unchanged.
"""

from torch.fx import GraphModule

from inductor_ext.inductor.rewrites import cross_entropy, embedding, glu, norms, rope
from inductor_ext.inductor.rewrites.registry import Rewrite, run_rewrites

REWRITES: dict[str, Rewrite] = {
    # the norms first: add_rms_norm fuses a residual add into the norm the rewrites above it produced
    "rms_norm_hf_llama": norms.rms_norm_hf_llama,
    "rms_norm_gemma": norms.rms_norm_gemma,
    "rms_norm_torch": norms.rms_norm_torch,
    "add_rms_norm": norms.add_rms_norm,
    "layer_norm": norms.layer_norm,
    "glu": glu.glu,
    "cross_entropy": cross_entropy.cross_entropy,
    "rope_hf": rope.rope_hf,
    "embedding": embedding.embedding,
}
"""Every rewrite the backend runs, by name (its counter is ``rewrite_<name>``), in the order it runs."""


def apply_rewrites(gm: GraphModule) -> dict[str, int]:
    """Run :data:`REWRITES` over ``gm`` (in place); how many of each applied."""
    return run_rewrites(gm, REWRITES)


__all__ = ["REWRITES", "Rewrite", "apply_rewrites"]

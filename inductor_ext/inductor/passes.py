"""The graph passes, declared in :data:`PASSES` in the order they run (:mod:`inductor_ext.inductor.pipeline`
runs them).

Each declaration binds one module's pass to the pipeline: the stages it runs in, its
default, whether users can switch it, and the measured reason it exists. The numbers are training
steps of the Llama-3.2-1B shape (bf16, 4 × 2048 tokens unless said) on one GPU, against the same step
without the pass (docs/benchmarks.md).
"""

from typing import Any

from torch._inductor.utils import get_donated_idxs
from torch.fx import Graph, GraphModule

from inductor_ext.inductor.causal_mask import rewrite_causal_masks
from inductor_ext.inductor.document_mask import rewrite_document_masks
from inductor_ext.inductor.donated_buffers import write_over_donated_inputs
from inductor_ext.inductor.lazy_outputs import defer_linear_output_grads
from inductor_ext.inductor.pass_types import GraphPass, PassContext, in_order
from inductor_ext.inductor.product_sums import accumulate_product_sums
from inductor_ext.inductor.recompute import (
    NORM_FORWARDS,
    mark_fused_norm_outputs,
    mark_recompute,
    resolve_marked_outputs,
)
from inductor_ext.inductor.rewrites import apply_rewrites
from inductor_ext.inductor.shapes import canonicalize_shape_calls


def _causal_mask(gm: GraphModule, context: PassContext) -> Any:
    return rewrite_causal_masks(gm, assume_no_padding=context.options.assume_no_padding)


def _document_mask(gm: GraphModule, context: PassContext) -> Any:
    return rewrite_document_masks(gm)


def _canonical_shapes(gm: GraphModule, context: PassContext) -> Any:
    return canonicalize_shape_calls(gm)


def _patterns(gm: GraphModule, context: PassContext) -> Any:
    return apply_rewrites(gm)


def _recompute_norms(graph: GraphModule | Graph, context: PassContext) -> Any:
    if isinstance(graph, GraphModule):  # the Dynamo graph: mark the calls
        return mark_recompute(graph, NORM_FORWARDS) + mark_fused_norm_outputs(graph)
    return resolve_marked_outputs(graph)


def _lazy_linear_outputs(gm: GraphModule, context: PassContext) -> Any:
    context.lazy_outputs = defer_linear_output_grads(gm, context.example_inputs)
    return context.lazy_outputs


def _accumulate_products(graph: Graph, context: PassContext) -> Any:
    return accumulate_product_sums(graph)


def _donated_buffers(graph: Graph, context: PassContext) -> Any:
    return write_over_donated_inputs(graph, get_donated_idxs())


PASSES = in_order(
    GraphPass(
        "causal_mask",
        stages=("dynamo", "export"),
        default=True,
        option=False,
        reason="traced, transformers materialises its causal mask and SDPA runs masked; proven causal, SDPA runs "
        "with is_causal=True: attention 14.0 ms a step instead of 33.2 (H200)",
        run=_causal_mask,
    ),
    GraphPass(
        "document_mask",
        stages=("dynamo", "export"),
        default=True,
        reason="packed rows: SDPA on the proven document mask becomes block-sparse FlexAttention: 67,668 tokens/s "
        "against torch.compile's 35,789 (1.89x; 1 x 8192 tokens, H200)",
        run=_document_mask,
    ),
    GraphPass(
        "canonical_shapes",
        stages=("dynamo",),
        default=True,
        option=False,
        reason="flatten/view spellings of a reshape become reshape, so that every rewrite sees one spelling: "
        "a norm written with flatten(0, -2) kept its residual add unfused (1.7 ms a step)",
        run=_canonical_shapes,
    ),
    GraphPass(
        "patterns",
        stages=("dynamo",),
        default=True,
        reason="common PyTorch/HF spellings become fastops ops, each call routed to the faster of our kernel and "
        "Inductor's code: fwd+bwd 1.09-1.26x torch.compile for RMSNorm, 1.63-1.69x for cross-entropy (H200)",
        run=_patterns,
    ),
    GraphPass(
        "recompute_norms",
        stages=("dynamo", "joint", "post_grad"),
        default=True,
        reason="norm outputs that feed matrix products are recomputed in the backward, not saved: with every norm "
        "of the step recomputed, 1.0 GiB less at the peak (16.92 against 17.92 GiB, H200)",
        run=_recompute_norms,
    ),
    GraphPass(
        "lazy_linear_outputs",
        stages=("dynamo",),
        default=True,
        option=False,
        reason="HF's logits beside the loss get no zero gradient: 1.93 GiB less at the peak, 5.8 ms less GPU "
        "time a step (H200)",
        run=_lazy_linear_outputs,
    ),
    GraphPass(
        "accumulate_products",
        stages=("post_grad",),
        default=True,
        option=False,
        reason="a backward's sum of matrix products is added in the GEMMs' epilogues: 2.2 ms less GPU time a step (H100)",
        run=_accumulate_products,
    ),
    GraphPass(
        "donated_buffers",
        stages=("post_grad",),
        default=True,
        option=False,
        reason="our backward kernels write their gradients over donated inputs instead of new buffers: the loss "
        "held 1.96 GiB (one logits tensor) more than torch.compile without it (8192 x 2048 x 128256, H200)",
        run=_donated_buffers,
    ),
)
"""Every pass, by name, in the order they run: the proofs first, on the graph as traced."""

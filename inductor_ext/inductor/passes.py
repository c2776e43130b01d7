"""The graph passes, declared in :data:`PASSES` in the order they run (:mod:`inductor_ext.inductor.pipeline`
runs them).

Each declaration binds one module's pass to the pipeline: the stages it runs in, its
default, whether users can switch it, and the reason it exists. A reason that quotes a number names the
committed benchmark file (``docs/benchmarks/*.json``) that holds it; the others say in words what the
pass saves.
"""

from typing import Any

from torch._inductor.utils import get_donated_idxs
from torch.fx import Graph, GraphModule

from inductor_ext.inductor.accumulate_products import accumulate_products
from inductor_ext.inductor.canonical_shapes import canonical_shapes
from inductor_ext.inductor.causal_mask import rewrite_causal_masks
from inductor_ext.inductor.document_mask import rewrite_document_masks
from inductor_ext.inductor.donated_buffers import write_over_donated_inputs
from inductor_ext.inductor.lazy_linear_outputs import lazy_linear_outputs
from inductor_ext.inductor.pass_types import GraphPass, PassContext, in_order
from inductor_ext.inductor.recompute_norms import (
    NORM_FORWARDS,
    mark_fused_norm_outputs,
    mark_recompute,
    resolve_marked_outputs,
)
from inductor_ext.inductor.rewrites import apply_rewrites


def _causal_mask(gm: GraphModule, context: PassContext) -> Any:
    return rewrite_causal_masks(gm, assume_no_padding=context.options.assume_no_padding)


def _document_mask(gm: GraphModule, context: PassContext) -> Any:
    return rewrite_document_masks(gm)


def _canonical_shapes(gm: GraphModule, context: PassContext) -> Any:
    return canonical_shapes(gm)


def _rewrites(gm: GraphModule, context: PassContext) -> Any:
    return apply_rewrites(gm)


def _recompute_norms(graph: GraphModule | Graph, context: PassContext) -> Any:
    if isinstance(graph, GraphModule):  # the Dynamo graph: mark the calls
        return mark_recompute(graph, NORM_FORWARDS) + mark_fused_norm_outputs(graph)
    return resolve_marked_outputs(graph)


def _lazy_linear_outputs(gm: GraphModule, context: PassContext) -> Any:
    context.lazy_outputs = lazy_linear_outputs(gm, context.example_inputs)
    return context.lazy_outputs


def _accumulate_products(graph: Graph, context: PassContext) -> Any:
    return accumulate_products(graph)


def _donated_buffers(graph: Graph, context: PassContext) -> Any:
    return write_over_donated_inputs(graph, get_donated_idxs())


PASSES = in_order(
    GraphPass(
        "causal_mask",
        stages=("dynamo", "export"),
        default=True,
        option=False,
        reason="traced, transformers materialises its causal mask and SDPA runs masked; proven causal, SDPA runs "
        "with is_causal=True: attention 13.05 ms a step instead of 32.83 "
        "(docs/benchmarks/train_llama-3.2-1b_4x2048_mask.json)",
        run=_causal_mask,
    ),
    GraphPass(
        "document_mask",
        stages=("dynamo", "export"),
        default=True,
        reason="packed rows: SDPA on the proven document mask becomes block-sparse FlexAttention: 67,668 tokens/s "
        "against torch.compile's 35,789 (docs/benchmarks/train_llama-3.2-1b_1x8192_packed.json)",
        run=_document_mask,
    ),
    GraphPass(
        "canonical_shapes",
        stages=("dynamo",),
        default=True,
        option=False,
        reason="flatten/view spellings of a reshape become reshape, so that every rewrite sees one spelling: "
        "a norm written with flatten(0, -2) would keep its residual add unfused",
        run=_canonical_shapes,
    ),
    GraphPass(
        "rewrites",
        stages=("dynamo",),
        default=True,
        reason="common PyTorch/HF spellings become fastops ops, each call routed to the faster of our kernel and "
        "Inductor's code: fwd+bwd 1.10-1.26x torch.compile for RMSNorm (docs/benchmarks/rms_norm_bfloat16.json), "
        "1.66x for cross-entropy (docs/benchmarks/cross_entropy_hf_loss_bfloat16.json)",
        run=_rewrites,
    ),
    GraphPass(
        "recompute_norms",
        stages=("dynamo", "joint", "post_grad"),
        default=True,
        reason="norm outputs that feed matrix products are recomputed in the backward, not saved: one elementwise "
        "kernel more per norm, and N H elements less held per norm (32 MiB at 8192 x 2048, bf16)",
        run=_recompute_norms,
    ),
    GraphPass(
        "lazy_linear_outputs",
        stages=("dynamo",),
        default=True,
        option=False,
        reason="HF's logits beside the loss get no zero gradient: 1.93 GiB less at the peak, 5.8 ms less GPU "
        "time a step (docs/benchmarks/train_llama-3.2-1b_4x2048_lazy_outputs.json)",
        run=_lazy_linear_outputs,
    ),
    GraphPass(
        "accumulate_products",
        stages=("post_grad",),
        default=True,
        option=False,
        reason="a backward's sum of matrix products is added in the GEMMs' epilogues: 2.2 ms less GPU time a step "
        "(docs/benchmarks/train_llama-3.2-1b_4x2048_gemm_levers_h100.json)",
        run=_accumulate_products,
    ),
    GraphPass(
        "donated_buffers",
        stages=("post_grad",),
        default=True,
        option=False,
        reason="our backward kernels write their gradients over donated inputs instead of new buffers: without it "
        "the loss's backward holds one logits tensor more than torch.compile's (1.96 GiB at 8192 x 128256, bf16)",
        run=_donated_buffers,
    ),
)
"""Every pass, by name, in the order they run: the proofs first, on the graph as traced."""

"""``torch.compile(model, backend="fastops_inductor")``.

Six steps on the graph Dynamo hands over, then Inductor:

0. call SDPA with ``is_causal=True`` where its mask is proven causal (:mod:`.causal_mask`), and
   block-sparse document attention where it is proven the packed-document mask (:mod:`.document_mask`);
1. rewrite common spellings into fastops ops (:mod:`.rewrites`), and compute sibling projections of
   one input (grouped-query attention's q/k/v) as one matrix product (:mod:`.sibling_projections`, an
   option, off by default);
2. mark the norm (and, as an option, GLU) outputs that feed matrix products for recomputation in
   the backward (:mod:`.recompute`), and return widening linear outputs the graph also reads (HF's
   logits) detached, to be differentiated outside the compiled graph only when used (:mod:`.lazy_outputs`);
3. decide each fastops op call's route, our kernels or Inductor's code from the op's
   aten math (:mod:`.choice`; timed on random inputs at compile time under ``"auto"``);
4. version the compile caches by our code, options and decisions (:mod:`.cache_key`), in a post-grad
   pass that also computes sums of matrix products in the GEMMs' epilogues (:mod:`.product_sums`, an
   option, on by default) and has our backward kernels write over donated inputs (:mod:`.donated_buffers`);
5. ``compile_fx`` with our Inductor config patches (multi-kernel on by default,
   compile-time autotuning with ``cpp_wrapper``), while the op bodies trace the
   chosen routes, and with the fixes of :mod:`inductor_ext._compat` installed for the
   compile and for the backward's lazy compile (only then: stock ``torch.compile`` is untouched).

Options: :mod:`inductor_ext.inductor.options`.
"""

import importlib.metadata
import json
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch._dynamo import register_backend

from inductor_ext import _compat
from inductor_ext.inductor.cache_key import FastopsGraphPass
from inductor_ext.inductor.causal_mask import rewrite_causal_masks
from inductor_ext.inductor.choice import RoutePlanner
from inductor_ext.inductor.document_mask import rewrite_document_masks
from inductor_ext.inductor.lazy_outputs import defer_linear_output_grads, with_lazy_outputs
from inductor_ext.inductor.options import parse_options
from inductor_ext.inductor.recompute import GLU_FORWARDS, NORM_FORWARDS, mark_recompute
from inductor_ext.inductor.rewrites import apply_rewrites
from inductor_ext.inductor.sibling_projections import fuse_sibling_projections
from inductor_ext.library.registration import route_ops
from inductor_ext.tuning.database import TuningDatabase

BACKEND_NAME = "fastops_inductor"


def fastops_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.async_compile import maybe_warm_pool
    from torch._inductor.compile_fx import compile_fx

    ours, inductor_options = parse_options(options)
    # Inductor's compile workers take seconds to start, and until they are up Inductor compiles
    # each Triton kernel's configs in this process, one by one: start them now, as the "inductor"
    # backend does (route timing compiles the ops' math before the graph). On the H200 this did
    # not measurably shorten route timing: the workers were not up in time for it.
    maybe_warm_pool()
    if ours.causal_mask:
        rewrite_causal_masks(gm, assume_no_padding=ours.assume_no_padding)
    if ours.document_mask:
        rewrite_document_masks(gm)
    if ours.patterns:
        apply_rewrites(gm)
    if ours.fuse_projections:
        fuse_sibling_projections(gm)
    recomputed = (NORM_FORWARDS if ours.recompute_norms else ()) + (GLU_FORWARDS if ours.recompute_glu else ())
    if recomputed:
        mark_recompute(gm, recomputed)
    lazy = defer_linear_output_grads(gm, example_inputs) if ours.lazy_linear_outputs else []
    planner = RoutePlanner(ours, TuningDatabase())
    planner.plan_graph(gm)

    # torch.compile passes mode only when it is neither None nor "default";
    # list_mode_options(None) would return every mode's options.
    patches = {**(list_mode_options(mode) if mode else {}), **inductor_options, **ours.inductor_patches()}
    state = json.dumps(
        {"options": repr(ours), "decisions": sorted(repr(d) for d in planner.decisions.values())}, sort_keys=True
    )
    user_pass = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = FastopsGraphPass(
        state, chained=user_pass, accumulate_products=ours.accumulate_products
    )
    with route_ops(planner.traces_math), _compat.applied(_compat.inductor_patches()):
        compiled = compile_fx(gm, example_inputs, inner_compile=compile_fx_inner_patched, config_patches=patches)
    return with_lazy_outputs(cast(Callable[..., Any], compiled), lazy)


def compile_fx_inner_patched(*args: Any, **kwargs: Any) -> Any:
    """Inductor's ``compile_fx_inner`` with :mod:`inductor_ext._compat`'s fixes installed: what compiles the
    forward, and the backward when AOTAutograd compiles it lazily, at the first ``.backward()``."""
    from torch._inductor.compile_fx import compile_fx_inner

    with _compat.applied(_compat.inductor_patches()):
        return compile_fx_inner(*args, **kwargs)


# When the distribution is installed, Dynamo finds the backend through the
# torch_dynamo_backends entry point, and registers it itself after importing this
# module: registering here too would make that a duplicate (AssertionError in
# torch 2.13). Without the entry point (source checkout), register on import.
if not importlib.metadata.entry_points(group="torch_dynamo_backends", name=BACKEND_NAME):
    register_backend(compiler_fn=fastops_inductor, name=BACKEND_NAME)

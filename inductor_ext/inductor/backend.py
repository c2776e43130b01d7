"""``torch.compile(model, backend="fastops_inductor")``.

On the graph Dynamo hands over (:class:`.recipe.CompileRecipe`, the same recipe as exports'), then Inductor:

1. the passes of the ``"dynamo"`` stage, in order (:mod:`.pipeline`, :mod:`.passes`):
   attention masks proven causal or packed-document, shape calls in one form, common spellings
   rewritten into fastops ops, norm outputs marked for recomputation, widening linear outputs
   returned lazily;
2. each fastops op call's route, our kernels or Inductor's code from the op's aten math
   (:mod:`.route_planner`; timed on random inputs at compile time under ``"auto"``: :mod:`inductor_ext.tuning.routes`);
3. ``compile_fx`` with our Inductor config patches (multi-kernel on by default, compile-time
   autotuning with ``cpp_wrapper``) and the ``"joint"`` and ``"post_grad"`` passes as Inductor's
   custom joint-graph and post-grad passes, whose ``uuid`` versions the compile caches by our code, options and route decisions
   (:mod:`.cache_key`), while the op bodies trace the chosen routes, and with the fixes of
   :mod:`inductor_ext._compat` installed for the compile and for the backward's lazy compile (only
   then: stock ``torch.compile`` is untouched).

Options: :mod:`inductor_ext.inductor.options`.
"""

import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch._dynamo import register_backend

from inductor_ext import _compat
from inductor_ext.inductor.lazy_linear_outputs import with_lazy_outputs
from inductor_ext.inductor.recipe import CompileRecipe

BACKEND_NAME = "fastops_inductor"


def fastops_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    from torch._inductor.async_compile import maybe_warm_pool
    from torch._inductor.compile_fx import compile_fx

    # Inductor's compile workers take seconds to start, and until they are up Inductor compiles
    # each Triton kernel's configs in this process, one by one: start them now, as the "inductor"
    # backend does (route timing compiles the ops' math before the graph).
    maybe_warm_pool()
    recipe = CompileRecipe.prepare(gm, "dynamo", options, example_inputs, mode=mode)
    with recipe.tracing():
        compiled = compile_fx(gm, example_inputs, inner_compile=compile_fx_inner_patched, config_patches=recipe.patches)
    return with_lazy_outputs(cast(Callable[..., Any], compiled), recipe.context.lazy_outputs)


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

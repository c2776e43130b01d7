"""``torch.compile(model, backend="fastops_inductor")``.

Foundation version: Inductor's ``compile_fx`` with the fastops decompositions
merged into Inductor's table, so fastops ops are lowered to Inductor's own
generated code (reductions) instead of our hand kernels. Pattern rewrites,
per-op route choice and cache keys come with the backend issue; until then this
backend is *not* a tuned route and ``torch.compile``'s default backend already
runs our hand kernels.
"""

import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo import register_backend

from inductor_ext.ops._library import DECOMPOSITIONS

BACKEND_NAME = "fastops_inductor"


def fastops_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    # torch.compile passes mode only when it is neither None nor "default";
    # list_mode_options(None) would return every mode's options.
    patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}
    decompositions = {**select_decomp_table(), **DECOMPOSITIONS}
    return compile_fx(gm, example_inputs, config_patches=patches, decompositions=decompositions)


# When the distribution is installed, Dynamo finds the backend through the
# torch_dynamo_backends entry point, and registers it itself after importing this
# module: registering here too would make that a duplicate (AssertionError in
# torch 2.13). Without the entry point (source checkout), register on import.
if not importlib.metadata.entry_points(group="torch_dynamo_backends", name=BACKEND_NAME):
    register_backend(compiler_fn=fastops_inductor, name=BACKEND_NAME)

"""Post-grad pass: our backward kernels write their gradient over a donated input instead of a new buffer.

In a compiled backward, AOTAutograd *donates* the saved activations that nothing reads
after the backward (``bw_donated_idxs``): Inductor may then reuse their memory. Its own
kernels do: under ``torch.compile``, the cross-entropy backward of
``F.cross_entropy((h @ w.T).float(), y)`` writes the logits' gradient over the saved
logits. Our kernels are user-defined Triton kernels that write into a buffer their op
allocated, so the saved logits and their gradient were alive together: on the H200, at
8192 x 2048 x 128256 (bf16), the backend's kernel route held 3.39 GiB above inputs and
gradients against ``torch.compile``'s 1.96 (one 1.96 GiB logits tensor more).

For each launch of a kernel in :data:`IN_PLACE_VARIANTS` in a backward graph whose input
tensor is a donated graph input read by nothing after it, and whose output is a fresh
``empty`` buffer of the same shape, strides and dtype, this pass launches the kernel's
kernel in place, with the output pointing at the input (its autotuner, with the same
configs, restores the input after each timed config), and every use of the output reads the input instead.
It runs as part of the backend's ``post_grad_custom_post_pass``, after the post-grad graph's
dead-code elimination: the in-place launch has no users, and fx does not count
``triton_kernel_wrapper_mutation`` as a side effect (torch 2.13), so a later
``eliminate_dead_code`` would drop it.
"""

import operator
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import (
    kernel_side_table,
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)
from torch.fx import Graph, Node
from triton.runtime.autotuner import Autotuner

from inductor_ext.kernels.cross_entropy import cross_entropy_bwd_kernel

aten = torch.ops.aten


class InPlaceArguments(NamedTuple):
    input: str
    output: str
    """Argument names: the kernel may write ``output`` over ``input``."""


IN_PLACE_VARIANTS: dict[Any, InPlaceArguments] = {
    cross_entropy_bwd_kernel.fn: InPlaceArguments("LOGITS", "DLOGITS"),
}
"""Triton JIT function -> the arguments it may alias. Launches are traced through autotuners built
around these functions (``ops._library.pruned_autotuner``), so the function identifies the kernel."""

_ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default)


def write_over_donated_inputs(graph: Graph, donated_indices: list[int] | None) -> int:
    """Rewrite the launches described in the module docstring; returns how many."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not donated_indices or not any(n.name.startswith("tangents") for n in placeholders):
        return 0  # not a backward graph, or nothing donated
    donated = {placeholders[i] for i in donated_indices if i < len(placeholders)}
    order = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for launch in list(graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional)):
        kernel = kernel_side_table.get_kernel(launch.kwargs["kernel_idx"])
        variant = IN_PLACE_VARIANTS.get(getattr(kernel, "fn", kernel))
        if variant is None or not isinstance(kernel, Autotuner) or kernel.restore_value:
            continue  # not ours, a bare JIT function, or already writing in place
        arguments = _kernel_arguments(launch)
        source, output = arguments.get(variant.input), arguments.get(variant.output)
        if not _can_write_over(launch, source, output, donated, order):
            continue
        with graph.inserting_before(launch):
            graph.call_function(
                triton_kernel_wrapper_mutation,
                kwargs={
                    "kernel_idx": kernel_side_table.add_kernel(_restoring(kernel, variant.output)),
                    "constant_args_idx": launch.kwargs["constant_args_idx"],
                    "grid": launch.kwargs["grid"],
                    "tma_descriptor_metadata": launch.kwargs["tma_descriptor_metadata"],
                    "kwargs": {**arguments, variant.output: source},
                },
            ).meta["val"] = None
        for user in list(launch.users):  # getitem(launch, output): the only output it clones
            user.replace_all_uses_with(source)
            graph.erase_node(user)
        graph.erase_node(launch)
        graph.erase_node(cast(Node, output))
        rewritten += 1
    return rewritten


def _restoring(kernel: Autotuner, output: str) -> Autotuner:
    """``kernel``'s configs, with an autotuner that restores ``output`` after each timed config (it is the input)."""
    return triton.autotune(configs=kernel.configs, key=[], restore_value=[output], reset_to_zero=kernel.reset_to_zero)(
        kernel.fn
    )


def _can_write_over(launch: Node, source: Any, output: Any, donated: set[Node], order: Mapping[Node, int]) -> bool:
    if not (isinstance(source, Node) and isinstance(output, Node)) or source not in donated:
        return False
    if output.op != "call_function" or output.target not in _ALLOCATIONS or set(output.users) != {launch}:
        return False
    if list(cast(list[str], launch.kwargs.get("tensors_to_clone", []))) != [_name_of(launch, output)]:
        return False
    if any(user.target is not operator.getitem for user in launch.users):
        return False
    if any(order[user] > order[launch] for user in source.users if user is not launch):
        return False  # read after the launch: its values are still needed
    before, after = source.meta.get("val"), output.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    return (before.shape, before.stride(), before.dtype, before.device) == (
        after.shape,
        after.stride(),
        after.dtype,
        after.device,
    )


def _kernel_arguments(launch: Node) -> Mapping[str, Any]:
    return cast(Mapping[str, Any], launch.kwargs["kwargs"])


def _name_of(launch: Node, argument: Node) -> str | None:
    return next((name for name, value in _kernel_arguments(launch).items() if value is argument), None)

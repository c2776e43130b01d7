"""Post-grad pass: our backward kernels write their gradients over donated inputs instead of new buffers.

In a compiled backward, AOTAutograd *donates* the saved activations that nothing reads
after the backward (``bw_donated_idxs``): Inductor may then reuse their memory. Its own
kernels do: under ``torch.compile``, the cross-entropy backward of
``F.cross_entropy((h @ w.T).float(), y)`` writes the logits' gradient over the saved
logits. Our kernels are user-defined Triton kernels that write into buffers their op
allocated, so without this pass the saved inputs and their gradients are alive together: the
cross-entropy backward on the kernel route holds one logits-sized tensor more than under
``torch.compile``. The SwiGLU/GeGLU
backward is the same case: its ``dgate`` and ``dup`` (``2 N I`` elements) were allocated beside the
saved ``gate`` and ``up`` at the first layer the backward reaches, where a training step's peak is;
so is the fused linear cross-entropy's backward, which scales the gradients its forward saved
(``dweight``, ``V H`` elements, and ``dhidden``) by ``grad_output`` into new buffers, at the
backward's start. Eager, those ops write in place themselves (the GLU when its caller allows it).

For each launch of a kernel in ``library.registration.OUTPUTS_OVER_DONATED`` (the op modules declare them
next to their kernels: ``may_write_over_input``) in a backward graph, each of its
(input, output) pairs whose input is a donated graph input (or a view of one) that nothing reads
after the launch, through any view, and whose output is a fresh ``empty`` buffer (or a view of
one: an op flattens its output to rows) of the same shape, strides and dtype, is written in place:
the kernel's output argument points at the input (an autotuner, with the same configs, restores
those inputs after each timed config), and every use of the output reads the input instead. The
launch's other outputs keep their fresh buffers, written directly (the functional launch's clone
of an empty buffer goes with it). Each output so written counts in
``counters["inductor_ext"]["in_place_over_donated:<kernel>.<output>"]``.
It runs as part of the backend's ``post_grad_custom_post_pass``, after the post-grad graph's
dead-code elimination: the in-place launch has no users, and fx does not count
``triton_kernel_wrapper_mutation`` as a side effect (torch 2.13), so a later
``eliminate_dead_code`` would drop it.
"""

import operator
from collections.abc import Mapping
from typing import Any, cast

import torch
import triton
from torch._dynamo.utils import counters
from torch._higher_order_ops.triton_kernel_wrap import (
    kernel_side_table,
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)
from torch.fx import Graph, Node
from triton.runtime.autotuner import Autotuner

import inductor_ext.ops  # noqa: F401  the op modules declare their kernels' in-place outputs
from inductor_ext.library import registration

aten = torch.ops.aten

_ALLOCATIONS = (aten.empty.memory_format, aten.empty_strided.default)


def write_over_donated_inputs(graph: Graph, donated_indices: list[int] | None) -> int:
    """Rewrite the launches described in the module docstring; returns how many outputs now alias inputs."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # AOTAutograd names a backward graph's gradient inputs tangents_<i>; the graph carries no other mark of it
    if not donated_indices or not any(n.name.startswith("tangents") for n in placeholders):
        return 0  # not a backward graph, or nothing donated
    donated = {placeholders[i] for i in donated_indices if i < len(placeholders)}
    order = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for launch in list(graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional)):
        kernel = kernel_side_table.get_kernel(launch.kwargs["kernel_idx"])
        tuner = kernel if isinstance(kernel, Autotuner) else None
        jit: Any = kernel if tuner is None else tuner.fn
        variant = registration.OUTPUTS_OVER_DONATED.get(jit)
        if variant is None or (tuner is not None and tuner.restore_value):
            continue  # not ours, or already writing in place
        arguments = _kernel_arguments(launch)
        buffers = _fresh_buffers(
            launch, {p.output: arguments[p.output] for p in variant if arguments.get(p.output) is not None}
        )
        if buffers is None:
            continue
        in_place = [
            pair
            for pair in variant
            if pair.output in buffers
            and _can_write_over(launch, arguments.get(pair.input), arguments[pair.output], donated, order)
        ]
        if not in_place:
            continue
        sources = {pair.output: arguments[pair.input] for pair in in_place}
        with graph.inserting_before(launch):
            in_place_launch = graph.call_function(
                triton_kernel_wrapper_mutation,
                kwargs={
                    # an autotuner times its configs on the inputs it now overwrites: it restores them
                    "kernel_idx": launch.kwargs["kernel_idx"]
                    if tuner is None
                    else kernel_side_table.add_kernel(_restoring(tuner, list(sources))),
                    "constant_args_idx": launch.kwargs["constant_args_idx"],
                    "grid": launch.kwargs["grid"],
                    "tma_descriptor_metadata": launch.kwargs["tma_descriptor_metadata"],
                    "kwargs": {**arguments, **sources},
                },
            )
        in_place_launch.meta["val"] = None
        order[in_place_launch] = order[launch]
        for user in list(launch.users):  # getitem(launch, name): the outputs it cloned
            user.replace_all_uses_with(sources.get(user.args[1], arguments[user.args[1]]))
            graph.erase_node(user)
        graph.erase_node(launch)
        for name in sources:
            for node in buffers[name]:  # the argument, the views between, the allocation: now unused
                graph.erase_node(node)
            counters["inductor_ext"][f"in_place_over_donated:{jit.__name__}.{name}"] += 1
        rewritten += len(sources)
    return rewritten


def _restoring(kernel: Autotuner, outputs: list[str]) -> Autotuner:
    """``kernel``'s configs, with an autotuner that restores ``outputs`` after each timed config (they are inputs)."""
    return triton.autotune(configs=kernel.configs, key=[], restore_value=outputs, reset_to_zero=kernel.reset_to_zero)(
        kernel.fn
    )


def _fresh_buffers(launch: Node, written: Mapping[str, Any]) -> dict[str, list[Node]] | None:
    """For each output the launch writes: the nodes from its argument back to the fresh ``empty`` buffer it
    views (the argument itself, views between, the allocation), each used only by the next; None unless
    the launch writes (and its functional form clones) exactly these and its results are read only
    through ``getitem``."""
    if set(cast(list[str], launch.kwargs.get("tensors_to_clone", []))) != set(written):
        return None
    if any(user.target is not operator.getitem for user in launch.users):
        return None
    buffers = {}
    for name, node in written.items():
        chain, user = [], launch
        while isinstance(node, Node) and set(node.users) == {user}:
            chain.append(node)
            if node.op == "call_function" and node.target in _ALLOCATIONS:
                buffers[name] = chain
                break
            if not _is_view(node):
                return None
            user, node = node, node.args[0]
        else:
            return None
    return buffers


def _can_write_over(launch: Node, source: Any, output: Any, donated: set[Node], order: Mapping[Node, int]) -> bool:
    """``source`` is a donated graph input, or a view of one (an op flattens its inputs to rows), that no
    other argument of the launch aliases and nothing reads after it; ``output`` has its layout."""
    if not (isinstance(source, Node) and isinstance(output, Node)) or _view_base(source) not in donated:
        return False
    aliases = _aliases(_view_base(source))
    arguments = list(_kernel_arguments(launch).values())
    if arguments.count(source) != 1 or any(isinstance(a, Node) and a in aliases for a in arguments if a is not source):
        return False  # also another argument of the kernel (read or written elsewhere)
    if any(order[user] > order[launch] for node in aliases for user in node.users if user not in aliases):
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


def _is_view(node: Node) -> bool:
    target = node.target
    return node.op == "call_function" and (target is aten._unsafe_view.default or getattr(target, "is_view", False))


def _view_base(node: Node) -> Node:
    """The tensor ``node`` is a chain of views of (itself if it is none)."""
    while _is_view(node) and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _aliases(base: Node) -> set[Node]:
    """``base`` and every view of it, views of views included."""
    found, pending = {base}, [base]
    while pending:
        for user in pending.pop().users:
            if _is_view(user) and user.args[0] in found and user not in found:
                found.add(user)
                pending.append(user)
    return found


def _kernel_arguments(launch: Node) -> Mapping[str, Any]:
    return cast(Mapping[str, Any], launch.kwargs["kwargs"])

"""Norm outputs recomputed in the backward instead of saved (``fastops.recompute_norms``).

In a decoder layer the normalised hidden state ``y = norm(x)`` feeds matrix products (the q/k/v
projections, the gate/up projections, the LM head), whose weight gradients need ``y`` in the
backward. AOTAutograd's partitioner saves ``y`` for them: it never recomputes a value that a matmul
reads in the backward (the recompute would not fuse into it), nor an opaque op such as our norm's
kernel. Yet the norm's own backward saves its input ``x`` and ``rstd`` anyway, and ``y`` is one
elementwise pass over them: recomputing it costs one kernel in the backward and saves ``N H`` elements
per norm (32 MiB at ``N = 8192`` tokens, ``H = 2048``, bf16).

Two mechanisms, one per kind of norm call, both run by this pass:

- **RMSNorm and LayerNorm** (``dynamo`` stage): each forward call whose output reaches a matrix product
  is marked ``MUST_RECOMPUTE``, the checkpoint policy that ``torch.utils.checkpoint``'s selective
  checkpointing sets; AOTAutograd copies it onto every node it traces from that call (on our kernel route
  the Triton kernel's node, on the Inductor route the aten math) and the partitioner recomputes those
  nodes in the backward from the input it saves anyway.
- **RMSNorm fused with its residual add** (``add_rms_norm``, most norms of an HF decoder): recomputing
  the call would need both summands, which nothing else saves. Instead, in the ``dynamo`` stage, ``y``
  passes through :data:`RECOMPUTABLE_OUTPUT`, a marker naming the tensors ``y`` is computed from (``h``,
  ``rstd`` and the weight, which the fused backward saves). In the ``joint`` stage (AOTAutograd's joint
  forward-backward graph, before the partition) the marker goes: the forward's consumers read ``y`` as
  the kernel wrote it, and the backward's (the weight gradients) read ``y`` recomputed by
  :func:`~inductor_ext.ops.rms_norm.rms_norm_output` (elementwise aten, the forward's own arithmetic, so
  equal to the bit), marked ``MUST_RECOMPUTE``. The ``post_grad`` stage drops markers left in graphs
  compiled without a backward.

Not marked: norms whose output reaches no matrix product (Qwen3's per-head q/k norms feed RoPE, whose
backward does not read them), where a recompute would only add a kernel.
"""

import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch._ops import OpOverload
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from inductor_ext.inductor.graph_queries import is_call, value, with_value
from inductor_ext.ops.layer_norm import layer_norm_family
from inductor_ext.ops.lora import lora_linear_family, lora_mlp_family, lora_qkv_family
from inductor_ext.ops.rms_norm import RECOMPUTABLE_OUTPUT, add_rms_norm_family, rms_norm_family, rms_norm_output

NORM_FORWARDS = (rms_norm_family.fwd, layer_norm_family.fwd)
"""Norm forward ops whose first output (the normalised tensor) may be recomputed; their backward saves their input."""

MATMUL_FUNCTIONS = (
    torch._C._nn.linear, F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    lora_linear_family.fwd, lora_qkv_family.fwd, lora_mlp_family.fwd,
)  # fmt: skip
"""Consumers whose backward reads their input (a weight's gradient): matrix products and our fused LoRA ops."""
MATMUL_METHODS = ("matmul", "mm", "bmm", "__matmul__")

SAME_VALUE_FUNCTIONS = (torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.transpose,
                        torch.permute, torch.t)  # fmt: skip
SAME_VALUE_METHODS = ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                      "transpose", "permute", "t", "contiguous")  # fmt: skip
"""Calls that pass an output on as the same values (a view or a layout)."""
CAST_METHODS = ("to", "type", "type_as", "float", "bfloat16", "half")
"""Casts: the same values when they keep the dtype; a cast to another dtype is a new tensor, which a matrix
product after it saves in the norm output's place (marking the norm would then only add a kernel)."""


def mark_recompute(gm: GraphModule, forwards: tuple[OpOverload, ...]) -> int:
    """Mark the calls of ``forwards`` in ``gm`` (a Dynamo graph) whose (first) output reaches a matrix
    product ``MUST_RECOMPUTE``; returns how many were marked."""
    marked = 0
    for node in gm.graph.nodes:
        if is_call(node, forwards) and any(
            is_call(user, MATMUL_FUNCTIONS, MATMUL_METHODS) for user in _consumers(node)
        ):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked += 1
    return marked


def mark_fused_norm_outputs(gm: GraphModule) -> int:
    """Pass the output ``y`` of each ``add_rms_norm`` call in ``gm`` (a Dynamo graph) that reaches a matrix
    product through :data:`RECOMPUTABLE_OUTPUT`; returns how many were marked."""
    marked = 0
    graph = gm.graph
    for call in list(graph.nodes):
        if not is_call(call, (add_rms_norm_family.fwd,)) or not any(
            is_call(user, MATMUL_FUNCTIONS, MATMUL_METHODS) for user in _consumers(call)
        ):
            continue
        _x, _residual, weight, _eps, offset, casting = call.args
        y, rstd, h = (_output(call, index) for index in range(3))
        for output in (h, rstd, y):  # right after the call, in the order y, rstd, h: before any use of them
            call.append(output)
        with graph.inserting_after(h):
            marker = with_value(graph.call_function(RECOMPUTABLE_OUTPUT, (y, h, rstd, weight, offset, casting)))
        for user in [user for user in y.users if user is not marker]:
            user.replace_input_with(y, marker)
        marked += 1
    return marked


def resolve_marked_outputs(graph: Graph) -> int:
    """Remove the :data:`RECOMPUTABLE_OUTPUT` markers of ``graph`` (AOTAutograd's joint graph, or a graph
    compiled without a backward): the forward's consumers read ``y``; the backward's (nodes that depend on
    a tangent), through the same views, read ``y`` recomputed from ``x`` and ``rstd``, marked
    ``MUST_RECOMPUTE`` so that the partitioner computes it in the backward. Returns the markers removed."""
    markers = [node for node in graph.nodes if is_call(node, (RECOMPUTABLE_OUTPUT,))]
    if not markers:
        return 0
    backward = _tangent_dependents(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    for marker in markers:
        y, x, rstd, weight, offset, casting = cast(tuple[Node, Node, Node, Node | None, float, str], marker.args)
        marker.replace_all_uses_with(y)
        graph.erase_node(marker)
        _mark_elementwise_output(y, [x, rstd] if weight is None else [x, rstd, weight])
        # views of y depend on y alone, so they are forward nodes: the backward's uses are their non-view users
        uses = [(user, node) for node in _view_closure(y) for user in node.users if user in backward]
        if not uses:
            continue
        first = min((user for user, _ in uses), key=position.__getitem__)
        with graph.inserting_before(first):
            recomputed = _insert_output(graph, x, rstd, weight, offset, casting)
            rebased: dict[Node, Node] = {y: recomputed}
            for user, node in uses:
                user.replace_input_with(node, _rebase(graph, node, rebased))
    return len(markers)


def _mark_elementwise_output(y: Node, sources: list[Node]) -> None:
    """Mark ``MUST_RECOMPUTE`` the elementwise nodes between ``sources`` and ``y`` (on the Inductor route,
    the traced math after ``rstd``; on our kernel route, none: ``y`` is the kernel's output). Unmarked, the
    partitioner's common-subexpression pass would merge the recompute inserted for the backward into them,
    and the partitioner would save ``y`` after all."""
    kept = _ancestors(sources)
    pending = [y]
    while pending:
        node = pending.pop()
        if node in kept or node.op != "call_function" or not (_is_view(node) or _is_elementwise(node)):
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        pending.extend(node.all_input_nodes)


def _is_elementwise(node: Node) -> bool:
    return isinstance(node.target, OpOverload) and torch.Tag.pointwise in node.target.tags


def _ancestors(nodes: list[Node]) -> set[Node]:
    """``nodes`` and every node they depend on."""
    found: set[Node] = set()
    pending = list(nodes)
    while pending:
        node = pending.pop()
        if node not in found:
            found.add(node)
            pending.extend(node.all_input_nodes)
    return found


def _insert_output(graph: Graph, x: Node, rstd: Node, weight: Node | None, offset: float, casting: str) -> Node:
    """Nodes computing :func:`rms_norm_output` (traced to aten with Inductor's decompositions) from the
    graph's ``x``, ``rstd`` and ``weight``, each marked ``MUST_RECOMPUTE``; returns the output's node."""
    x_value, rstd_value = value(x), value(rstd)
    weight_dtype = None if weight is None else value(weight).dtype
    traced = _traced_output(x_value.dtype, rstd_value.dtype, weight_dtype, offset, casting)
    inputs = [x, rstd] if weight is None else [x, rstd, weight]
    placeholders = [node for node in traced.graph.nodes if node.op == "placeholder"]
    env: dict[Node, Node] = dict(zip(placeholders, inputs, strict=True))
    for node in traced.graph.nodes:
        if node.op == "call_function":
            copied = graph.node_copy(node, lambda n: env[n])
            copied.meta = {"recompute": CheckpointPolicy.MUST_RECOMPUTE}
            env[node] = with_value(copied, "val")
        elif node.op == "output":
            return env[node.args[0]]
    raise AssertionError("rms_norm_output traced to no output")


@functools.cache
def _traced_output(
    x_dtype: torch.dtype, rstd_dtype: torch.dtype, weight_dtype: torch.dtype | None, offset: float, casting: str
) -> GraphModule:
    from torch._inductor.pattern_matcher import fwd_only

    x, rstd = torch.zeros(2, 4, dtype=x_dtype), torch.ones(2, dtype=rstd_dtype)
    if weight_dtype is None:
        return fwd_only(lambda x, rstd: rms_norm_output(x, rstd, None, offset, casting), [x, rstd])
    weight = torch.ones(4, dtype=weight_dtype)
    return fwd_only(lambda x, rstd, w: rms_norm_output(x, rstd, w, offset, casting), [x, rstd, weight])


def _rebase(graph: Graph, node: Node, rebased: dict[Node, Node]) -> Node:
    """``node`` (``y`` or a view chain from it) taken from the recomputed output instead."""
    if node not in rebased:
        source = _rebase(graph, cast(Node, node.args[0]), rebased)
        target = cast(Callable[..., Any], node.target)
        rebased[node] = with_value(graph.call_function(target, (source, *node.args[1:]), dict(node.kwargs)), "val")
    return rebased[node]


_RESHAPES = (torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _is_view(node: Node) -> bool:
    """A call that passes its first argument on as the same values (an aten view, or a reshape)."""
    target = node.target
    return node.op == "call_function" and (getattr(target, "is_view", False) or target in _RESHAPES)


def _view_closure(y: Node) -> list[Node]:
    """``y`` and the view chains from it (views of ``y``, views of those, ...)."""
    found, pending = [y], [y]
    while pending:
        for user in pending.pop().users:
            if _is_view(user) and user.args[0] in found:
                found.append(user)
                pending.append(user)
    return found


def _tangent_dependents(graph: Graph) -> set[Node]:
    """The nodes of a joint graph that depend on a tangent (its backward); empty in a graph without tangents."""
    dependents: set[Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangents" in str(node.target)) or any(
            arg in dependents for arg in node.all_input_nodes
        ):
            dependents.add(node)
    return dependents


def _output(call: Node, index: int) -> Node:
    """The ``getitem(call, index)`` node, inserted after ``call`` if the graph has none."""
    for user in call.users:
        if is_call(user, (operator.getitem,)) and user.args[1] == index:
            return user
    with call.graph.inserting_after(call):
        return with_value(call.graph.call_function(operator.getitem, (call, index)))


def _consumers(call: Node) -> Iterator[Node]:
    """The calls that read the op's (first) output, looking through views and casts of it."""
    assert isinstance(call.target, OpOverload)
    if len(call.target._schema.returns) == 1:
        pending = [call]
    else:
        pending = [user for user in call.users if is_call(user, (operator.getitem,)) and user.args[1] == 0]
    while pending:
        node = pending.pop()
        for user in node.users:
            if (
                user.args
                and user.args[0] is node
                and (is_call(user, SAME_VALUE_FUNCTIONS, SAME_VALUE_METHODS) or _keeps_dtype(user, node))
            ):
                pending.append(user)
            else:
                yield user


def _keeps_dtype(cast: Node, source: Node) -> bool:
    """Whether ``cast`` is one of :data:`CAST_METHODS` returning ``source``'s dtype (a no-op cast)."""
    before, after = value(source), value(cast)
    return (
        is_call(cast, (), CAST_METHODS)
        and isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
    )

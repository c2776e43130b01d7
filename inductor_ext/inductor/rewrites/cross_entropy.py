"""Rewrite of ``F.cross_entropy`` (HF ``ForCausalLMLoss`` ends in it) into the cross-entropy op."""

import operator

import torch
from torch.fx import Graph, Node

from inductor_ext.inductor.graph_queries import dtype_cast, is_call, value, with_value
from inductor_ext.inductor.rewrites.registry import SUPPORTED_FLOATS
from inductor_ext.ops.cross_entropy import cross_entropy_family


def _before_upcast(logits: Node) -> Node:
    """The 16-bit logits an fp32 upcast was taken of, in ``logits``' shape, or ``logits`` itself.

    Two spellings: ``x.float()`` and ``x.float().view(-1, V)`` (HF ``ForCausalLMLoss`` upcasts,
    then flattens). For the second, ``x.reshape(-1, V)`` is inserted at the current insertion point:
    a view of ``x`` wherever the upcast's view was one (the upcast keeps ``x``'s strides)."""
    reshaped = is_call(logits, (torch.reshape,), ("view", "reshape")) and not logits.kwargs
    inner = logits.args[0] if reshaped else logits
    cast = dtype_cast(inner)
    if cast is None or cast[1] != torch.float32 or value(cast[0]).dtype not in SUPPORTED_FLOATS:
        return logits
    if not reshaped:
        return cast[0]
    shape = logits.args[1:]
    if any(isinstance(a, torch.dtype) for a in shape):  # view(dtype) reinterprets bits: not a reshape
        return logits
    return with_value(logits.graph.call_method("reshape", (cast[0], *shape)))


def cross_entropy(node: Node) -> Node | None:
    """``F.cross_entropy(logits (N, V), labels (N,), ...)`` without class weights (HF ``ForCausalLMLoss``
    ends in it). An fp32 upcast of 16-bit logits is absorbed: the op computes in fp32 anyway."""
    if not is_call(node, (torch.nn.functional.cross_entropy,)):
        return None
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if set(bound) - set(names) or any(bound.get(k) is not None for k in ("weight", "size_average", "reduce")):
        return None
    logits, labels = bound.get("input"), bound.get("target")
    ignore_index, reduction = bound.get("ignore_index", -100), bound.get("reduction", "mean")
    smoothing = bound.get("label_smoothing", 0.0)
    lv, tv, out = value(logits), value(labels), value(node)
    if not isinstance(lv, torch.Tensor) or not isinstance(tv, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if not isinstance(logits, Node):  # a tensor in a Dynamo graph is always a node
        return None
    if lv.dim() != 2 or tv.dim() != 1 or tv.dtype not in (torch.int64, torch.int32) or lv.dtype not in SUPPORTED_FLOATS:
        return None
    if not isinstance(ignore_index, int) or reduction not in ("mean", "sum", "none"):
        return None
    if not isinstance(smoothing, (int, float)) or isinstance(smoothing, bool):
        return None
    args = (int(ignore_index), float(smoothing), 0.0, 0.0, reduction)
    graph: Graph = node.graph
    with graph.inserting_before(node):
        logits = _before_upcast(logits)  # the op reads 16-bit logits and computes in fp32
        rows = logits if value(logits).stride(-1) == 1 else with_value(graph.call_method("contiguous", (logits,)))
        result = with_value(graph.call_function(cross_entropy_family.fwd, (rows, labels, *args)))
        loss = with_value(graph.call_function(operator.getitem, (result, 0)))
        if value(loss).dtype != out.dtype:
            loss = with_value(graph.call_method("to", (loss, out.dtype)))
        return loss

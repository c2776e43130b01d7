"""Rewrite of HF ``apply_rotary_pos_emb`` (q and k rotated by one cos/sin pair) into the RoPE op."""

import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from inductor_ext.inductor.graph_queries import ADD, MUL, binary_operands, is_call, value, with_value
from inductor_ext.inductor.rewrites.registry import SUPPORTED_FLOATS
from inductor_ext.ops.rope import rope_family


def _rotate_half_source(node: Any) -> Any:
    """HF ``rotate_half(x)`` = ``cat((-x[..., h:], x[..., :h]), dim=-1)`` with h = D/2 -> x."""
    if not is_call(node, (torch.cat,)):
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or dim != -1:
        return None
    neg, first = tensors
    if not is_call(neg, (operator.neg, torch.neg), ("neg",)) or len(neg.args) != 1:
        return None
    second = neg.args[0]
    halves: list[tuple[Any, slice]] = []
    for part in (first, second):
        if not is_call(part, (operator.getitem,)) or not isinstance(part.args[1], tuple) or len(part.args[1]) != 2:
            return None
        if part.args[1][0] is not Ellipsis or not isinstance(part.args[1][1], slice):
            return None
        halves.append((part.args[0], part.args[1][1]))
    (x, low), (x2, high) = halves
    d = value(x).shape[-1] if isinstance(value(x), torch.Tensor) else None
    if x is not x2 or d is None or d % 2:
        return None
    if (low.start, low.stop, low.step) not in ((None, d // 2, None), (0, d // 2, None)):
        return None
    return x if (high.start, high.stop, high.step) == (d // 2, None, None) else None


def _unsqueezed_table(node: Any) -> tuple[Any, int] | None:
    """``table.unsqueeze(d)`` -> (table, d)."""
    if is_call(node, (torch.unsqueeze,), ("unsqueeze",)) and len(node.args) == 2 and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def _rotary(node: Node) -> tuple[Any, Any, Any, int, Any] | None:
    """``x * cos.unsqueeze(d) + rotate_half(x) * sin.unsqueeze(d)`` (any operand order)
    -> (x, cos, sin, d, the unsqueezed cos node)."""
    terms = binary_operands(node, ADD, "add")
    if terms is None:
        return None
    for cos_term, sin_term in (terms, terms[::-1]):
        cos_ops = binary_operands(cos_term, MUL, "mul") if isinstance(cos_term, Node) else None
        sin_ops = binary_operands(sin_term, MUL, "mul") if isinstance(sin_term, Node) else None
        if cos_ops is None or sin_ops is None:
            continue
        for x, cos_u in (cos_ops, cos_ops[::-1]):
            for rotated, sin_u in (sin_ops, sin_ops[::-1]):
                cos, sin = _unsqueezed_table(cos_u), _unsqueezed_table(sin_u)
                if cos and sin and cos[1] == sin[1] and _rotate_half_source(rotated) is x:
                    return x, cos[0], sin[0], cos[1], cos_u
    return None


def rope_hf(node: Node) -> Node | None:
    """HF ``apply_rotary_pos_emb``: the q and k rotations sharing one cos/sin pair become one op call.

    A rotation whose partner is not found (only q rotated, other tables) is left alone.
    """
    matched = _rotary(node)
    if matched is None:
        return None
    q, cos, sin, d, cos_u = matched
    # the partner rotation multiplies by the same unsqueezed cos (HF unsqueezes once for q and k)
    candidates = [add for mul in cos_u.users for add in mul.users if add is not node and add.users]
    partners = [
        (c, r) for c in candidates if (r := _rotary(c)) is not None and r[1:4] == (cos, sin, d) and r[0] is not q
    ]
    if not partners:
        return None
    k_node, k = partners[0][0], partners[0][1][0]
    qv, kv, cv, sv = (value(n) for n in (q, k, cos, sin))
    if qv.dim() != 4 or kv.dim() != 4 or qv.dtype != kv.dtype or d not in (1, 2, -3, -2):
        return None
    if cv.shape != sv.shape or cv.dim() not in (2, 3) or cv.shape[-1] != qv.shape[-1] or cv.requires_grad:
        return None
    if sv.requires_grad or qv.dtype not in SUPPORTED_FLOATS or cv.dtype != sv.dtype:
        return None
    if value(node).dtype != torch.promote_types(qv.dtype, cv.dtype):
        return None
    graph: Graph = node.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(node, k_node, key=order.__getitem__)
    if any(order[n] > order[first] for n in (q, k, cos, sin)):
        return None  # an input is computed between the two rotations: leave them
    with graph.inserting_before(first):
        out = with_value(graph.call_function(rope_family.fwd, (q, k, cos, sin, None, 1 if d in (1, -3) else 2)))
        q_embed = with_value(graph.call_function(operator.getitem, (out, 0)))
        k_embed = with_value(graph.call_function(operator.getitem, (out, 1)))
    k_embed.meta.update({key: v for key, v in k_node.meta.items() if key not in k_embed.meta})
    k_node.replace_all_uses_with(k_embed)
    return q_embed

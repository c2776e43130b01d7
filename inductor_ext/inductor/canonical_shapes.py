"""Shape calls in one canonical form before any rewrite matches: ``reshape``.

The rewrites match a reshape where the public functions flatten leading dims (e.g. the residual add of
``add_rms_norm`` is found through the norm's ``reshape``). The same reshape is spelled ``x.flatten(0, -2)``,
``torch.flatten(x, 0, -2)`` or ``x.view(-1, h)`` in other code, so each becomes ``x.reshape(...)`` first:
a reshape of a tensor that a view or flatten accepts is that same view, so the values and aliasing are
unchanged. ``view(dtype)`` (a reinterpretation of bits) and calls with keyword arguments are left alone.
"""

from typing import Any

import torch
from torch.fx import GraphModule, Node

from inductor_ext.inductor.graph_queries import is_call, value, with_value


def canonical_shapes(gm: GraphModule) -> int:
    """Rewrite ``gm``'s ``view`` and ``flatten`` calls (a Dynamo graph) as ``reshape``; returns how many."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.kwargs or not isinstance(node.args[0] if node.args else None, Node):
            continue
        source = node.args[0]
        if is_call(node, (), ("view",)) and _is_shape(node.args[1:]):
            shape: list[Any] | None = list(node.args[1:])
        elif is_call(node, (torch.flatten,), ("flatten",)):
            shape = _flattened_shape(node, source)
        else:
            continue
        if shape is None:
            continue
        with graph.inserting_before(node):
            reshape = with_value(graph.call_method("reshape", (source, *shape)))
        reshape.meta.update({k: v for k, v in node.meta.items() if k not in reshape.meta})
        node.replace_all_uses_with(reshape)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _is_shape(args: tuple[object, ...]) -> bool:
    """Whether ``view``'s arguments are a shape (sizes, or one list of them), not a dtype."""
    sizes = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
    return len(sizes) > 0 and not any(isinstance(s, torch.dtype) for s in sizes)


def _flattened_shape(node: Node, source: Node) -> list[Any] | None:
    """``flatten(source, start, end)``'s shape as reshape sizes: kept dims by their static size (or a ``size``
    call where symbolic), -1 for the flattened ones; None where it is no plain flatten."""
    x = value(source)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return None
    start, end = (list(node.args[1:]) + [0, -1][len(node.args) - 1 :])[:2]
    if not (isinstance(start, int) and isinstance(end, int)):
        return None
    start, end = start % x.dim(), end % x.dim()
    if start > end:
        return None
    graph = node.graph
    sizes: list[Any] = []
    with graph.inserting_before(node):
        for dim in [*range(start), None, *range(end + 1, x.dim())]:
            if dim is None:
                sizes.append(-1)
            elif isinstance(x.shape[dim], int):
                sizes.append(x.shape[dim])
            else:
                sizes.append(with_value(graph.call_method("size", (source, dim))))
    return sizes

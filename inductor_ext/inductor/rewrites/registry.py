"""What a rewrite is, how rewrites run, and the graph-building helpers the rewrite families share.

A rewrite is a function ``(node) -> Node | None``: given a candidate output node, it either
builds the replacement (inserted before ``node``) and returns it, or returns None.
:func:`run_rewrites` runs an ordered set of them (:data:`inductor_ext.inductor.rewrites.REWRITES`
declares the backend's).
"""

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from inductor_ext.inductor.graph_queries import eliminate_dead_code, value, with_value
from inductor_ext.library.registration import OpFamily

Rewrite = Callable[[Node], Node | None]

SUPPORTED_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
"""The floating dtypes the fastops ops take."""


def run_rewrites(gm: GraphModule, rewrites: Mapping[str, Rewrite]) -> dict[str, int]:
    """Rewrite every match in ``gm`` (in place), each rewrite over the whole graph in ``rewrites``' order;
    returns how many of each applied (counter ``rewrite_<name>``)."""
    applied = dict.fromkeys(rewrites, 0)
    for name, rewrite in rewrites.items():
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or node.op not in ("call_function", "call_method") or not node.users:
                continue  # erased, or already replaced by a rewrite that covered two outputs
            replacement = rewrite(node)
            if replacement is not None:
                replacement.meta.update({k: v for k, v in node.meta.items() if k not in replacement.meta})
                node.replace_all_uses_with(replacement)
                applied[name] += 1
                counters["inductor_ext"][f"rewrite_{name}"] += 1
        eliminate_dead_code(gm.graph)
    gm.recompile()
    return {name: n for name, n in applied.items() if n}


def insert_rows_call(node: Node, family: OpFamily, rows: list[Node], args: tuple[Any, ...], like: Node) -> Node:
    """``family(*rows as 2-D, *args)`` (its first output), viewed back to ``like``'s shape, before ``node``.

    Mirrors the public functions: leading dims flattened outside the op, unit stride along
    the last dim (a copy only when the example value lacks it).
    """
    graph: Graph = node.graph
    with graph.inserting_before(node):
        out = with_value(graph.call_function(family.fwd, (*map(rows_2d, rows), *args)))
        if isinstance(value(out), (tuple, list)):
            out = with_value(graph.call_function(operator.getitem, (out, 0)))
        return with_value(graph.call_method("view_as", (out, like)))


def rows_2d(t: Node) -> Node:
    """``t`` as ``(rows, last dim)`` at the graph's insertion point, as the public functions flatten
    leading dims (a copy only when the example value lacks a unit-stride last dim)."""
    graph = t.graph
    row2d = with_value(graph.call_method("reshape", (t, -1, value(t).shape[-1])))
    if value(t).stride(-1) != 1:
        row2d = with_value(graph.call_method("contiguous", (row2d,)))
    return row2d

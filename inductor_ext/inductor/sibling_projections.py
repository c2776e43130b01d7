"""Sibling projections of one input as one matrix product (``fastops.fuse_projections``, off by default).

A decoder layer's query, key and value projections read the same hidden state ``x``. With grouped-query
attention the key and value ones are narrow (512 of Llama-3.2-1B's 2048 features, 1024 of Llama-3.1-8B's
4096), and a narrow product runs below cuBLAS's rate. This pass rewrites, in the Dynamo graph,

    y_i = linear(x, W_i, b_i)        into        y = linear(x, cat(W_i), cat(b_i));  y_i = narrow(y, -1, o_i, n_i)

so AOTAutograd derives one product for each of the forward, the input gradient and the weight gradient:
``dx = dy cat(W_i)`` replaces ``sum_i dy_i W_i`` (three products and the sum of their ``N H`` outputs) and
``dW = dy^T x`` is split into the weights' gradients as views (row blocks of one buffer, no copy). It pays
two copies the separate products do not: the weights' concatenation (``2 H sum(n_i)`` elements, done again
in the backward: the concatenated weights are marked ``MUST_RECOMPUTE``, as :mod:`.recompute` marks the
norms, so the step holds no second copy of them, 201 MB at Llama-3.2-1B's shape, 1.6 GB at Llama-3.1-8B's)
and the output gradients' (``2 N sum(n_i)``: ``dy_i`` come from opaque kernels, SDPA's backward and RoPE's,
that cannot write into slices of one buffer).

Measured on the H200 (``python -m inductor_ext.bench projections``, a layer's projections forward and
backward at 8192 tokens, both copies paid): q/k/v 0.533 → 0.484 ms at Llama-3.2-1B's shape (1.10×),
1.942 → 1.862 ms at Llama-3.1-8B's (1.04×); gate/up, two products as wide as each other and wider than
their input, 0.96× at both. Hence the rule: a group is fused when one of its products is narrower than its
input (``out_features < in_features``), which picks GQA's q/k/v and leaves gate/up, and multi-head
attention's q/k/v of equal widths, as they are. Predicted from those numbers: -0.8 ms of a 117 ms training
step at the 1B shape. Measured in that step on an H100 (``bench train --providers fastops_inductor
fastops_inductor_fused_projections``): -1.5 ms of GPU time but -0.4 ms of wall time, inside the run-to-run
spread, so the option stays off.

A group is two or more ``linear`` calls on the same input node whose weights (and biases, on all or none)
are graph inputs of one dtype and device, 2-D weights of one input width, all trainable or all frozen
(LoRA's frozen base q/k/v form one group, its trainable ``A`` matrices of the same input another), with
no autocast, grad-mode or inference-mode boundary and no in-place write between its first and last call
(the fused product runs where the first call ran, and computes every projection there). The outputs are
the same products computed as one GEMM over a wider matrix, so they may differ from the separate ones in
the last bits (the BLAS may block the reduction differently). On CPU the weights' gradients are views into
one buffer (``p.grad`` of the group's weights share storage, each with its parameter's shape and strides);
on an H200 (torch 2.11) each came back as a buffer of its own (not explained yet).
"""

import itertools
import operator
from collections import defaultdict
from typing import Any, TypeGuard

import torch
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from inductor_ext.inductor.graph_queries import (
    LINEARS,
    any_between,
    changes_global_state,
    is_call,
    mutates,
    run_on_values,
    value,
    with_value,
)

Call = tuple[Node, Node, Node | None]
"""A ``linear`` call of a group, its weight and its bias (None without one)."""


def fuse_sibling_projections(gm: GraphModule) -> int:
    """Rewrite ``gm`` (a Dynamo graph) as the module docstring says; returns the number of groups fused."""
    graph = gm.graph
    groups: dict[tuple[Node, tuple[object, ...]], list[Call]] = defaultdict(list)
    for node in graph.nodes:
        parts = _linear_parts(node)
        if parts is not None:
            x, weight, bias = parts
            kind = _kind(weight, bias)
            if kind is not None:
                groups[x, kind].append((node, weight, bias))
    barriers = {node for node in graph.nodes if changes_global_state(node) or mutates(node)}
    fused = [
        (x, group)
        for (x, _), group in groups.items()
        if _fusable(group) and not any_between(group[0][0], group[-1][0], barriers)
    ]
    done = sum(_fuse(graph, x, group) for x, group in fused)
    if done:
        graph.lint()
        gm.recompile()
    return done


def _linear_parts(node: Node) -> tuple[Node, Node, Node | None] | None:
    """``(x, W, b)`` of ``linear(x, W, b)`` with ``W`` (and ``b``) graph inputs, else None."""
    names = ("input", "weight", "bias")
    if not is_call(node, LINEARS) or len(node.args) > 3 or not set(node.kwargs) <= set(names[len(node.args) :]):
        return None
    given = dict(zip(names, node.args)) | dict(node.kwargs)
    x, weight, bias = (given.get(name) for name in names)
    if not isinstance(x, Node) or not _is_input(weight) or not (bias is None or _is_input(bias)):
        return None
    return x, weight, bias


def _is_input(node: object) -> TypeGuard[Node]:
    return isinstance(node, Node) and node.op == "placeholder" and isinstance(value(node), torch.Tensor)


def _kind(weight: Node, bias: Node | None) -> tuple[object, ...] | None:
    """What the calls of one group share besides their input: a 2-D weight's input width, dtype, device and
    ``requires_grad`` (a frozen weight fused with trainable ones would get its gradient computed and
    dropped: LoRA's frozen base projections beside its trainable adapters) and the bias's presence and
    ``requires_grad``; None for a weight or bias of another shape or dtype."""
    w = value(weight)
    b = None if bias is None else value(bias)
    if w.dim() != 2 or (b is not None and (b.dim() != 1 or b.dtype != w.dtype or b.device != w.device)):
        return None
    return w.shape[1], w.dtype, w.device, w.requires_grad, None if b is None else b.requires_grad


def _fusable(group: list[Call]) -> bool:
    """Whether a group of one input and one kind is fused: two or more distinct weights, one of them with
    fewer outputs than inputs (see the module docstring)."""
    weights = [value(weight) for _, weight, _ in group]
    return (
        len(group) >= 2
        and len({weight for _, weight, _ in group}) == len(group)
        and min(w.shape[0] for w in weights) < weights[0].shape[1]
    )


def _fuse(graph: torch.fx.Graph, x: Node, group: list[Call]) -> bool:
    """One product over the concatenated weights before the group's first call; each call replaced by its
    columns of it. Undone (False) if a view the graph takes of a projection's output cannot be taken of its
    columns (``y.view(-1)`` of a slice whose rows are strided)."""
    calls = [call for call, _, _ in group]
    widths = [value(weight).shape[0] for _, weight, _ in group]
    with graph.inserting_before(calls[0]):
        weight = with_value(graph.call_function(torch.cat, ([weight for _, weight, _ in group],), {"dim": 0}))
        weight.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        bias = None
        if group[0][2] is not None:
            bias = with_value(graph.call_function(torch.cat, ([bias for _, _, bias in group],), {"dim": 0}))
        product = with_value(graph.call_function(torch._C._nn.linear, (x, weight, bias)))
        starts = itertools.accumulate([0, *widths[:-1]])
        columns = [
            with_value(graph.call_function(torch.narrow, (product, -1, start, width)))
            for start, width in zip(starts, widths, strict=True)
        ]
    if not all(_views_accept(call, value(part)) for call, part in zip(calls, columns, strict=True)):
        for node in [*columns, product, *([bias] if bias is not None else []), weight]:
            graph.erase_node(node)
        return False
    product.meta["stack_trace"] = calls[0].meta.get("stack_trace")
    for call, part in zip(calls, columns, strict=True):
        part.meta["stack_trace"] = call.meta.get("stack_trace")
        call.replace_all_uses_with(part)
        graph.erase_node(call)
    return True


VIEW_METHODS = ("view", "view_as", "transpose", "permute", "unsqueeze", "squeeze", "unflatten", "t", "expand", "narrow",
                "select", "split", "chunk", "unbind")  # fmt: skip
VIEW_FUNCTIONS = (torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.unflatten, torch.t,
                  torch.narrow, torch.select, torch.split, torch.chunk, torch.unbind, operator.getitem)  # fmt: skip
"""Calls whose result is a view of their first argument: a ``view`` after them sees its strides."""


def _views_accept(call: Node, columns: torch.Tensor) -> bool:
    """Whether every chain of views the graph takes of ``call``'s output can be taken of ``columns`` (a
    strided slice where the output was contiguous): each view re-run on fake tensors."""
    pending: list[tuple[Node, Any]] = [(call, columns)]
    while pending:
        node, source = pending.pop()
        for user in node.users:
            if not (is_call(user, VIEW_FUNCTIONS, VIEW_METHODS) and user.args and user.args[0] is node):
                continue
            rest, kwargs = torch.fx.node.map_arg((user.args[1:], user.kwargs), value)
            try:
                pending.append((user, run_on_values(user, (source, *rest), kwargs)))
            except (RuntimeError, ValueError):  # fake tensors refuse an impossible view with a ValueError
                return False
    return True

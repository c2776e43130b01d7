"""Returned linear outputs whose gradient is computed outside the compiled graph, and only when used
(``fastops.lazy_linear_outputs``).

A causal LM called with ``labels`` returns its logits next to the loss it computed from them. AOTAutograd
compiles the training step into one autograd node whose backward takes a gradient for each differentiable
output, and autograd's engine fills the gradients nobody gave with zeros: for the logits, ``N V`` zeros
(2.1 GB at Llama-3.2-1B, 4 × 2048 tokens, bf16) written before the backward runs, then read by the compiled
backward, which adds them to the loss's gradient of the logits (another ``N V`` write and two reads).
That is about 8 GB moved for nothing (a fill kernel and a pointwise add in the step's profile) and two
``N V`` buffers at the start of the backward: more GPU time and a higher peak than the step without them
(docs/benchmarks/train_llama-3.2-1b_4x2048_lazy_outputs.json). Stock ``torch.compile`` pays the same;
eager autograd does not (the logits are the loss's input, one tensor with one gradient).

For each graph output ``y = linear(x, W, b)`` that the graph also reads (the loss), with ``W`` (and ``b``)
graph inputs and more output features than input features, this pass returns ``y`` detached and ``x``
as an extra output, and the compiled function re-attaches ``y`` to autograd through
:class:`LinearOutput`: a node whose backward, if a gradient reaches ``y`` at all, computes ``dx = dy W``,
``dW = dy^T x`` and ``db`` (as autograd would, in ``y``'s dtype under autocast) and sends ``dx`` into
the compiled graph through ``x``. An unused ``y`` then costs zeros of ``x``'s size (``N H``, 32 MB at the
shape above) instead of ``y``'s; a used one gets the same gradient, summed in another order (its two
contributions to ``dx`` are two products instead of one product of their sum). The node keeps ``x``
alive as long as ``y`` is (32 MB there).

Left alone: outputs with no reader in the graph (their gradient is whatever the caller gives: nothing to
save), outputs returned twice or read by another output (an alias would have to be re-attached too),
narrowing projections (no bytes saved), graphs that compute no gradient, and graphs with nested inputs
(compiled autograd's), whose inputs do not line up with the graph's placeholders.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from inductor_ext.inductor.graph_queries import LINEARS, is_call, value, with_value


@dataclasses.dataclass(frozen=True)
class LazyOutput:
    """Where one lazy output's pieces are: ``y`` among the graph's outputs, the extra output holding
    ``x``, and ``W`` and ``b`` among the graph's inputs (``b`` None without a bias)."""

    output: int
    input: int
    weight: int
    bias: int | None


def lazy_linear_outputs(gm: GraphModule, example_inputs: Sequence[Any]) -> list[LazyOutput]:
    """Rewrite ``gm`` (a Dynamo graph) as the module docstring says; what :func:`with_lazy_outputs` needs."""
    if any(isinstance(x, (list, tuple, dict)) for x in example_inputs):
        return []
    graph = gm.graph
    output_node = graph.output_node()
    returned = output_node.args[0]
    if type(graph._codegen) is not torch.fx.graph.CodeGen or not isinstance(returned, (tuple, list)):
        return []
    outputs = list(returned)
    inputs = {node: i for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    lazy = []
    for i, y in enumerate(list(outputs)):
        parts = _linear_parts(y, inputs, output_node, outputs)
        if parts is None:
            continue
        x, weight, bias = parts
        with graph.inserting_after(y):
            detached = with_value(graph.call_method("detach", (y,)))
        outputs[i] = detached
        lazy.append(LazyOutput(i, len(outputs), inputs[weight], None if bias is None else inputs[bias]))
        outputs.append(x)
    if lazy:
        output_node.args = (type(returned)(outputs),)
        gm.recompile()
    return lazy


def _linear_parts(
    y: Any, inputs: dict[Node, int], output_node: Node, outputs: list[Any]
) -> tuple[Node, Node, Node | None] | None:
    """``(x, W, b)`` for an output ``y = linear(x, W, b)`` that the pass defers, else None."""
    if not is_call(y, LINEARS) or y.kwargs or len(y.args) not in (2, 3):
        return None
    x, weight, bias = (*y.args, None)[:3]
    result, w = value(y), value(weight)
    if (
        not isinstance(x, Node)
        or not isinstance(weight, Node)
        or weight not in inputs
        or not (bias is None or (isinstance(bias, Node) and bias in inputs))
        or not isinstance(result, torch.Tensor)
        or not result.requires_grad
        or not isinstance(w, torch.Tensor)
        or w.dim() != 2
        or w.shape[0] <= w.shape[1]  # a narrowing projection: its zeros would not be larger than x's
        or outputs.count(y) != 1
        or not any(user is not output_node for user in y.users)
        or any(isinstance(o, Node) and y in o.all_input_nodes for o in outputs)
    ):
        return None
    return x, weight, bias


def with_lazy_outputs(compiled: Callable[..., Any], lazy: Sequence[LazyOutput]) -> Callable[..., Any]:
    """``compiled`` (the rewritten graph, compiled) with each lazy output re-attached to autograd and the
    extra outputs dropped: the original graph's outputs. Dynamo calls a backend's function with the graph's
    inputs as positional arguments (``compile_fx``'s may carry ``_boxed_call`` from the function it wraps,
    yet takes them so too)."""
    if not lazy:
        return compiled
    first_extra = min(entry.input for entry in lazy)

    def run(*args: Any) -> list[Any]:
        results = list(compiled(*args))
        for entry in lazy:
            bias = None if entry.bias is None else args[entry.bias]
            y = Detached(results[entry.output])
            results[entry.output] = LinearOutput.apply(results[entry.input], args[entry.weight], bias, y)
        return results[:first_extra]

    return run


@dataclasses.dataclass(frozen=True)
class Detached:
    """``y`` handed to :class:`LinearOutput` out of autograd's sight: a tensor argument returned as it is
    would come back as a view, which autograd forbids modifying in place (HF's logits may be)."""

    tensor: torch.Tensor


class LinearOutput(torch.autograd.Function):
    """``y`` (computed as ``linear(x, W, b)`` inside a compiled graph, returned detached) as a differentiable
    function of ``x``, ``W`` and ``b``; a backward that only runs when ``y`` receives a gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: Detached) -> Any:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.tensor

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None) -> Any:
        if dy is None:
            return None, None, None, None
        x, weight = ctx.saved_tensors
        # under autocast the graph ran linear(x.to(dy.dtype), W.to(dy.dtype)): the casts' backward casts back
        dx = (dy @ weight.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        rows = dy.reshape(-1, dy.shape[-1])
        dw = (rows.T @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = rows.sum(0).to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None

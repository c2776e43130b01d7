"""Causal-mask rewrite: SDPA calls whose ``attn_mask`` is a materialised causal mask run with ``is_causal=True``.

Under Dynamo on CUDA (torch < 2.14) and under ``torch.export``, transformers builds the
causal mask as a tensor (``kv_idx <= q_idx`` over ``arange``s, expanded to
``(B, 1, L, S)``) and calls ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
is_causal=False)`` on key/value heads repeated to the query heads (``repeat_kv``); eager
HF calls it with ``attn_mask=None, is_causal=True, enable_gqa=True``. With a mask, SDPA
cannot use the flash kernel's causal tile skipping and reads the mask: a training step's attention
takes about 2.5 times as long as with ``is_causal=True``
(docs/benchmarks/train_llama-3.2-1b_4x2048_mask.json).

The rewrite proves the mask causal before it touches the call:

1. **Data independence.** Every tensor the mask is computed from must come from
   sizes, ``arange``, constants and comparisons: no graph input's *values* (a padding
   mask, position ids, a mask the user passes) and no random op. Reading an input's
   shape, dtype or device is fine. With ``assume_no_padding`` (the backend's
   ``fastops.assume_no_padding``), 2-D integer or boolean graph inputs (HF's
   ``attention_mask``) may be read: they are taken to be all ones, and a device-side
   assertion checks it at run time (no host sync).
2. **Equality, evaluated.** The mask's subgraph runs at compile time on the traced sizes
   and must equal ``ones(L, S).tril()`` (SDPA's ``is_causal``, top-left aligned) for
   every batch and head it broadcasts to; a float mask must be 0 where allowed and
   ``-inf`` or the dtype's lowest value elsewhere. With dynamic shapes it must also hold
   at two other sizes: each size symbol + 1, and each symbol past the largest integer
   constant in the subgraph (so a sliding window wider than the traced sequence is
   not mistaken for a causal mask).

Then the call becomes ``attn_mask=None, is_causal=True``, and key/value inputs that are
``repeat_kv`` copies (``x[:, :, None].expand(B, H, n, S, D).reshape(B, H*n, S, D)``) are
replaced by ``x`` with ``enable_gqa=True``, as eager HF calls SDPA. Anything that fails a
check is left exactly as it is. The graph may be Dynamo's (torch functions and methods)
or ``torch.export``'s (aten ops); the rewrite is valid for training, inference and
export alike.
"""

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from inductor_ext.inductor.graph_queries import ancestors, eliminate_dead_code, is_metadata_read, is_random, value
from inductor_ext.inductor.sdpa_masks import (
    SDPA_PARAMS,
    NotCausal,
    allowed_positions,
    check_no_side_effects,
    concrete,
    evaluate,
    masked_sdpa_calls,
    size_assignments,
    ungroup_repeated_kv,
)

aten = torch.ops.aten


@dataclasses.dataclass
class MaskRewrites:
    """What :func:`rewrite_causal_masks` did: calls rewritten, and why the others were kept."""

    rewritten: int = 0
    ungrouped: int = 0
    """Rewritten calls whose ``repeat_kv`` key/value copies were replaced by ``enable_gqa=True``."""
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    """SDPA node name -> why its mask was left unchanged."""
    assumed_no_padding: tuple[str, ...] = ()
    """Graph inputs taken to be all ones (``assume_no_padding``), each checked on the device."""


def rewrite_causal_masks(gm: GraphModule, *, assume_no_padding: bool = False) -> MaskRewrites:
    """Rewrite, in place, each SDPA call of ``gm`` whose mask is provably causal (module docstring)."""
    result = MaskRewrites()
    assumed: dict[Node, None] = {}
    calls = masked_sdpa_calls(
        gm,
        key=lambda args: (args["attn_mask"], str(value(args["query"]).shape[-2]), str(value(args["key"]).shape[-2])),
        prove=lambda node, args: _prove_causal(gm, node, args, assume_no_padding),
    )
    for node, args, padding in calls:
        if isinstance(padding, NotCausal):
            result.kept[node.name] = str(padding)
            continue
        assumed.update(dict.fromkeys(padding))
        args["attn_mask"], args["is_causal"] = None, True
        ungrouped = ungroup_repeated_kv(args)
        result.rewritten += 1
        result.ungrouped += ungrouped
        node.args, node.kwargs = (
            (args["query"], args["key"], args["value"]),
            {k: args[k] for k in SDPA_PARAMS[3:] if k in args},
        )
    for padding_input in assumed:
        _assert_all_ones(gm.graph, padding_input)
    if result.rewritten:
        eliminate_dead_code(gm.graph)
        gm.recompile()
        counters["inductor_ext"]["rewrite_causal_mask"] += result.rewritten
    result.assumed_no_padding = tuple(n.name for n in assumed)
    return result


# ------------------------------------------------------------------- the proof


def _prove_causal(gm: GraphModule, sdpa: Node, args: Mapping[str, Any], assume_no_padding: bool) -> list[Node]:
    """Raise :class:`NotCausal` unless the mask equals SDPA's causal mask; returns the inputs assumed all ones."""
    mask = args["attn_mask"]
    if not isinstance(mask, Node):
        raise NotCausal("the mask is not computed in the graph")
    nodes = ancestors(mask)
    padding = _check_data_independent(nodes, assume_no_padding)
    check_no_side_effects(nodes, sdpa)
    assignments = size_assignments(nodes, args)
    for values in assignments:
        actual = evaluate(gm, nodes, mask, values, padding)
        length_q, length_k = (
            concrete(value(args["query"]).shape[-2], values),
            concrete(value(args["key"]).shape[-2], values),
        )
        if not _equals_causal(actual, length_q, length_k):
            sizes = ", ".join(f"{s}={v}" for s, v in values.items()) or "the traced sizes"
            raise NotCausal(f"the mask is not the causal mask at {sizes}")
    return padding


def _check_data_independent(nodes: list[Node], assume_no_padding: bool) -> list[Node]:
    """Raise unless no node reads an input's values; returns the inputs assumed all ones."""
    reads_values: set[Node] = set()
    padding: list[Node] = []
    for node in nodes:
        if node.op == "placeholder":
            traced = value(node)
            if isinstance(traced, torch.Tensor):
                if assume_no_padding and _is_padding_mask(traced):
                    padding.append(node)
                else:
                    reads_values.add(node)
        elif node.op == "get_attr":
            reads_values.add(node)
        elif node.op in ("call_function", "call_method"):
            if is_random(node):
                raise NotCausal(f"the mask uses a random op ({node.name})")
            if not is_metadata_read(node) and any(n in reads_values for n in node.all_input_nodes):
                reads_values.add(node)
        else:
            raise NotCausal(f"the mask's subgraph has a {node.op} node ({node.name})")
    if nodes[-1] in reads_values:
        sources = sorted(n.name for n in reads_values if n.op in ("placeholder", "get_attr"))
        raise NotCausal(f"the mask reads the values of {', '.join(sources)}")
    return padding


def _is_padding_mask(value: torch.Tensor) -> bool:
    """A 2-D integer or boolean input: HF's ``attention_mask`` (batch, key positions)."""
    return value.dim() == 2 and (
        value.dtype == torch.bool or not (value.dtype.is_floating_point or value.dtype.is_complex)
    )


def _equals_causal(mask: torch.Tensor, length_q: int, length_k: int) -> bool:
    if mask.dim() < 2 or mask.shape[-2] not in (1, length_q) or mask.shape[-1] not in (1, length_k):
        return False
    allowed = allowed_positions(mask)
    if allowed is None:
        return False
    causal = torch.ones(length_q, length_k, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


# --------------------------------------------------------------- the new call


def _assert_all_ones(graph: Graph, padding_input: Node) -> None:
    """Check on the device, with no host sync, that an input assumed to hold no padding is all ones."""
    exported = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) for n in graph.nodes)
    with graph.inserting_after(padding_input):
        if exported:
            nonzero = graph.call_function(aten.ne.Scalar, (padding_input, 0))
            with graph.inserting_after(nonzero):
                every = graph.call_function(aten.all.default, (nonzero,))
            with graph.inserting_after(every):
                graph.call_function(aten._assert_async.msg, (every, _NO_PADDING_MESSAGE))
        else:
            nonzero = graph.call_function(operator.ne, (padding_input, 0))
            with graph.inserting_after(nonzero):
                every = graph.call_function(torch.all, (nonzero,))
            with graph.inserting_after(every):
                graph.call_function(torch._assert_async, (every, _NO_PADDING_MESSAGE))


_NO_PADDING_MESSAGE = (
    "fastops_inductor: fastops.assume_no_padding was set, but the attention_mask holds padding (a zero): "
    "compile without that option"
)

"""Document-mask rewrite: SDPA calls whose mask is transformers' packed-document mask run block-sparse.

With packed rows (documents concatenated, ``position_ids`` restarting per document) and no KV
cache, transformers builds the ``document_causal`` mask from ``position_ids``
(:mod:`inductor_ext.ops.document_attention` states it) and SDPA computes all ``S x S`` pairs under
it. The mask reads a user tensor's values, so :mod:`.causal_mask` rightly keeps it. This rewrite
proves the mask is ``document_causal`` of that input, then calls
:func:`~inductor_ext.ops.document_attention.document_causal_attention` instead (FlexAttention on a
block mask built from the positions: cross-document blocks are skipped).

The proof, in the causal rewrite's manner:

1. **One input.** The mask's values come from exactly one graph input, a ``(B, S)`` integer tensor
   (the query's batch and length; key length equal), besides sizes, ``arange``, constants and
   comparisons; no random op, nothing mutated from outside.
2. **Equality, evaluated.** The mask's subgraph runs at compile time on sample position ids — random
   packings (documents of length 1 up to the row), one document, an offset start, every token its own
   document, constant and arbitrary values — at the traced sizes (and, with dynamic shapes, at the
   causal rewrite's two other sizes) and must equal ``document_causal`` of each sample for every batch
   row and head it broadcasts to (boolean, or 0/``-inf`` float).

Anything else (a padding mask, a sliding window, a user's mask, a mask over two inputs, dropout) is
left exactly as it is. The graph may be Dynamo's or ``torch.export``'s.
"""

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx import GraphModule, Node

from inductor_ext.inductor.graph_queries import ancestors, eliminate_dead_code, is_metadata_read, is_random, value
from inductor_ext.inductor.sdpa_masks import (
    NotCausal,
    allowed_positions,
    check_no_side_effects,
    concrete,
    evaluate,
    masked_sdpa_calls,
    size_assignments,
    ungroup_repeated_kv,
)
from inductor_ext.ops.document_attention import document_causal_attention, document_causal_mask_ref

SAMPLES_PER_SIZE = 12
"""Sample position-id tensors the mask is evaluated on at each size assignment."""


@dataclasses.dataclass
class DocumentMaskRewrites:
    """What :func:`rewrite_document_masks` did: calls rewritten, and why the masked others were kept."""

    rewritten: int = 0
    kept: dict[str, str] = dataclasses.field(default_factory=dict)
    """SDPA node name -> why its mask was left unchanged."""


def rewrite_document_masks(gm: GraphModule) -> DocumentMaskRewrites:
    """Rewrite, in place, each SDPA call of ``gm`` whose mask is provably ``document_causal`` (module docstring)."""
    result = DocumentMaskRewrites()
    calls = masked_sdpa_calls(
        gm,
        key=lambda args: (args["attn_mask"], str(value(args["query"]).shape[-2])),
        prove=lambda node, args: _prove_document_causal(gm, node, args),
    )
    for node, args, positions in calls:
        if isinstance(positions, NotCausal):
            result.kept[node.name] = str(positions)
            continue
        ungroup_repeated_kv(args)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(
                document_causal_attention,
                (args["query"], args["key"], args["value"], positions),
                {"scale": args.get("scale"), "enable_gqa": bool(args.get("enable_gqa", False))},
            )
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        result.rewritten += 1
    if result.rewritten:
        eliminate_dead_code(gm.graph)
        gm.recompile()
        counters["inductor_ext"]["rewrite_document_mask"] += result.rewritten
    return result


def _prove_document_causal(gm: GraphModule, sdpa: Node, args: Mapping[str, Any]) -> Node:
    """Raise :class:`NotCausal` unless the mask is ``document_causal`` of one input; returns that input."""
    mask = args["attn_mask"]
    if not isinstance(mask, Node):
        raise NotCausal("the mask is not computed in the graph")
    dropout = args.get("dropout_p")
    if isinstance(dropout, Node) or dropout not in (None, 0, 0.0):
        raise NotCausal(f"dropout_p is not the constant 0 ({dropout})")
    if isinstance(args.get("scale"), Node):
        raise NotCausal("the scale is not a constant")
    query, key = value(args["query"]), value(args["key"])
    nodes = ancestors(mask)
    positions = _position_input(nodes)
    traced = value(positions)
    if str(query.shape[-2]) != str(key.shape[-2]):
        raise NotCausal("query and key lengths differ (a KV cache)")
    if traced.dim() != 2 or [str(s) for s in traced.shape] != [str(query.shape[0]), str(query.shape[-2])]:
        raise NotCausal(f"{positions.name} is not (batch, query length)")
    check_no_side_effects(nodes, sdpa)
    for values in size_assignments(nodes, args):
        batch, length = (concrete(s, values) for s in traced.shape)
        for number, sample in enumerate(_sample_positions(batch, length, traced.dtype, traced.device)):
            actual = evaluate(gm, nodes, mask, values, [], {positions: sample})
            if not _equals_document_causal(actual, sample):
                raise NotCausal(
                    f"the mask is not document_causal({positions.name}) on sample {number} at {batch}x{length}"
                )
    return positions


def _position_input(nodes: list[Node]) -> Node:
    """The one graph input whose values the mask reads: a 2-D integer tensor."""
    sources: dict[Node, set[Node]] = {}
    """node -> the graph inputs whose values it depends on."""
    for node in nodes:
        if node.op == "placeholder":
            sources[node] = {node} if isinstance(value(node), torch.Tensor) else set()
        elif node.op == "get_attr":
            raise NotCausal(f"the mask reads a module attribute ({node.name})")
        elif node.op in ("call_function", "call_method"):
            if is_random(node):
                raise NotCausal(f"the mask uses a random op ({node.name})")
            reads = set() if is_metadata_read(node) else set().union(*(sources[n] for n in node.all_input_nodes))
            sources[node] = reads
        else:
            raise NotCausal(f"the mask's subgraph has a {node.op} node ({node.name})")
    read = sorted(sources[nodes[-1]], key=lambda n: n.name)
    if len(read) != 1:
        names = ", ".join(n.name for n in read) or "no input"
        raise NotCausal(f"the mask reads the values of {names}, not of one position input")
    dtype = value(read[0]).dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise NotCausal(f"{read[0].name} does not hold integers")
    return read[0]


def _sample_positions(batch: int, length: int, dtype: torch.dtype, device: torch.device) -> Iterator[torch.Tensor]:
    """Position ids the mask is checked on: packings and adversarial spellings (module docstring)."""
    generator = torch.Generator().manual_seed(length * 7919 + batch)
    arange = torch.arange(length)
    fixed = [arange, arange + 3, torch.zeros(length, dtype=torch.long), torch.full((length,), 5), arange.flip(0)]
    for number in range(SAMPLES_PER_SIZE):
        rows = []
        for row in range(batch):
            if number < len(fixed) and row == 0:
                rows.append(fixed[number])
            elif number % 3 == 2:
                rows.append(torch.randint(0, 4, (length,), generator=generator))
            else:
                rows.append(_random_packing(length, generator, offset=number % 2 == 1))
        yield torch.stack(rows).to(dtype=dtype, device=device)


def _random_packing(length: int, generator: torch.Generator, *, offset: bool) -> torch.Tensor:
    longest = max(1, length // int(torch.randint(1, 5, (1,), generator=generator)))
    pieces, total = [], 0
    while total < length:
        size = min(int(torch.randint(1, longest + 1, (1,), generator=generator)), length - total)
        start = int(torch.randint(0, 4, (1,), generator=generator)) if offset else 0
        pieces.append(torch.arange(start, start + size))
        total += size
    return torch.cat(pieces)


def _equals_document_causal(mask: torch.Tensor, positions: torch.Tensor) -> bool:
    batch, length = positions.shape
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[-2:]) != (length, length):
        return False
    allowed = allowed_positions(mask)
    if allowed is None:
        return False
    expected = document_causal_mask_ref(positions.to(mask.device))
    return bool((allowed == expected).all())

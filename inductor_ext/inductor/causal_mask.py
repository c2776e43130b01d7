"""Causal-mask rewrite: SDPA calls whose ``attn_mask`` is a materialised causal mask run with ``is_causal=True``.

Under Dynamo on CUDA (torch < 2.14) and under ``torch.export``, transformers builds the
causal mask as a tensor (``kv_idx <= q_idx`` over ``arange``s, expanded to
``(B, 1, L, S)``) and calls ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
is_causal=False)`` on key/value heads repeated to the query heads (``repeat_kv``); eager
HF calls it with ``attn_mask=None, is_causal=True, enable_gqa=True``. With a mask, SDPA
cannot use the flash kernel's causal tile skipping and reads the mask: on the H200 the
same cuDNN kernel took 2.7x as long at Llama-3.2-1B's shape, 4 x 2048 tokens.

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
from collections.abc import Iterable, Mapping
from typing import Any

import sympy
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from inductor_ext.inductor.graph_queries import (
    ancestors,
    eliminate_dead_code,
    is_call,
    is_metadata_read,
    is_random,
    mutates,
    value,
)

aten = torch.ops.aten

SDPA_TARGETS = (
    F.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
    aten.scaled_dot_product_attention.default,
)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""``scaled_dot_product_attention``'s parameters, in order (the same in torch and aten)."""

MAX_EVALUATED_ELEMENTS = 1 << 28
"""The largest mask (elements) evaluated at compile time; a larger one is left unchanged."""


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
    proofs: dict[tuple[Node, str, str], list[Node] | NotCausal] = {}
    """One proof per mask and query/key lengths: a model's layers share one mask."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        args = sdpa_arguments(node)
        if args is None or args["attn_mask"] is None or args["is_causal"] is not False:
            continue
        key = (args["attn_mask"], str(value(args["query"]).shape[-2]), str(value(args["key"]).shape[-2]))
        if key not in proofs:
            try:
                proofs[key] = _prove_causal(gm, node, args, assume_no_padding)
            except NotCausal as reason:
                proofs[key] = reason
        padding = proofs[key]
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


class NotCausal(Exception):
    """The mask could not be proven causal; the message says why."""


def sdpa_arguments(node: Node) -> dict[str, Any] | None:
    """An SDPA call's arguments by parameter name (``attn_mask`` and ``is_causal`` defaulted); None for
    arguments it does not take."""
    if len(node.args) > len(SDPA_PARAMS) or any(k not in SDPA_PARAMS for k in node.kwargs):
        return None
    args = dict(zip(SDPA_PARAMS, node.args))
    args.update(node.kwargs)
    args.setdefault("attn_mask", None)
    args.setdefault("is_causal", False)
    return args


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


def check_no_side_effects(nodes: list[Node], sdpa: Node) -> None:
    """Raise if the subgraph's values may be changed in place by a node outside it."""
    inside = set(nodes) | {sdpa}
    for node in nodes:
        for user in node.users:
            if user not in inside and mutates(user):
                raise NotCausal(f"{user.name} mutates {node.name}")
        if mutates(node) and any(u not in inside for u in node.all_input_nodes):
            raise NotCausal(f"{node.name} mutates a tensor used outside the mask")


# ------------------------------------------------------- evaluation at the sizes


def _symbols(value: Any) -> Iterable[torch.SymInt]:
    """The symbolic sizes of a traced value (a SymInt, or a tensor's shape)."""
    if isinstance(value, torch.SymInt):
        yield value
    elif isinstance(value, torch.Tensor):
        for size in value.shape:
            if isinstance(size, torch.SymInt):
                yield size


def size_assignments(nodes: list[Node], args: Mapping[str, Any]) -> list[dict[sympy.Symbol, int]]:
    """Values for the size symbols the mask depends on: the traced ones, then two others (dynamic shapes)."""
    hints: dict[sympy.Symbol, int] = {}
    sources = [value(n) for n in nodes if n.op == "placeholder" or is_metadata_read(n)]
    sources += [value(args["query"]), value(args["key"])]
    for symint in (s for v in sources for s in _symbols(v)):
        expr = symint.node.expr
        for symbol in expr.free_symbols:
            hint = _traced_values(symint.node.shape_env).get(symbol)
            if hint is None:
                raise NotCausal(f"size {symbol} has no traced value")
            hints[symbol] = int(hint)
    if not hints:
        return [{}]
    constants = [abs(a) for n in nodes for a in _flat_args(n) if isinstance(a, int) and not isinstance(a, bool)]
    beyond = max(constants + list(hints.values())) + 1
    return [hints, {s: v + 1 for s, v in hints.items()}, {s: v + beyond for s, v in hints.items()}]


def _traced_values(shape_env: Any) -> Mapping[sympy.Symbol, Any]:
    """The shape environment's backed size values (``backed_var_to_val`` from torch 2.13, ``var_to_val`` before)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return values if values is not None else shape_env.var_to_val


def _flat_args(node: Node) -> list[Any]:
    flat: list[Any] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), flat.append)
    return flat


def concrete(size: Any, values: Mapping[sympy.Symbol, int]) -> int:
    """A traced size (an int, or a SymInt of the size symbols) at the given symbol values."""
    if isinstance(size, torch.SymInt):
        return int(size.node.expr.xreplace({s: sympy.Integer(v) for s, v in values.items()}))
    return int(size)


def evaluate(
    gm: GraphModule,
    nodes: list[Node],
    mask: Node,
    values: Mapping[sympy.Symbol, int],
    padding: list[Node],
    samples: Mapping[Node, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the mask's subgraph on inputs built from the sizes alone (``samples``: given values for some inputs)."""
    graph = Graph()
    env: dict[Node, Node] = {}
    inputs: list[Any] = []
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            given = samples.get(node) if samples else None
            inputs.append(given if given is not None else _input_at(value(node), values, ones=node in padding))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[mask])
    elements = 1
    mask_value = value(mask)
    if isinstance(mask_value, torch.Tensor):
        for size in mask_value.shape:
            elements *= concrete(size, values)
    if elements > MAX_EVALUATED_ELEMENTS:
        raise NotCausal(f"the mask has {elements} elements, too many to evaluate at compile time")
    try:
        with torch.no_grad(), torch._subclasses.fake_tensor.unset_fake_temporarily():
            result = GraphModule(gm, graph)(*inputs)
    except Exception as error:  # any failure to evaluate means "not proven"
        raise NotCausal(f"the mask's subgraph failed to evaluate ({type(error).__name__}: {error})") from error
    if not isinstance(result, torch.Tensor):
        raise NotCausal("the mask is not a tensor")
    return result


def _input_at(value: Any, values: Mapping[sympy.Symbol, int], *, ones: bool) -> Any:
    if isinstance(value, torch.SymInt):
        return concrete(value, values)
    if isinstance(value, torch.Tensor):
        shape = [concrete(d, values) for d in value.shape]
        make = torch.ones if ones else torch.empty
        return make(shape, dtype=value.dtype, device=value.device)
    return value


def allowed_positions(mask: torch.Tensor) -> torch.Tensor | None:
    """Where an SDPA mask lets a query attend: a boolean mask itself, a float mask's zeros (None if a
    float mask holds anything but 0 and ``-inf``/the dtype's lowest value, or the dtype is neither)."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        return None
    blocked = mask <= torch.finfo(mask.dtype).min
    return ~blocked if bool(((mask == 0) | blocked).all()) else None


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


def ungroup_repeated_kv(args: dict[str, Any]) -> bool:
    """Replace ``repeat_kv`` copies of key and value by the grouped tensors, with ``enable_gqa=True``."""
    if args.get("enable_gqa"):
        return False
    key, val = _repeat_kv_source(args["key"]), _repeat_kv_source(args["value"])
    if key is None or val is None or key[1] != val[1]:
        return False
    args["key"], args["value"], args["enable_gqa"] = key[0], val[0], True
    return True


def _repeat_kv_source(node: Any) -> tuple[Node, int] | None:
    """``(x, n)`` for ``x[:, :, None].expand(B, H, n, S, D).reshape(B, H*n, S, D)`` (or unsqueeze, or aten)."""
    reshapes = (torch.reshape, aten.reshape.default, aten.view.default, aten._unsafe_view.default)
    if not is_call(node, reshapes, ("reshape", "view")):
        return None
    expand = node.args[0]
    if is_call(expand, (aten.clone.default,)):
        expand = expand.args[0]
    if not is_call(expand, (aten.expand.default,), ("expand",)):
        return None
    inserted = expand.args[0]
    source: Any = None
    if (
        is_call(inserted, (torch.unsqueeze, aten.unsqueeze.default), ("unsqueeze",))
        and tuple(inserted.args[1:]) == (2,)
        or is_call(inserted, (operator.getitem,))
        and _is_none_at_2(inserted.args[1])
    ):
        source = inserted.args[0]
    grouped, repeated, expanded = value(source), value(node), value(expand)
    if not all(isinstance(v, torch.Tensor) for v in (grouped, repeated, expanded)) or grouped.dim() != 4:
        return None
    batch, heads, length, dim = grouped.shape
    n_rep = expanded.shape[2]
    if tuple(expanded.shape) != (batch, heads, n_rep, length, dim) or tuple(repeated.shape) != (
        batch,
        heads * n_rep,
        length,
        dim,
    ):
        return None
    return source, n_rep


def _is_none_at_2(index: Any) -> bool:
    full = slice(None, None, None)
    return (
        isinstance(index, tuple)
        and len(index) == 5
        and index[2] is None
        and all(i == full for i in index[:2] + index[3:])
    )

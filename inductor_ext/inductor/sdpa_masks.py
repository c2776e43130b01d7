"""What both mask passes (:mod:`.causal_mask`, :mod:`.document_mask`) share: finding SDPA calls with a
materialised mask, one proof per mask, and the proof's tools: the mask's subgraph checked for side
effects and evaluated at compile time at the traced sizes (and, with dynamic shapes, at two others),
and ``repeat_kv`` copies of key and value replaced by ``enable_gqa=True``.
"""

import operator
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import sympy
import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from inductor_ext.inductor.graph_queries import is_call, is_metadata_read, mutates, value

aten = torch.ops.aten
Proof = TypeVar("Proof")

SDPA_TARGETS = (
    F.scaled_dot_product_attention,
    torch._C._nn.scaled_dot_product_attention,
    aten.scaled_dot_product_attention.default,
)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""``scaled_dot_product_attention``'s parameters, in order (the same in torch and aten)."""

MAX_EVALUATED_ELEMENTS = 1 << 28
"""The largest mask (elements) evaluated at compile time; a larger one is left unchanged."""


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


def masked_sdpa_calls(
    gm: GraphModule, key: Callable[[dict[str, Any]], Hashable], prove: Callable[[Node, dict[str, Any]], Proof]
) -> Iterator[tuple[Node, dict[str, Any], "Proof | NotCausal"]]:
    """Each SDPA call of ``gm`` with a mask and ``is_causal=False``: ``(node, its arguments, what
    ``prove(node, arguments)`` returned, or the :class:`NotCausal` it raised)``. One proof per ``key`` of the
    arguments: a model's layers share one mask. The calls are listed before the first is yielded, so the
    caller may replace each one."""
    proofs: dict[Hashable, Any] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS:
            continue
        args = sdpa_arguments(node)
        if args is None or args["attn_mask"] is None or args["is_causal"] is not False:
            continue
        proof_key = key(args)
        if proof_key not in proofs:
            try:
                proofs[proof_key] = prove(node, args)
            except NotCausal as reason:
                proofs[proof_key] = reason
        yield node, args, proofs[proof_key]


def check_no_side_effects(nodes: list[Node], sdpa: Node) -> None:
    """Raise if the subgraph's values may be changed in place by a node outside it."""
    inside = set(nodes) | {sdpa}
    for node in nodes:
        for user in node.users:
            if user not in inside and mutates(user):
                raise NotCausal(f"{user.name} mutates {node.name}")
        if mutates(node) and any(u not in inside for u in node.all_input_nodes):
            raise NotCausal(f"{node.name} mutates a tensor used outside the mask")


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

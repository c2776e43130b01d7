"""Public helpers for reading (and annotating) FX graphs, shared by the backend's rewrites.

The graphs are Dynamo's (torch functions and ``call_method`` nodes, ``example_value`` metadata) or
``torch.export``'s (aten ops, ``val`` metadata). Every query is structural and answers ``None`` or
``False`` for anything it does not recognise, so a rewrite built on them stays conservative.
Where torch offers an identity (a function object, an op overload, an op's tags) the queries
compare identities; a ``call_method`` node's target is a method *name*, so method checks compare
names (no object exists to compare).
"""

import operator
from collections.abc import Callable
from typing import Any, TypeGuard, cast

import torch
import torch.nn.functional as F
from torch.fx import Node

aten = torch.ops.aten

MUL = (operator.mul, torch.mul)
"""The functions a Dynamo graph multiplies with (the method is ``"mul"``)."""
ADD = (operator.add, torch.add)
"""The functions a Dynamo graph adds with (the method is ``"add"``)."""
LINEARS = (torch._C._nn.linear, F.linear)
"""The functions a Dynamo graph calls for ``nn.Linear`` (``torch._C._nn.linear``) and ``F.linear``."""


def value(node: Any) -> Any:
    """The example value Dynamo recorded for a node (a fake tensor; ``val`` in a ``torch.export``
    graph), or the constant itself."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else node


def with_value(node: Node, key: str = "example_value") -> Node:
    """Record the node's example value by running it on the inputs' fake tensors: under ``key``, Dynamo's
    ``"example_value"`` by default, ``"val"`` in an AOTAutograd or Inductor (post-grad) graph."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
    node.meta[key] = run_on_values(node, args, kwargs)
    return node


def run_on_values(node: Node, args: Any, kwargs: Any) -> Any:
    """``node``'s function or method called on ``args`` and ``kwargs`` (fake tensors, or the values in their
    place), under the fake mode of the first fake tensor among them."""
    fake_mode = next(a.fake_mode for a in torch.utils._pytree.tree_leaves(args) if hasattr(a, "fake_mode"))
    with fake_mode:
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return cast(Callable[..., Any], node.target)(*args, **kwargs)


def is_call(node: Any, functions: tuple[Any, ...] = (), methods: tuple[str, ...] = ()) -> TypeGuard[Node]:
    """Whether ``node`` calls one of ``functions`` (by identity) or one of the tensor ``methods`` (by name)."""
    if not isinstance(node, Node):
        return False
    return (node.op == "call_function" and node.target in functions) or (
        node.op == "call_method" and node.target in methods
    )


def binary_operands(node: Any, functions: tuple[Any, ...], method: str) -> tuple[Any, Any] | None:
    """``(a, b)`` for ``f(a, b)`` with ``f`` in ``functions``, or ``a.method(b)``; None otherwise (or with kwargs)."""
    if is_call(node, functions, (method,)) and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


def dtype_cast(node: Any) -> tuple[Any, torch.dtype] | None:
    """``t.to(dtype)``, ``t.float()``, ``t.type(dtype)``, ``t.type_as(ref)`` -> (t, dtype)."""
    if not isinstance(node, Node) or node.op != "call_method" or not node.args:
        return None
    result = value(node)
    if not isinstance(result, torch.Tensor):
        return None
    if node.target == "float" and len(node.args) == 1:
        return node.args[0], torch.float32
    if node.target in ("to", "type", "type_as") and len(node.args) == 2 and not node.kwargs:
        target = node.args[1]
        if isinstance(target, torch.dtype) or node.target == "type_as":
            return node.args[0], result.dtype
    dtype = node.kwargs.get("dtype")
    if node.target == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"} and isinstance(dtype, torch.dtype):
        return node.args[0], dtype
    return None


def upcast_source(node: Any) -> Any:
    """``x`` for ``x.to(float32)``/``x.float()``, or ``node`` itself when it is fp32 already (else None)."""
    upcast = dtype_cast(node)
    if upcast is not None and upcast[1] == torch.float32:
        return upcast[0]
    result = value(node)
    if isinstance(node, Node) and isinstance(result, torch.Tensor) and result.dtype == torch.float32:
        return node
    return None


def is_last_dim(dim: Any, ndim: int) -> bool:
    """Whether ``dim`` (an int, or a one-element list or tuple) names the last of ``ndim`` dims."""
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and is_last_dim(dim[0], ndim)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def any_between(first: Node, last: Node, nodes: set[Node]) -> bool:
    """Whether one of ``nodes`` stands strictly between ``first`` and ``last`` (``first`` before ``last``)
    in the graph: a walk back from ``last``, not an index of the whole graph."""
    current = last.prev
    while current is not first:
        if current in nodes:
            return True
        current = current.prev
    return False


def ancestors(output: Node) -> list[Node]:
    """Every node ``output`` depends on, in graph order, ``output`` last."""
    seen: dict[Node, None] = {}
    stack = [output]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        stack.extend(node.all_input_nodes)
    order = {node: i for i, node in enumerate(output.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


# Method and attribute names: a call_method node's target and getattr's argument are strings.
_METADATA_METHODS = frozenset({"size", "dim", "numel", "stride", "get_device", "is_contiguous"})
_METADATA_FUNCTIONS = frozenset({aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten.dim.default})
_METADATA_ATTRS = frozenset({"shape", "device", "dtype", "ndim", "is_cuda"})


def is_metadata_read(node: Node) -> bool:
    """A node that reads only a tensor's shape, dtype or device (not its values)."""
    if node.op == "call_method":
        return node.target in _METADATA_METHODS
    if node.op == "call_function":
        if node.target in _METADATA_FUNCTIONS:
            return True
        return node.target is getattr and len(node.args) == 2 and node.args[1] in _METADATA_ATTRS
    return False


_RANDOM_FUNCTION_NAMES = (
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "bernoulli",
    "normal",
    "poisson",
    "multinomial",
    "dropout",
    "alpha_dropout",
    "feature_dropout",
    "feature_alpha_dropout",
    "rrelu",
    "rrelu_",
    "native_dropout",
)
_RANDOM_FUNCTIONAL_NAMES = (
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "feature_alpha_dropout",
    "rrelu",
    "rrelu_",
    "gumbel_softmax",
)
RANDOM_FUNCTIONS: frozenset[Any] = frozenset(
    [getattr(torch, name) for name in _RANDOM_FUNCTION_NAMES if hasattr(torch, name)]
    + [getattr(F, name) for name in _RANDOM_FUNCTIONAL_NAMES if hasattr(F, name)]
)
"""The torch-level functions (Dynamo graph targets) that draw random numbers, as objects: these carry no
tags (aten ops do: :func:`is_random` reads ``torch.Tag.nondeterministic_seeded`` for those)."""

RANDOM_METHODS = frozenset(
    {
        "bernoulli",
        "bernoulli_",
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "multinomial",
    }
)
"""Tensor methods that draw random numbers. Names: a ``call_method`` node's target is the method's name,
not an object torch could compare by identity."""


def is_random(node: Node) -> bool:
    """Whether ``node`` draws random numbers: an aten op tagged ``nondeterministic_seeded`` (``torch.export``
    graphs), one of :data:`RANDOM_FUNCTIONS` or :data:`RANDOM_METHODS` (Dynamo graphs)."""
    target = node.target
    if node.op == "call_method":
        return target in RANDOM_METHODS
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(torch.Tag.nondeterministic_seeded in getattr(target, name).tags for name in target.overloads())
    return target in RANDOM_FUNCTIONS


def mutates(node: Node) -> bool:
    """Whether ``node`` may write into one of its inputs: ``setitem``, an aten op whose schema is mutable,
    an ``out=`` call, or an in-place spelling (``x.add_(y)``, ``torch.relu_``)."""
    if node.target in (operator.setitem, "__setitem__"):
        return True
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is not None:
            return bool(schema.is_mutable)
        # torch-level functions carry no schema: torch marks their in-place variants by the trailing
        # underscore of the name alone
        name = str(getattr(node.target, "__name__", ""))
    else:
        return False
    return (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs


def eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """Erase the nodes whose results nothing uses, except those that have effects: FX's own impure
    nodes and every node that :func:`mutates` an input. FX's default treats ``call_method`` nodes as pure,
    so it would erase ``cache.index_copy_(...)`` (a static KV cache's update, whose result is unused)."""
    graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure() or mutates(node))

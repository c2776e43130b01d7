"""Post-grad pass: a sum of matrix products becomes one call of ``fastops::sum_of_products``.

A tensor that feeds several linear layers gets, in the backward, the sum of their input gradients:
``dx = dq @ Wq + dk @ Wk + dv @ Wv`` for grouped-query attention's q/k/v, ``dgate @ Wg + dup @ Wu``
for the MLP. Inductor computes each product into a buffer of its own and adds them in a pointwise
kernel: the two sums read and write four and three ``N H`` tensors (two
``triton_poi_fused_add_view_*`` kernels a layer).
:func:`inductor_ext.ops.sum_of_products.sum_of_products` writes the first product and has cuBLAS add
each further one to it in the GEMM's epilogue (``addmm_``): no sum kernel and no product held beside
another, for one more read of the total by each GEMM after the first.

What is rewritten (``accumulate_products``): a tree of ``aten.add.Tensor`` nodes (no ``alpha``;
each inner add read only by the next) whose every term is an ``aten.mm`` read only there, optionally
through one view (``reshape``/``view``/``_unsafe_view``) read only there, with one dtype and one
shape throughout (no broadcasting, no promotion). The product with the shortest reduction goes
first: it is the one written; the others read the total in their epilogue, where a wider reduction
hides the read better. Trees with any other term are left as they are.

It always runs in the ``"post_grad"`` stage (:mod:`.pipeline`), on forward and backward graphs alike;
it saves GPU time in a training step (docs/benchmarks/train_llama-3.2-1b_4x2048_gemm_levers_h100.json).
The rewritten sums count in ``counters["inductor_ext"]["sum_of_products"]``.
"""

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

import inductor_ext.ops.sum_of_products  # noqa: F401  registers fastops::sum_of_products
from inductor_ext.inductor.graph_queries import with_value

aten = torch.ops.aten

_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def accumulate_products(graph: Graph) -> int:
    """Rewrite the sums of products described in the module docstring; returns how many."""
    rewritten = 0
    erased: set[Node] = set()
    # last to first: a sum's outermost add comes first, and the inner adds of a tree with another term
    # get their own turn
    for root in reversed(list(graph.nodes)):
        if root in erased or not _is_plain_add(root):
            continue  # an inner add of a sum already rewritten, or not an add
        terms, adds = _terms(root)
        products = [p for p in map(_product, terms) if p is not None]
        distinct = len(set(terms)) == len(terms) and len(set(adds)) == len(adds)
        if len(products) != len(terms) or not distinct or not _same_layout(root, terms, products):
            continue
        _rewrite(graph, root, products, adds)
        erased.update(adds)
        rewritten += 1
    if rewritten:
        counters["inductor_ext"]["sum_of_products"] += rewritten
    return rewritten


def _is_plain_add(node: Node) -> bool:
    return node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs


def _terms(root: Node) -> tuple[list[Any], list[Node]]:
    """The terms of the add tree under ``root`` (left to right; nodes or constants) and its adds (``root`` first)."""
    terms: list[Any] = []
    adds: list[Node] = []
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, Node) and (node is root or (_is_plain_add(node) and len(node.users) == 1)):
            adds.append(node)
            stack.extend(reversed(node.args))
        else:
            terms.append(node)
    return terms, adds


def _product(term: object) -> tuple[Node, Node | None] | None:
    """``(mm, view)`` for a term that is ``mm(a, b)``, or a view of it, read only by its add; None otherwise."""
    if not isinstance(term, Node) or len(term.users) != 1:
        return None
    view = None
    if term.op == "call_function" and term.target in _VIEWS:
        view, term = term, term.args[0]
        if not isinstance(term, Node) or len(term.users) != 1:
            return None
    if term.op != "call_function" or term.target is not aten.mm.default:
        return None
    return term, view


def _same_layout(root: Node, terms: list[Node], products: list[tuple[Node, Node | None]]) -> bool:
    """Every term has the sum's dtype, device and shape (no promotion, no broadcasting), and every
    product the first one's shape."""
    total = root.meta.get("val")
    values: list[Any] = [term.meta.get("val") for term in terms]
    if not isinstance(total, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    first = products[0][0].meta["val"].shape
    return all(
        (v.dtype, v.device) == (total.dtype, total.device) and _same_shape(v.shape, total.shape) for v in values
    ) and all(_same_shape(mm.meta["val"].shape, first) for mm, _ in products)


def _same_shape(a: torch.Size, b: torch.Size) -> bool:
    """Whether two shapes, possibly symbolic, are known to be equal (no guard is added)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b, strict=True))


def _reduction_width(mm: Node) -> float:
    """The product's reduction length (``a``'s columns), or infinity where it is symbolic."""
    width = mm.args[0].meta["val"].shape[1]  # type: ignore[union-attr]
    return int(width) if isinstance(width, int) else math.inf


def _rewrite(graph: Graph, root: Node, products: list[tuple[Node, Node | None]], adds: list[Node]) -> None:
    products = sorted(products, key=lambda product: _reduction_width(product[0]))
    lhs = [mm.args[0] for mm, _ in products]
    rhs = [mm.args[1] for mm, _ in products]
    view = next((v for _, v in products if v is not None), None)
    with graph.inserting_before(root):
        result = with_value(graph.call_function(torch.ops.fastops.sum_of_products.default, (lhs, rhs)), "val")
        if view is not None:  # the products' shape viewed as the sum's, as every term's view does
            target = cast(Callable[..., Any], view.target)
            result = with_value(graph.call_function(target, (result, *view.args[1:])), "val")
    root.replace_all_uses_with(result)
    for node in adds:  # root first: each add's users are gone before it is erased
        graph.erase_node(node)
    for mm, view in products:
        if view is not None:
            graph.erase_node(view)
        graph.erase_node(mm)

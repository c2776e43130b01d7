"""Rewrites of common PyTorch spellings into fastops ops, on the Dynamo (torch-level) graph.

The backend runs every registered rewrite over the graph Dynamo hands it, before
AOTAutograd: a rewritten call becomes a fastops forward op, so AOTAutograd
differentiates it with the op's registered backward, and forward and backward both
run on the fastops ops (then on our kernels or Inductor's code, per the route).

A rewrite is a function ``(node) -> Node | None``: given a candidate output node, it
either builds the replacement (inserted before ``node``) and returns it, or returns
None. Register one with :func:`register_rewrite`; ops add theirs next to the RMSNorm
ones below. Matching is structural and conservative: anything unexpected (another
reduction dim, a tensor eps, a weight of another shape) leaves the graph unchanged.
"""

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from inductor_ext.ops._library import OpFamily
from inductor_ext.ops.rms_norm import rms_norm_family

Rewrite = Callable[[Node], Node | None]

REWRITES: dict[str, Rewrite] = {}
"""Rewrite name -> rewrite, applied in registration order."""


def register_rewrite(name: str) -> Callable[[Rewrite], Rewrite]:
    def register(rewrite: Rewrite) -> Rewrite:
        REWRITES[name] = rewrite
        return rewrite

    return register


def apply_rewrites(gm: GraphModule) -> dict[str, int]:
    """Rewrite every match in ``gm`` (in place); returns how many of each rewrite applied."""
    applied = dict.fromkeys(REWRITES, 0)
    for name, rewrite in REWRITES.items():
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or node.op not in ("call_function", "call_method"):
                continue  # erased by an earlier rewrite
            replacement = rewrite(node)
            if replacement is not None:
                replacement.meta.update({k: v for k, v in node.meta.items() if k not in replacement.meta})
                node.replace_all_uses_with(replacement)
                applied[name] += 1
                counters["inductor_ext"][f"rewrite_{name}"] += 1
        gm.graph.eliminate_dead_code()
    gm.recompile()
    return {name: n for name, n in applied.items() if n}


# ---------------------------------------------------------------- graph helpers


def _value(node: Any) -> Any:
    """The example value Dynamo recorded for a node (a fake tensor), or the constant itself."""
    return node.meta.get("example_value") if isinstance(node, Node) else node


def _is_call(node: Any, functions: tuple[Any, ...] = (), methods: tuple[str, ...] = ()) -> bool:
    if not isinstance(node, Node):
        return False
    return (node.op == "call_function" and node.target in functions) or (node.op == "call_method" and node.target in methods)


def _binary_operands(node: Node, functions: tuple[Any, ...], method: str) -> tuple[Any, Any] | None:
    if _is_call(node, functions, (method,)) and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


def _dtype_cast(node: Any) -> tuple[Node, torch.dtype] | None:
    """``t.to(dtype)``, ``t.float()``, ``t.type(dtype)``, ``t.type_as(ref)`` -> (t, dtype)."""
    if not isinstance(node, Node) or node.op != "call_method" or not node.args:
        return None
    value = _value(node)
    if not isinstance(value, torch.Tensor):
        return None
    if node.target == "float" and len(node.args) == 1:
        return node.args[0], torch.float32
    if node.target in ("to", "type", "type_as") and len(node.args) == 2 and not node.kwargs:
        target = node.args[1]
        if isinstance(target, torch.dtype) or node.target == "type_as":
            return node.args[0], value.dtype
    if node.target == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.args[0], node.kwargs["dtype"]
    return None


def _upcast_source(node: Any) -> Node | None:
    """``x`` for ``x.to(float32)``/``x.float()``, or ``node`` itself when it is fp32 already."""
    cast = _dtype_cast(node)
    if cast is not None and cast[1] == torch.float32:
        return cast[0]
    value = _value(node)
    if isinstance(node, Node) and isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return node
    return None


def _is_last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)):
        return len(dim) == 1 and _is_last_dim(dim[0], ndim)
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _insert_family_call(node: Node, family: OpFamily, x: Node, args: tuple[Any, ...]) -> Node:
    """``family(x2d, *args)[0]`` viewed back to x's shape, inserted before ``node``.

    Mirrors the public functions: flatten leading dims to 2-D outside the op, unit stride
    along the normalised dim.
    """
    graph: Graph = node.graph
    n = _value(x).shape[-1]
    with graph.inserting_before(node):
        x2d = _with_value(graph.call_method("contiguous", (_with_value(graph.call_method("reshape", (x, -1, n))),)))
        out = _with_value(graph.call_function(family.fwd, (x2d, *args)))
        y2d = _with_value(graph.call_function(operator.getitem, (out, 0)))
        return _with_value(graph.call_method("view_as", (y2d, x)))


def _with_value(node: Node) -> Node:
    """Record the node's example value, as Dynamo does, by running it on the inputs' fake tensors."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _value)
    fake_mode = next(a.fake_mode for a in torch.utils._pytree.tree_leaves(args) if hasattr(a, "fake_mode"))
    with fake_mode:
        if node.op == "call_method":
            value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            value = node.target(*args, **kwargs)
    node.meta["example_value"] = value
    return node


# ---------------------------------------------------------------- RMSNorm


def _rms_core(rsqrt: Node) -> tuple[Node, Node, float] | None:
    """``rsqrt(mean(h ** 2, -1, keepdim=True) + eps)`` with ``h`` = x in fp32 -> (h, x, eps)."""
    if not _is_call(rsqrt, (torch.rsqrt,), ("rsqrt",)) or len(rsqrt.args) != 1:
        return None
    operands = _binary_operands(rsqrt.args[0], _ADD, "add")
    if operands is None:
        return None
    mean, eps = operands if isinstance(operands[0], Node) else operands[::-1]
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not isinstance(mean, Node):
        return None
    if not _is_call(mean, (torch.mean,), ("mean",)) or mean.kwargs.get("keepdim") is not True:
        return None
    square = mean.args[0]
    dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    h = None
    if _is_call(square, (torch.pow, operator.pow), ("pow",)) and len(square.args) == 2 and square.args[1] == 2 or _is_call(square, _MUL, ("mul",)) and len(square.args) == 2 and square.args[0] is square.args[1] or _is_call(square, (torch.square,), ("square",)) and len(square.args) == 1:
        h = square.args[0]
    if not isinstance(h, Node):
        return None
    x = _upcast_source(h)
    hv = _value(h)
    if x is None or not isinstance(hv, torch.Tensor) or hv.dim() < 2 or not _is_last_dim(dim, hv.dim()):
        return None
    if _value(x).dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return h, x, float(eps)


def _normalized(node: Any) -> tuple[Node, float] | None:
    """``h * rsqrt(...)`` (either order) -> (x, eps)."""
    operands = _binary_operands(node, _MUL, "mul") if isinstance(node, Node) else None
    if operands is None:
        return None
    for h, rsqrt in (operands, operands[::-1]):
        core = _rms_core(rsqrt) if isinstance(rsqrt, Node) else None
        if core is not None and core[0] is h:
            return core[1], core[2]
    return None


def _is_weight_for(weight: Any, x: Node) -> bool:
    w, xv = _value(weight), _value(x)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and w.shape[0] == xv.shape[-1] and w.device == xv.device


@register_rewrite("rms_norm_hf_llama")
def _hf_llama(node: Node) -> Node | None:
    """HF ``LlamaRMSNorm``: ``w * (h * rsqrt(mean(h**2) + eps)).to(x.dtype)`` (also without ``w``)."""
    cast = _dtype_cast(node)
    weight = None
    if cast is None:  # the weight multiply, either order
        operands = _binary_operands(node, _MUL, "mul")
        if operands is None:
            return None
        for weight, inner in (operands, operands[::-1]):
            cast = _dtype_cast(inner)
            if cast is not None:
                break
        else:
            return None
    normed = _normalized(cast[0])
    if normed is None:
        return None
    x, eps = normed
    if cast[1] != _value(x).dtype or (weight is not None and not _is_weight_for(weight, x)):
        return None
    if weight is not None and _value(node).dtype != torch.promote_types(_value(x).dtype, _value(weight).dtype):
        return None
    return _insert_family_call(node, rms_norm_family, x, (weight, eps, 0.0, "llama"))


@register_rewrite("rms_norm_gemma")
def _gemma(node: Node) -> Node | None:
    """HF ``GemmaRMSNorm``: ``(normed * (1.0 + w.float())).type_as(x)`` (any constant offset)."""
    cast = _dtype_cast(node)
    if cast is None:
        return None
    operands = _binary_operands(cast[0], _MUL, "mul")
    if operands is None:
        return None
    for inner, scale in (operands, operands[::-1]):
        normed = _normalized(inner)
        if normed is None or not isinstance(scale, Node):
            continue
        x, eps = normed
        shifted = _binary_operands(scale, _ADD, "add")  # offset + w.float(), either order
        if shifted is None:
            return None
        offset, weight_f32 = shifted if isinstance(shifted[1], Node) else shifted[::-1]
        weight = _upcast_source(weight_f32)
        if not isinstance(offset, (int, float)) or isinstance(offset, bool) or weight is None:
            return None
        if not _is_weight_for(weight, x) or cast[1] != _value(x).dtype:
            return None
        return _insert_family_call(node, rms_norm_family, x, (weight, eps, float(offset), "gemma"))
    return None


@register_rewrite("rms_norm_torch")
def _torch_rms_norm(node: Node) -> Node | None:
    """``torch.rms_norm`` / ``F.rms_norm`` / ``nn.RMSNorm`` over the last dim (normalise in fp32,
    cast to x's dtype, multiply by the weight: the llama casting)."""
    if not _is_call(node, (torch.rms_norm, torch.nn.functional.rms_norm)):
        return None
    names = ("input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    x, shape, weight, eps = (bound.get(k) for k in names)
    xv = _value(x)
    if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or xv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1 or shape[0] != xv.shape[-1]:
        return None
    if weight is not None and not _is_weight_for(weight, x):
        return None
    expected = xv.dtype  # torch returns x's dtype even for a weight of another dtype; we would promote
    if (weight is not None and _value(weight).dtype != expected) or _value(node).dtype != expected:
        return None
    if eps is None:
        eps = torch.finfo(xv.dtype).eps
    if not isinstance(eps, (int, float)):
        return None
    return _insert_family_call(node, rms_norm_family, x, (weight, float(eps), 0.0, "llama"))

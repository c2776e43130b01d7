"""Rewrites of the normalisations: HF ``LlamaRMSNorm`` and ``GemmaRMSNorm``, ``torch.rms_norm``, a residual
add into an RMSNorm (``add_rms_norm``), and ``F.layer_norm``."""

import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from inductor_ext.inductor.graph_queries import (
    ADD,
    MUL,
    any_between,
    binary_operands,
    dtype_cast,
    is_call,
    is_last_dim,
    upcast_source,
    value,
    with_value,
)
from inductor_ext.inductor.rewrites.registry import SUPPORTED_FLOATS, insert_rows_call, rows_2d
from inductor_ext.ops.layer_norm import layer_norm_family
from inductor_ext.ops.rms_norm import add_rms_norm_family, rms_norm_family


def _rms_core(rsqrt: Node) -> tuple[Any, Any, float] | None:
    """``rsqrt(mean(h ** 2, -1, keepdim=True) + eps)`` with ``h`` = x in fp32 -> (h, x, eps)."""
    if not is_call(rsqrt, (torch.rsqrt,), ("rsqrt",)) or len(rsqrt.args) != 1:
        return None
    operands = binary_operands(rsqrt.args[0], ADD, "add")
    if operands is None:
        return None
    mean, eps = operands if isinstance(operands[0], Node) else operands[::-1]
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not isinstance(mean, Node):
        return None
    if not is_call(mean, (torch.mean,), ("mean",)) or mean.kwargs.get("keepdim") is not True:
        return None
    square = mean.args[0]
    dim = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    h = None
    if (
        is_call(square, (torch.pow, operator.pow), ("pow",))
        and len(square.args) == 2
        and square.args[1] == 2
        or is_call(square, MUL, ("mul",))
        and len(square.args) == 2
        and square.args[0] is square.args[1]
        or is_call(square, (torch.square,), ("square",))
        and len(square.args) == 1
    ):
        h = square.args[0]
    if not isinstance(h, Node):
        return None
    x = upcast_source(h)
    hv = value(h)
    if x is None or not isinstance(hv, torch.Tensor) or hv.dim() < 2 or not is_last_dim(dim, hv.dim()):
        return None
    if value(x).dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return h, x, float(eps)


def _normalized(node: Any) -> tuple[Any, float] | None:
    """``h * rsqrt(...)`` (either order) -> (x, eps)."""
    operands = binary_operands(node, MUL, "mul") if isinstance(node, Node) else None
    if operands is None:
        return None
    for h, rsqrt in (operands, operands[::-1]):
        core = _rms_core(rsqrt) if isinstance(rsqrt, Node) else None
        if core is not None and core[0] is h:
            return core[1], core[2]
    return None


def _is_weight_for(weight: Any, x: Node) -> bool:
    w, xv = value(weight), value(x)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and w.shape[0] == xv.shape[-1] and w.device == xv.device


def _weight_multiply(node: Node, operand: Node, x: Node) -> bool:
    """``w * operand`` or ``operand * w`` with ``w`` a weight for rows of ``x``."""
    operands = binary_operands(node, MUL, "mul")
    if operands is None or operand not in operands:
        return False
    other = operands[1] if operands[0] is operand else operands[0]
    return _is_weight_for(other, x)


def rms_norm_hf_llama(node: Node) -> Node | None:
    """HF ``LlamaRMSNorm``: ``w * (h * rsqrt(mean(h**2) + eps)).to(x.dtype)`` (also without ``w``)."""
    cast = dtype_cast(node)
    weight = None
    if cast is None:  # the weight multiply, either order
        operands = binary_operands(node, MUL, "mul")
        if operands is None:
            return None
        for candidate, inner in (operands, operands[::-1]):
            cast = dtype_cast(inner)
            if cast is not None:
                weight = candidate
                break
        else:
            return None
    normed = _normalized(cast[0])
    if normed is None:
        return None
    x, eps = normed
    if cast[1] != value(x).dtype or (weight is not None and not _is_weight_for(weight, x)):
        return None
    if weight is None and any(_weight_multiply(user, node, x) for user in node.users):
        return None  # the weight multiply after this cast is the match (folding the weight in)
    if weight is not None and value(node).dtype != torch.promote_types(value(x).dtype, value(weight).dtype):
        return None
    return insert_rows_call(node, rms_norm_family, [x], (weight, eps, 0.0, "llama"), x)


def rms_norm_gemma(node: Node) -> Node | None:
    """HF ``GemmaRMSNorm``: ``(normed * (1.0 + w.float())).type_as(x)`` (any constant offset)."""
    cast = dtype_cast(node)
    if cast is None:
        return None
    operands = binary_operands(cast[0], MUL, "mul")
    if operands is None:
        return None
    for inner, scale in (operands, operands[::-1]):
        normed = _normalized(inner)
        if normed is None or not isinstance(scale, Node):
            continue
        x, eps = normed
        shifted = binary_operands(scale, ADD, "add")  # offset + w.float(), either order
        if shifted is None:
            return None
        offset, weight_f32 = shifted if isinstance(shifted[1], Node) else shifted[::-1]
        weight = upcast_source(weight_f32)
        if not isinstance(offset, (int, float)) or isinstance(offset, bool) or weight is None:
            return None
        if not _is_weight_for(weight, x) or cast[1] != value(x).dtype:
            return None
        return insert_rows_call(node, rms_norm_family, [x], (weight, eps, float(offset), "gemma"), x)
    return None


def rms_norm_torch(node: Node) -> Node | None:
    """``torch.rms_norm`` / ``F.rms_norm`` / ``nn.RMSNorm`` over the last dim (normalise in fp32,
    cast to x's dtype, multiply by the weight: the llama casting)."""
    if not is_call(node, (torch.rms_norm, torch.nn.functional.rms_norm)):
        return None
    names = ("input", "normalized_shape", "weight", "eps")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    x, shape, weight, eps = (bound.get(k) for k in names)
    if not isinstance(x, Node):
        return None
    xv = value(x)
    if (
        not isinstance(xv, torch.Tensor)
        or xv.dim() < 2
        or xv.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return None
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1 or shape[0] != xv.shape[-1]:
        return None
    if weight is not None and not _is_weight_for(weight, x):
        return None
    expected = xv.dtype  # torch returns x's dtype even for a weight of another dtype; we would promote
    if (weight is not None and value(weight).dtype != expected) or value(node).dtype != expected:
        return None
    if eps is None:
        eps = torch.finfo(xv.dtype).eps
    if not isinstance(eps, (int, float)):
        return None
    return insert_rows_call(node, rms_norm_family, [x], (weight, float(eps), 0.0, "llama"), x)


def add_rms_norm(node: Node) -> Node | None:
    """A residual add feeding an RMSNorm (rewritten by the rewrites above), ``norm(h)`` with
    ``h = x + r`` also used elsewhere (the residual stream) -> ``add_rms_norm_fwd(x, r)``, whose
    sum output replaces h everywhere: the add runs inside the norm's kernel, forward and backward.

    Only when x and r have h's shape and dtype (no broadcasting or promotion) and every other use
    of h comes after the norm (the fused op defines h there).
    """
    if not is_call(node, (rms_norm_family.fwd,)):
        return None
    rows = node.args[0]
    if not is_call(rows, (), ("reshape",)):
        return None
    h = rows.args[0]
    operands = binary_operands(h, ADD, "add")
    if operands is None or not isinstance(h, Node) or len(rows.users) != 1:
        return None
    hv = value(h)
    for t in operands:
        tv = value(t)
        if not isinstance(t, Node) or not isinstance(tv, torch.Tensor) or tv.shape != hv.shape or tv.dtype != hv.dtype:
            return None
    others = [user for user in h.users if user is not rows]
    if any_between(h, node, set(others)):
        return None
    x, r = operands
    graph: Graph = node.graph
    with graph.inserting_before(node):
        fused = with_value(graph.call_function(add_rms_norm_family.fwd, (rows_2d(x), rows_2d(r), *node.args[1:])))
        h_rows = with_value(graph.call_function(operator.getitem, (fused, 2)))
        new_h = with_value(graph.call_method("view_as", (h_rows, x)))
    for user in others:
        user.replace_input_with(h, new_h)
    return fused  # (y, rstd, h): its first two outputs are the replaced norm's (y, rstd)


# ---------------------------------------------------------------- LayerNorm


def layer_norm(node: Node) -> Node | None:
    """``F.layer_norm`` / ``torch.layer_norm`` / ``nn.LayerNorm`` over the last dim, parameters of x's dtype."""
    if not is_call(node, (torch.nn.functional.layer_norm, torch.layer_norm)):
        return None
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if set(bound) - set(names):
        return None
    x, shape, weight, bias = (bound.get(k) for k in names[:4])
    eps = bound.get("eps", 1e-5)
    if not isinstance(x, Node):
        return None
    xv, out = value(x), value(node)
    if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or xv.dtype not in SUPPORTED_FLOATS:
        return None
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1 or shape[0] != xv.shape[-1]:
        return None
    for param in (weight, bias):
        if param is not None and (not _is_weight_for(param, x) or value(param).dtype != xv.dtype):
            return None
    if not isinstance(out, torch.Tensor) or out.dtype != xv.dtype:
        return None
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    return insert_rows_call(node, layer_norm_family, [x], (weight, bias, float(eps)), x)

"""Rewrite of ``act(gate) * up`` into the GLU op (SwiGLU: HF ``LlamaMLP``; GeGLU)."""

from typing import Any

import torch
from torch.fx import Node

from inductor_ext.inductor.graph_queries import MUL, binary_operands, is_call, value
from inductor_ext.inductor.rewrites.registry import SUPPORTED_FLOATS, insert_rows_call
from inductor_ext.ops.glu import glu_family


def _glu_activation(node: Any) -> tuple[Any, str] | None:
    """``F.silu(a)`` / ``F.gelu(a, approximate=...)`` -> (a, the glu op's activation name)."""
    if is_call(node, (torch.nn.functional.silu,)) and len(node.args) == 1 and not node.kwargs.get("inplace"):
        return node.args[0], "silu"
    if is_call(node, (torch.nn.functional.gelu,)) and len(node.args) == 1:
        approximate = node.kwargs.get("approximate", "none")
        if set(node.kwargs) <= {"approximate"} and approximate in ("none", "tanh"):
            return node.args[0], "gelu_tanh" if approximate == "tanh" else "gelu"
    return None


def glu(node: Node) -> Node | None:
    """``act(gate) * up`` (either order) with act SiLU (SwiGLU: HF ``LlamaMLP``) or GELU (GeGLU)."""
    operands = binary_operands(node, MUL, "mul")
    if operands is None:
        return None
    for act, up in (operands, operands[::-1]):
        matched = _glu_activation(act)
        if matched is None or not isinstance(up, Node):
            continue
        gate, activation = matched
        g, u, out = value(gate), value(up), value(node)
        if not all(isinstance(t, torch.Tensor) for t in (g, u, out)):
            return None
        if g.shape != u.shape or out.shape != g.shape or g.dim() == 0 or g.device != u.device:
            return None
        if not g.dtype == u.dtype == out.dtype or g.dtype not in SUPPORTED_FLOATS:
            return None
        return insert_rows_call(node, glu_family, [gate, up], (activation,), gate)
    return None

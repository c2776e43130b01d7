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
from typing import Any, TypeGuard, cast

import torch
from torch._dynamo.utils import counters
from torch.fx import Graph, GraphModule, Node

from inductor_ext.ops._library import OpFamily
from inductor_ext.ops.cross_entropy import cross_entropy_family
from inductor_ext.ops.glu import glu_family
from inductor_ext.ops.layer_norm import layer_norm_family
from inductor_ext.ops.rms_norm import add_rms_norm_family, rms_norm_family
from inductor_ext.ops.rope import rope_family

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
            if node.graph is not gm.graph or node.op not in ("call_function", "call_method") or not node.users:
                continue  # erased, or already replaced by a rewrite that covered two outputs
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
    """The example value Dynamo recorded for a node (a fake tensor; ``val`` in a ``torch.export``
    graph), or the constant itself."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else node


def _is_call(node: Any, functions: tuple[Any, ...] = (), methods: tuple[str, ...] = ()) -> TypeGuard[Node]:
    if not isinstance(node, Node):
        return False
    return (node.op == "call_function" and node.target in functions) or (
        node.op == "call_method" and node.target in methods
    )


def _binary_operands(node: Any, functions: tuple[Any, ...], method: str) -> tuple[Any, Any] | None:
    if _is_call(node, functions, (method,)) and len(node.args) == 2 and not node.kwargs:
        return node.args[0], node.args[1]
    return None


_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


def _dtype_cast(node: Any) -> tuple[Any, torch.dtype] | None:
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
    dtype = node.kwargs.get("dtype")
    if node.target == "to" and len(node.args) == 1 and set(node.kwargs) == {"dtype"} and isinstance(dtype, torch.dtype):
        return node.args[0], dtype
    return None


def _upcast_source(node: Any) -> Any:
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


def _insert_rows_call(node: Node, family: OpFamily, rows: list[Node], args: tuple[Any, ...], like: Node) -> Node:
    """``family(*rows as 2-D, *args)`` (its first output), viewed back to ``like``'s shape, before ``node``.

    Mirrors the public functions: leading dims flattened outside the op, unit stride along
    the last dim (a copy only when the example value lacks it).
    """
    graph: Graph = node.graph
    with graph.inserting_before(node):
        out = _with_value(graph.call_function(family.fwd, (*map(_rows_2d, rows), *args)))
        if isinstance(_value(out), (tuple, list)):
            out = _with_value(graph.call_function(operator.getitem, (out, 0)))
        return _with_value(graph.call_method("view_as", (out, like)))


def _rows_2d(t: Node) -> Node:
    """``t`` as ``(rows, last dim)`` at the graph's insertion point, as the public functions flatten
    leading dims (a copy only when the example value lacks a unit-stride last dim)."""
    graph = t.graph
    row2d = _with_value(graph.call_method("reshape", (t, -1, _value(t).shape[-1])))
    if _value(t).stride(-1) != 1:
        row2d = _with_value(graph.call_method("contiguous", (row2d,)))
    return row2d


def _any_between(first: Node, last: Node, nodes: set[Node]) -> bool:
    """Whether one of ``nodes`` stands strictly between ``first`` and ``last`` (``first`` before ``last``)
    in the graph: a walk back from ``last``, not an index of the whole graph."""
    current = last.prev
    while current is not first:
        if current in nodes:
            return True
        current = current.prev
    return False


def _with_value(node: Node) -> Node:
    """Record the node's example value, as Dynamo does, by running it on the inputs' fake tensors."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _value)
    fake_mode = next(a.fake_mode for a in torch.utils._pytree.tree_leaves(args) if hasattr(a, "fake_mode"))
    with fake_mode:
        if node.op == "call_method":
            value = getattr(args[0], str(node.target))(*args[1:], **kwargs)
        else:
            value = cast(Callable[..., Any], node.target)(*args, **kwargs)
    node.meta["example_value"] = value
    return node


# ---------------------------------------------------------------- RMSNorm


def _rms_core(rsqrt: Node) -> tuple[Any, Any, float] | None:
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
    if (
        _is_call(square, (torch.pow, operator.pow), ("pow",))
        and len(square.args) == 2
        and square.args[1] == 2
        or _is_call(square, _MUL, ("mul",))
        and len(square.args) == 2
        and square.args[0] is square.args[1]
        or _is_call(square, (torch.square,), ("square",))
        and len(square.args) == 1
    ):
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


def _normalized(node: Any) -> tuple[Any, float] | None:
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


def _weight_multiply(node: Node, operand: Node, x: Node) -> bool:
    """``w * operand`` or ``operand * w`` with ``w`` a weight for rows of ``x``."""
    operands = _binary_operands(node, _MUL, "mul")
    if operands is None or operand not in operands:
        return False
    other = operands[1] if operands[0] is operand else operands[0]
    return _is_weight_for(other, x)


@register_rewrite("rms_norm_hf_llama")
def _hf_llama(node: Node) -> Node | None:
    """HF ``LlamaRMSNorm``: ``w * (h * rsqrt(mean(h**2) + eps)).to(x.dtype)`` (also without ``w``)."""
    cast = _dtype_cast(node)
    weight = None
    if cast is None:  # the weight multiply, either order
        operands = _binary_operands(node, _MUL, "mul")
        if operands is None:
            return None
        for candidate, inner in (operands, operands[::-1]):
            cast = _dtype_cast(inner)
            if cast is not None:
                weight = candidate
                break
        else:
            return None
    normed = _normalized(cast[0])
    if normed is None:
        return None
    x, eps = normed
    if cast[1] != _value(x).dtype or (weight is not None and not _is_weight_for(weight, x)):
        return None
    if weight is None and any(_weight_multiply(user, node, x) for user in node.users):
        return None  # the weight multiply after this cast is the match (folding the weight in)
    if weight is not None and _value(node).dtype != torch.promote_types(_value(x).dtype, _value(weight).dtype):
        return None
    return _insert_rows_call(node, rms_norm_family, [x], (weight, eps, 0.0, "llama"), x)


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
        return _insert_rows_call(node, rms_norm_family, [x], (weight, eps, float(offset), "gemma"), x)
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
    if not isinstance(x, Node):
        return None
    xv = _value(x)
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
    if (weight is not None and _value(weight).dtype != expected) or _value(node).dtype != expected:
        return None
    if eps is None:
        eps = torch.finfo(xv.dtype).eps
    if not isinstance(eps, (int, float)):
        return None
    return _insert_rows_call(node, rms_norm_family, [x], (weight, float(eps), 0.0, "llama"), x)


@register_rewrite("add_rms_norm")
def _add_rms_norm(node: Node) -> Node | None:
    """A residual add feeding an RMSNorm (rewritten by the rewrites above), ``norm(h)`` with
    ``h = x + r`` also used elsewhere (the residual stream) -> ``add_rms_norm_fwd(x, r)``, whose
    sum output replaces h everywhere: the add runs inside the norm's kernel, forward and backward.

    Only when x and r have h's shape and dtype (no broadcasting or promotion) and every other use
    of h comes after the norm (the fused op defines h there).
    """
    if not _is_call(node, (rms_norm_family.fwd,)):
        return None
    rows = node.args[0]
    if not _is_call(rows, (), ("reshape",)):
        return None
    h = rows.args[0]
    operands = _binary_operands(h, _ADD, "add")
    if operands is None or not isinstance(h, Node) or len(rows.users) != 1:
        return None
    hv = _value(h)
    for t in operands:
        tv = _value(t)
        if not isinstance(t, Node) or not isinstance(tv, torch.Tensor) or tv.shape != hv.shape or tv.dtype != hv.dtype:
            return None
    others = [user for user in h.users if user is not rows]
    if _any_between(h, node, set(others)):
        return None
    x, r = operands
    graph: Graph = node.graph
    with graph.inserting_before(node):
        fused = _with_value(graph.call_function(add_rms_norm_family.fwd, (_rows_2d(x), _rows_2d(r), *node.args[1:])))
        h_rows = _with_value(graph.call_function(operator.getitem, (fused, 2)))
        new_h = _with_value(graph.call_method("view_as", (h_rows, x)))
    for user in others:
        user.replace_input_with(h, new_h)
    return fused  # (y, rstd, h): its first two outputs are the replaced norm's (y, rstd)


# ---------------------------------------------------------------- LayerNorm


@register_rewrite("layer_norm")
def _layer_norm(node: Node) -> Node | None:
    """``F.layer_norm`` / ``torch.layer_norm`` / ``nn.LayerNorm`` over the last dim, parameters of x's dtype."""
    if not _is_call(node, (torch.nn.functional.layer_norm, torch.layer_norm)):
        return None
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if set(bound) - set(names):
        return None
    x, shape, weight, bias = (bound.get(k) for k in names[:4])
    eps = bound.get("eps", 1e-5)
    if not isinstance(x, Node):
        return None
    xv, out = _value(x), _value(node)
    if not isinstance(xv, torch.Tensor) or xv.dim() < 2 or xv.dtype not in _SUPPORTED_FLOATS:
        return None
    if not isinstance(shape, (list, tuple, torch.Size)) or len(shape) != 1 or shape[0] != xv.shape[-1]:
        return None
    for param in (weight, bias):
        if param is not None and (not _is_weight_for(param, x) or _value(param).dtype != xv.dtype):
            return None
    if not isinstance(out, torch.Tensor) or out.dtype != xv.dtype:
        return None
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    return _insert_rows_call(node, layer_norm_family, [x], (weight, bias, float(eps)), x)


# ---------------------------------------------------------------- SwiGLU / GeGLU

_SUPPORTED_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _glu_activation(node: Any) -> tuple[Any, str] | None:
    """``F.silu(a)`` / ``F.gelu(a, approximate=...)`` -> (a, the glu op's activation name)."""
    if _is_call(node, (torch.nn.functional.silu,)) and len(node.args) == 1 and not node.kwargs.get("inplace"):
        return node.args[0], "silu"
    if _is_call(node, (torch.nn.functional.gelu,)) and len(node.args) == 1:
        approximate = node.kwargs.get("approximate", "none")
        if set(node.kwargs) <= {"approximate"} and approximate in ("none", "tanh"):
            return node.args[0], "gelu_tanh" if approximate == "tanh" else "gelu"
    return None


@register_rewrite("glu")
def _glu(node: Node) -> Node | None:
    """``act(gate) * up`` (either order) with act SiLU (SwiGLU: HF ``LlamaMLP``) or GELU (GeGLU)."""
    operands = _binary_operands(node, _MUL, "mul")
    if operands is None:
        return None
    for act, up in (operands, operands[::-1]):
        matched = _glu_activation(act)
        if matched is None or not isinstance(up, Node):
            continue
        gate, activation = matched
        g, u, out = _value(gate), _value(up), _value(node)
        if not all(isinstance(t, torch.Tensor) for t in (g, u, out)):
            return None
        if g.shape != u.shape or out.shape != g.shape or g.dim() == 0 or g.device != u.device:
            return None
        if not g.dtype == u.dtype == out.dtype or g.dtype not in _SUPPORTED_FLOATS:
            return None
        return _insert_rows_call(node, glu_family, [gate, up], (activation,), gate)
    return None


# ---------------------------------------------------------------- cross-entropy


def _before_upcast(logits: Node) -> Node:
    """The 16-bit logits an fp32 upcast was taken of, in ``logits``' shape, or ``logits`` itself.

    Two spellings: ``x.float()`` and ``x.float().view(-1, V)`` (HF ``ForCausalLMLoss`` upcasts,
    then flattens). For the second, ``x.reshape(-1, V)`` is inserted at the current insertion point:
    a view of ``x`` wherever the upcast's view was one (the upcast keeps ``x``'s strides)."""
    reshaped = _is_call(logits, (torch.reshape,), ("view", "reshape")) and not logits.kwargs
    inner = logits.args[0] if reshaped else logits
    cast = _dtype_cast(inner)
    if cast is None or cast[1] != torch.float32 or _value(cast[0]).dtype not in _SUPPORTED_FLOATS:
        return logits
    if not reshaped:
        return cast[0]
    shape = logits.args[1:]
    if any(isinstance(a, torch.dtype) for a in shape):  # view(dtype) reinterprets bits: not a reshape
        return logits
    return _with_value(logits.graph.call_method("reshape", (cast[0], *shape)))


@register_rewrite("cross_entropy")
def _cross_entropy(node: Node) -> Node | None:
    """``F.cross_entropy(logits (N, V), labels (N,), ...)`` without class weights (HF ``ForCausalLMLoss``
    ends in it). An fp32 upcast of 16-bit logits is absorbed: the op computes in fp32 anyway."""
    if not _is_call(node, (torch.nn.functional.cross_entropy,)):
        return None
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    if set(bound) - set(names) or any(bound.get(k) is not None for k in ("weight", "size_average", "reduce")):
        return None
    logits, labels = bound.get("input"), bound.get("target")
    ignore_index, reduction = bound.get("ignore_index", -100), bound.get("reduction", "mean")
    smoothing = bound.get("label_smoothing", 0.0)
    lv, tv, out = _value(logits), _value(labels), _value(node)
    if not isinstance(lv, torch.Tensor) or not isinstance(tv, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if not isinstance(logits, Node):  # a tensor in a Dynamo graph is always a node
        return None
    if (
        lv.dim() != 2
        or tv.dim() != 1
        or tv.dtype not in (torch.int64, torch.int32)
        or lv.dtype not in _SUPPORTED_FLOATS
    ):
        return None
    if not isinstance(ignore_index, int) or reduction not in ("mean", "sum", "none"):
        return None
    if not isinstance(smoothing, (int, float)) or isinstance(smoothing, bool):
        return None
    args = (int(ignore_index), float(smoothing), 0.0, 0.0, reduction)
    graph: Graph = node.graph
    with graph.inserting_before(node):
        logits = _before_upcast(logits)  # the op reads 16-bit logits and computes in fp32
        rows = logits if _value(logits).stride(-1) == 1 else _with_value(graph.call_method("contiguous", (logits,)))
        result = _with_value(graph.call_function(cross_entropy_family.fwd, (rows, labels, *args)))
        loss = _with_value(graph.call_function(operator.getitem, (result, 0)))
        if _value(loss).dtype != out.dtype:
            loss = _with_value(graph.call_method("to", (loss, out.dtype)))
        return loss


# ---------------------------------------------------------------- RoPE


def _rotate_half_source(node: Any) -> Any:
    """HF ``rotate_half(x)`` = ``cat((-x[..., h:], x[..., :h]), dim=-1)`` with h = D/2 -> x."""
    if not _is_call(node, (torch.cat,)):
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or dim != -1:
        return None
    neg, first = tensors
    if not _is_call(neg, (operator.neg, torch.neg), ("neg",)) or len(neg.args) != 1:
        return None
    second = neg.args[0]
    halves: list[tuple[Any, slice]] = []
    for part in (first, second):
        if not _is_call(part, (operator.getitem,)) or not isinstance(part.args[1], tuple) or len(part.args[1]) != 2:
            return None
        if part.args[1][0] is not Ellipsis or not isinstance(part.args[1][1], slice):
            return None
        halves.append((part.args[0], part.args[1][1]))
    (x, low), (x2, high) = halves
    d = _value(x).shape[-1] if isinstance(_value(x), torch.Tensor) else None
    if x is not x2 or d is None or d % 2:
        return None
    if (low.start, low.stop, low.step) not in ((None, d // 2, None), (0, d // 2, None)):
        return None
    return x if (high.start, high.stop, high.step) == (d // 2, None, None) else None


def _unsqueezed_table(node: Any) -> tuple[Any, int] | None:
    """``table.unsqueeze(d)`` -> (table, d)."""
    if _is_call(node, (torch.unsqueeze,), ("unsqueeze",)) and len(node.args) == 2 and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def _rotary(node: Node) -> tuple[Any, Any, Any, int, Any] | None:
    """``x * cos.unsqueeze(d) + rotate_half(x) * sin.unsqueeze(d)`` (any operand order)
    -> (x, cos, sin, d, the unsqueezed cos node)."""
    terms = _binary_operands(node, _ADD, "add")
    if terms is None:
        return None
    for cos_term, sin_term in (terms, terms[::-1]):
        cos_ops = _binary_operands(cos_term, _MUL, "mul") if isinstance(cos_term, Node) else None
        sin_ops = _binary_operands(sin_term, _MUL, "mul") if isinstance(sin_term, Node) else None
        if cos_ops is None or sin_ops is None:
            continue
        for x, cos_u in (cos_ops, cos_ops[::-1]):
            for rotated, sin_u in (sin_ops, sin_ops[::-1]):
                cos, sin = _unsqueezed_table(cos_u), _unsqueezed_table(sin_u)
                if cos and sin and cos[1] == sin[1] and _rotate_half_source(rotated) is x:
                    return x, cos[0], sin[0], cos[1], cos_u
    return None


@register_rewrite("rope_hf")
def _rope(node: Node) -> Node | None:
    """HF ``apply_rotary_pos_emb``: the q and k rotations sharing one cos/sin pair become one op call.

    A rotation whose partner is not found (only q rotated, other tables) is left alone.
    """
    matched = _rotary(node)
    if matched is None:
        return None
    q, cos, sin, d, cos_u = matched
    # the partner rotation multiplies by the same unsqueezed cos (HF unsqueezes once for q and k)
    candidates = [add for mul in cos_u.users for add in mul.users if add is not node and add.users]
    partners = [
        (c, r) for c in candidates if (r := _rotary(c)) is not None and r[1:4] == (cos, sin, d) and r[0] is not q
    ]
    if not partners:
        return None
    k_node, k = partners[0][0], partners[0][1][0]
    qv, kv, cv, sv = (_value(n) for n in (q, k, cos, sin))
    if qv.dim() != 4 or kv.dim() != 4 or qv.dtype != kv.dtype or d not in (1, 2, -3, -2):
        return None
    if cv.shape != sv.shape or cv.dim() not in (2, 3) or cv.shape[-1] != qv.shape[-1] or cv.requires_grad:
        return None
    if sv.requires_grad or qv.dtype not in _SUPPORTED_FLOATS or cv.dtype != sv.dtype:
        return None
    if _value(node).dtype != torch.promote_types(qv.dtype, cv.dtype):
        return None
    graph: Graph = node.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(node, k_node, key=order.__getitem__)
    if any(order[n] > order[first] for n in (q, k, cos, sin)):
        return None  # an input is computed between the two rotations: leave them
    with graph.inserting_before(first):
        out = _with_value(graph.call_function(rope_family.fwd, (q, k, cos, sin, None, 1 if d in (1, -3) else 2)))
        q_embed = _with_value(graph.call_function(operator.getitem, (out, 0)))
        k_embed = _with_value(graph.call_function(operator.getitem, (out, 1)))
    k_embed.meta.update({key: v for key, v in k_node.meta.items() if key not in k_embed.meta})
    k_node.replace_all_uses_with(k_embed)
    return q_embed

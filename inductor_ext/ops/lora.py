"""Fused LoRA projections: ``torch.ops.fastops.lora_*`` and :func:`lora_linear`, :func:`lora_qkv`, :func:`lora_mlp`.

One LoRA projection of an input ``x`` (N, in) with a frozen base weight ``W`` (out, in) and
bias ``c`` (out,), trainable adapters ``A`` (r, in) and ``B`` (out, r), scaling ``s``, and a
dropout keep-mask ``m`` (N, in, bool) drawn with probability ``1 - p``::

    x_d = x ⊙ m / (1 - p)              the dropped input (x itself without dropout: no work)
    xa  = x_d Aᵀ                        (N, r), saved for dB
    y   = x Wᵀ + c + s · xa Bᵀ          the low-rank term added into the base GEMM's output in place
                                        (``y.addmm_(xa, Bᵀ, alpha=s)``): no second (N, out) tensor

Each in-place ``addmm_`` (here and in the backward's ``dx``) goes through ``fastops::lora_addmm_``, an
opaque mutating op: traced, a plain ``addmm_`` is functionalised into ``addmm(y, ...)``, which Inductor
runs as cuBLAS writing a new buffer after copying ``y`` into it (a device-to-device copy of every
projection's output); the opaque op is reinplaced by Inductor and accumulates into ``y`` itself.

Backward; ``W`` and ``c`` are frozen, so it computes only ``dx``, ``dA`` and ``dB``::

    g   = dy B                          (N, r)
    dB  = s · dyᵀ xa                    (out, r)
    dA  = s · gᵀ x_d                    (r, in)     x_d recomputed from the saved x and m
    dx  = dy W + s · (g A) ⊙ m / (1 - p)            dy W first, the low-rank term added in place

The blocks built from it:

* **QKV**: three projections of one ``x``; the backward accumulates the six ``dx`` terms
  into one ``(N, in)`` buffer.
* **MLP**: ``y = down(act(gate(x)) ⊙ up(x))``, ``act`` SiLU (SwiGLU) or GELU / tanh-GELU
  (GeGLU), each of gate, up and down a LoRA projection. The activation runs in the GLU
  family's Triton kernels (:mod:`inductor_ext.ops.glu`) on the GPU. With ``G = gate(x)``,
  ``U = up(x)`` and ``h = act(G) ⊙ U``::

      dh     = down's dx (above, with h as its input)
      dG, dU = dh ⊙ U ⊙ act'(G),  dh ⊙ act(G)          (the GLU backward kernel)
      dx     = gate's dx (from dG) + up's dx (from dU), one buffer

**Dropout.** The keep-masks are op inputs (bool, the shape of each projection's input), drawn
outside the op by the public functions (``bernoulli_``, which ``torch.compile`` traces like any
random op); ``None`` means no dropout and adds no work. The backward recomputes ``x_d`` from the
saved ``x`` and mask, so ``dA`` uses exactly the dropped input of the forward. Each projection
has its own mask, as each PEFT ``LoraLayer`` has its own dropout module.

**Memory kept between forward and backward** (beside references to the weights, never a copy
or a concatenation of them): linear and QKV, ``x``, each mask (1 byte per element) and each
``(N, r)`` product ``xa``. MLP: ``x``, ``G`` and ``U`` (``2 N I`` elements), the three
``xa`` and the masks; ``h`` is recomputed in the backward from ``G`` and ``U`` (one
elementwise pass) instead of being kept (``N I`` more). PEFT's unfused eager module keeps
``G``, ``act(G)``, ``U`` and ``h`` (``4 N I``).

Schemas (``<p>`` for one projection's arguments, spelled with a prefix ``q_``, ``k_``, ``v_``,
``gate_``, ``up_``, ``down_``; masks are ``Tensor?``)::

    forward  <p> = Tensor weight, Tensor[] weight_quant, Tensor? bias, Tensor lora_a, Tensor lora_b,
                   float scaling, Tensor? dropout_mask
    backward <p> = Tensor weight, Tensor[] weight_quant, Tensor lora_a, Tensor lora_b, Tensor xa,
                   float scaling, Tensor? dropout_mask

    fastops::lora_linear_fwd(Tensor x, <p>, float dropout_p) -> (Tensor y, Tensor xa)
    fastops::lora_linear_bwd(Tensor dy, Tensor x, <p>, float dropout_p, bool compute_dx)
        -> (Tensor dx, Tensor dlora_a, Tensor dlora_b)
    fastops::lora_qkv_fwd(Tensor x, <q>, <k>, <v>, float dropout_p) -> (q, k, v, q_xa, k_xa, v_xa)
    fastops::lora_qkv_bwd(Tensor dq, Tensor dk, Tensor dv, Tensor x, <q>, <k>, <v>, float dropout_p,
        bool compute_dx) -> (dx, dq_lora_a, dq_lora_b, dk_lora_a, dk_lora_b, dv_lora_a, dv_lora_b)
    fastops::lora_mlp_fwd(Tensor x, <gate>, <up>, <down>, str activation, float dropout_p)
        -> (y, gate_out, up_out, gate_xa, up_xa, down_xa)
    fastops::lora_mlp_bwd(Tensor dy, Tensor x, Tensor gate_out, Tensor up_out, <gate>, <up>, <down>,
        str activation, float dropout_p, bool compute_dx) -> (dx, dgate_lora_a, dgate_lora_b, ...)

``weight_quant`` is empty for a dense ``weight``; for a 4-bit (QLoRA) base, ``weight`` holds its packed
codes and ``weight_quant`` its code tables and scales (:mod:`inductor_ext.ops.nf4`). Each GEMM that
reads ``W`` (``x Wᵀ`` forward, ``dy W`` backward) dequantises it into a transient ``(out, in)`` tensor
first, one projection at a time, freed after its GEMM (what bitsandbytes' own matmul does); the
backward recomputes it rather than keeping a dequantised copy per layer.

All tensors are 2-D (the public functions flatten leading dims) and of one dtype (the codes uint8). ``dx`` is a
``(0,)`` tensor when ``compute_dx`` is false (an input that needs no gradient: the first
layer's). The GEMMs are aten's (cuBLAS on the GPU) on every path; the MLP's activation is our
GLU kernel on the GPU and aten math on the CPU branch and the backend's Inductor route.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._ops import OpOverload

from inductor_ext.library.launch import Launch
from inductor_ext.library.registration import define_op_family, define_opaque_mutating_op
from inductor_ext.ops._gradient_tie import tied_to_gradient
from inductor_ext.ops._layout import rows_2d
from inductor_ext.ops._split_gemm import float32_mm, float32_mm_upcasts
from inductor_ext.ops.glu import (
    geglu_ref,
    glu_bwd_kernels,
    glu_bwd_math,
    glu_fwd_kernels,
    glu_fwd_math,
    swiglu_ref,
)
from inductor_ext.ops.nf4 import Nf4Weight, check_nf4_weight, dequantize, nf4_dequantize

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MLP_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
"""``activation`` of :func:`lora_mlp`: SwiGLU, GeGLU with erf GELU, GeGLU with tanh GELU."""

GluFwd = Callable[[Tensor, Tensor, str], Tensor]
GluBwd = Callable[[Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]]


class _Fwd(NamedTuple):
    """One projection's forward op arguments."""

    weight: Tensor
    weight_quant: list[Tensor]
    bias: Tensor | None
    lora_a: Tensor
    lora_b: Tensor
    scaling: float
    dropout_mask: Tensor | None


class _Bwd(NamedTuple):
    """One projection's backward op arguments."""

    weight: Tensor
    weight_quant: list[Tensor]
    lora_a: Tensor
    lora_b: Tensor
    xa: Tensor
    scaling: float
    dropout_mask: Tensor | None


_FWD_ARGS, _BWD_ARGS = len(_Fwd._fields), len(_Bwd._fields)


def _fwd_groups(inputs: Sequence[Any], first: int, count: int) -> list[_Fwd]:
    """``count`` projections' forward arguments, from position ``first`` of a forward op's inputs."""
    return [_Fwd(*inputs[first + _FWD_ARGS * i : first + _FWD_ARGS * (i + 1)]) for i in range(count)]


def _adapter_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for the adapters' GEMMs: float32 when either side is float32 adapters' (a bf16 input
    times float32 adapters runs on tensor cores at float32 accuracy: :func:`float32_mm`), else in the
    operands' dtype; under ``torch.autocast``, autocast's."""
    if torch.float32 in (a.dtype, b.dtype) and not torch.is_autocast_enabled(a.device.type):
        return float32_mm(a, b)
    return a @ b


def _dropped(x: Tensor, mask: Tensor | None, p: float, adapter_dtype: torch.dtype) -> tuple[Tensor, float]:
    """``(x', c)`` with ``x' · c = x ⊙ m / (1 - p)`` (``x``, 1 without a mask). ``x ⊙ m`` is exact in
    ``x``'s dtype: for float32 adapters the scale ``c`` is left to the float32 product, so that the
    16-bit input stays an exact operand of :func:`_adapter_mm`; 16-bit adapters get ``x'`` scaled."""
    if mask is None:
        return x, 1.0
    if adapter_dtype == x.dtype:
        return x * mask * (1.0 / (1.0 - p)), 1.0
    return x * mask, 1.0 / (1.0 - p)


def _addmm_(acc: Tensor, a: Tensor, b: Tensor, alpha: float) -> None:
    acc.addmm_(a, b, alpha=alpha)


addmm_ = define_opaque_mutating_op("lora_addmm_", _addmm_, mutates=("acc",))
"""``fastops::lora_addmm_(Tensor(a!) acc, Tensor a, Tensor b, float alpha) -> ()``: ``acc += alpha · a b``
in place, opaque to the compiler (module docstring)."""


def _project(x: Tensor, proj: _Fwd, p: float) -> tuple[Tensor, Tensor]:
    """``(y, xa)``: ``y = x Wᵀ + c + s · xa Bᵀ`` with the low-rank term added into ``y`` in place."""
    weight, quant, bias, lora_a, lora_b, scaling, mask = proj
    weight = dequantize(weight, quant, x.dtype)
    y = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
    dropped, factor = _dropped(x, mask, p, lora_a.dtype)
    xa = _adapter_mm(dropped, lora_a.t())  # float32 adapters: float32, kept for dB
    xa = xa if factor == 1.0 else xa.mul_(factor)
    # the (N, out) term in y's dtype, from the rank-r factors cast to it: one GEMM accumulating into y
    addmm_(y, xa.to(y.dtype), lora_b.t().to(y.dtype), scaling)
    return y, xa


def _project_bwd(
    dy: Tensor, x: Tensor, proj: _Bwd, p: float, dx: Tensor | None, compute_dx: bool
) -> tuple[Tensor | None, Tensor, Tensor]:
    """``(dx, dA, dB)`` of one projection; its ``dx`` terms added into ``dx`` in place when given."""
    weight, quant, lora_a, lora_b, xa, scaling, mask = proj
    if mask is not None or float32_mm_upcasts(x, lora_a):
        # read elementwise below (the mask's product, a float32 copy): the backward's own, not the forward's
        # (kept under selective checkpointing, the forward's would be saved: ops._gradient_tie)
        x = tied_to_gradient(x, dy)
    # float32 adapters: their gradients to float32 accuracy, as PEFT's (xa is 16-bit if autocast was on)
    g = _adapter_mm(dy, lora_b)
    dlora_b = _adapter_mm(dy.t(), xa.to(lora_b.dtype)).mul_(scaling)
    dropped, factor = _dropped(x, mask, p, lora_a.dtype)
    dlora_a = _adapter_mm(g.t(), dropped).mul_(scaling * factor)
    if compute_dx:
        weight = dequantize(weight, quant, dy.dtype, grad=dy)  # a 4-bit base again: never saved dequantised
        if dx is None:
            dx = dy @ weight
        else:
            addmm_(dx, dy, weight, 1.0)
        lora_a = lora_a.to(dx.dtype)  # the (N, in) term in dx's dtype, as the forward's (N, out) one
        if mask is None:
            addmm_(dx, g.to(dx.dtype), lora_a, scaling)
        else:
            # the factor goes on the small (N, r) g, not in add_'s alpha: Inductor (torch 2.13, CPU) fuses
            # add(mm(a, b), c, alpha=k) into addmm(c, a, b) and drops k (a wrong compiled dx, seen here)
            dx.add_((g.mul(scaling / (1.0 - p)).to(dx.dtype) @ lora_a).mul_(mask))
    return dx, dlora_a, dlora_b


def _dx_or_empty(dx: Tensor | None, x: Tensor) -> Tensor:
    """The op's ``dx`` output: a distinct ``(0,)`` tensor when not computed (op outputs never alias)."""
    return x.new_empty((0,)) if dx is None else dx


# --- LoRA linear -------------------------------------------------------------------------------


def lora_linear_fwd_math(
    x: Tensor,
    weight: Tensor,
    weight_quant: list[Tensor],
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scaling: float,
    dropout_mask: Tensor | None,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """Forward (every path: the GEMMs are aten's; the family has no kernels): ``(y, xa)``."""
    return _project(x, _Fwd(weight, weight_quant, bias, lora_a, lora_b, scaling, dropout_mask), dropout_p)


def lora_linear_bwd_math(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    weight_quant: list[Tensor],
    lora_a: Tensor,
    lora_b: Tensor,
    xa: Tensor,
    scaling: float,
    dropout_mask: Tensor | None,
    dropout_p: float,
    compute_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: ``(dx, dA, dB)``; ``dx`` is ``(0,)`` unless ``compute_dx``."""
    proj = _Bwd(weight, weight_quant, lora_a, lora_b, xa, scaling, dropout_mask)
    dx, dlora_a, dlora_b = _project_bwd(dy, x, proj, dropout_p, None, compute_dx)
    return _dx_or_empty(dx, x), dlora_a, dlora_b


def _linear_setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor]) -> None:
    ctx.dropout_p = inputs[-1]
    _save_projections(ctx, _fwd_groups(inputs, 1, 1), output[1:], inputs[0])
    ctx.mark_non_differentiable(output[1])


def _linear_backward(ctx: Any, bwd: Any, dy: Tensor | None, _dxa: Tensor | None) -> tuple[Tensor | None, ...]:
    if dy is None:
        return (None,) * (2 + _FWD_ARGS)
    (x,), projection = _saved_projections(ctx, 1)
    compute_dx = ctx.needs_input_grad[0]
    dx, dlora_a, dlora_b = bwd(dy, x, *projection, ctx.dropout_p, compute_dx)
    return dx if compute_dx else None, *_adapter_grads(ctx, bwd, (dlora_a, dlora_b)), None


lora_linear_family = define_op_family(
    "lora_linear",
    fwd_math=lora_linear_fwd_math,
    fwd_kernels=None,  # cuBLAS through aten on every path: no kernels of its own, no route to time
    bwd_math=lora_linear_bwd_math,
    bwd_kernels=None,
    setup_context=_linear_setup_context,
    backward=_linear_backward,
)


# --- LoRA QKV ----------------------------------------------------------------------------------

QkvOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
AdapterGrads = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def lora_qkv_fwd_math(
    x: Tensor,
    q_weight: Tensor,
    q_weight_quant: list[Tensor],
    q_bias: Tensor | None,
    q_lora_a: Tensor,
    q_lora_b: Tensor,
    q_scaling: float,
    q_dropout_mask: Tensor | None,
    k_weight: Tensor,
    k_weight_quant: list[Tensor],
    k_bias: Tensor | None,
    k_lora_a: Tensor,
    k_lora_b: Tensor,
    k_scaling: float,
    k_dropout_mask: Tensor | None,
    v_weight: Tensor,
    v_weight_quant: list[Tensor],
    v_bias: Tensor | None,
    v_lora_a: Tensor,
    v_lora_b: Tensor,
    v_scaling: float,
    v_dropout_mask: Tensor | None,
    dropout_p: float,
) -> QkvOutputs:
    """Forward (every path): ``(q, k, v, q_xa, k_xa, v_xa)``."""
    projections = (
        _Fwd(q_weight, q_weight_quant, q_bias, q_lora_a, q_lora_b, q_scaling, q_dropout_mask),
        _Fwd(k_weight, k_weight_quant, k_bias, k_lora_a, k_lora_b, k_scaling, k_dropout_mask),
        _Fwd(v_weight, v_weight_quant, v_bias, v_lora_a, v_lora_b, v_scaling, v_dropout_mask),
    )
    (q, q_xa), (k, k_xa), (v, v_xa) = (_project(x, proj, dropout_p) for proj in projections)
    return q, k, v, q_xa, k_xa, v_xa


def lora_qkv_bwd_math(
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    x: Tensor,
    q_weight: Tensor,
    q_weight_quant: list[Tensor],
    q_lora_a: Tensor,
    q_lora_b: Tensor,
    q_xa: Tensor,
    q_scaling: float,
    q_dropout_mask: Tensor | None,
    k_weight: Tensor,
    k_weight_quant: list[Tensor],
    k_lora_a: Tensor,
    k_lora_b: Tensor,
    k_xa: Tensor,
    k_scaling: float,
    k_dropout_mask: Tensor | None,
    v_weight: Tensor,
    v_weight_quant: list[Tensor],
    v_lora_a: Tensor,
    v_lora_b: Tensor,
    v_xa: Tensor,
    v_scaling: float,
    v_dropout_mask: Tensor | None,
    dropout_p: float,
    compute_dx: bool,
) -> AdapterGrads:
    """Backward: ``(dx, dA_q, dB_q, dA_k, dB_k, dA_v, dB_v)``, the six ``dx`` terms summed into one buffer."""
    projections = (
        (dq, _Bwd(q_weight, q_weight_quant, q_lora_a, q_lora_b, q_xa, q_scaling, q_dropout_mask)),
        (dk, _Bwd(k_weight, k_weight_quant, k_lora_a, k_lora_b, k_xa, k_scaling, k_dropout_mask)),
        (dv, _Bwd(v_weight, v_weight_quant, v_lora_a, v_lora_b, v_xa, v_scaling, v_dropout_mask)),
    )
    dx: Tensor | None = None
    grads: list[Tensor] = []
    for dy, proj in projections:
        dx, dlora_a, dlora_b = _project_bwd(dy, x, proj, dropout_p, dx, compute_dx)
        grads += (dlora_a, dlora_b)
    dqa, dqb, dka, dkb, dva, dvb = grads
    return _dx_or_empty(dx, x), dqa, dqb, dka, dkb, dva, dvb


def _save_projections(ctx: Any, projections: Sequence[_Fwd], xas: Sequence[Tensor], *tensors: Tensor) -> None:
    """Saves ``tensors`` and each projection's weight (a 4-bit one as it is: its codes and scales), adapters,
    ``xa`` and mask; scalings and the lengths of the ``weight_quant`` lists on ctx."""
    per_projection = [
        (p.weight, *p.weight_quant, p.lora_a, p.lora_b, xa, p.dropout_mask) for p, xa in zip(projections, xas)
    ]
    ctx.save_for_backward(*tensors, *(t for group in per_projection for t in group))
    ctx.scalings = tuple(p.scaling for p in projections)
    ctx.quant_lengths = tuple(len(p.weight_quant) for p in projections)


def _saved_projections(ctx: Any, leading: int) -> tuple[tuple[Tensor, ...], list[Any]]:
    """``(the first `leading` saved tensors, the backward op's projection arguments, flattened)``."""
    saved = ctx.saved_tensors
    flat: list[Any] = []
    start = leading
    for scaling, quant_length in zip(ctx.scalings, ctx.quant_lengths):
        weight, *quant, lora_a, lora_b, xa, mask = saved[start : start + 5 + quant_length]
        flat += _Bwd(weight, quant, lora_a, lora_b, xa, scaling, mask)
        start += 5 + quant_length
    return saved[:leading], flat


def _adapter_grads(ctx: Any, bwd: Any, grads: Sequence[Tensor]) -> list[Any]:
    """A backward's gradients of the projections' forward arguments, from ``(dA, dB)`` per projection.

    ``weight_quant`` gets a list of Nones through the registered op (``register_autograd`` wants the
    inputs' structure), None through the eager ``autograd.Function`` (a list is not a tensor input)."""
    registered = isinstance(bwd, OpOverload)
    quant = [[None] * n if registered else None for n in ctx.quant_lengths]
    pairs = zip(grads[0::2], grads[1::2], quant)
    return [g for da, db, q in pairs for g in (None, q, None, da, db, None, None)]


def _qkv_setup_context(ctx: Any, inputs: Sequence[Any], output: QkvOutputs) -> None:
    ctx.dropout_p = inputs[-1]
    _save_projections(ctx, _fwd_groups(inputs, 1, 3), output[3:], inputs[0])
    ctx.mark_non_differentiable(*output[3:])


def _qkv_backward(ctx: Any, bwd: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    (x,), projections = _saved_projections(ctx, 1)
    if all(g is None for g in grads[:3]):
        return (None,) * (2 + 3 * _FWD_ARGS)
    # an output nobody used has no gradient (eager does not materialise them)
    outs = [projections[_BWD_ARGS * i].shape[0] for i in range(3)]
    dq, dk, dv = (x.new_zeros((x.shape[0], n)) if g is None else g for g, n in zip(grads[:3], outs))
    compute_dx = ctx.needs_input_grad[0]
    dx, *adapter_grads = bwd(dq, dk, dv, x, *projections, ctx.dropout_p, compute_dx)
    return (dx if compute_dx else None, *_adapter_grads(ctx, bwd, adapter_grads), None)


lora_qkv_family = define_op_family(
    "lora_qkv",
    fwd_math=lora_qkv_fwd_math,
    fwd_kernels=None,  # cuBLAS through aten on every path: no kernels of its own, no route to time
    bwd_math=lora_qkv_bwd_math,
    bwd_kernels=None,
    setup_context=_qkv_setup_context,
    backward=_qkv_backward,
)


# --- LoRA MLP ----------------------------------------------------------------------------------

MlpOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _mlp_fwd(glu_fwd: GluFwd, x: Tensor, args: Sequence[Any]) -> MlpOutputs:
    """``(y, G, U, gate_xa, up_xa, down_xa)`` from the forward op's arguments after ``x``."""
    gate, up, down = _fwd_groups(args, 0, 3)
    activation, dropout_p = args[3 * _FWD_ARGS :]
    gate_out, gate_xa = _project(x, gate, dropout_p)
    up_out, up_xa = _project(x, up, dropout_p)
    y, down_xa = _project(glu_fwd(gate_out, up_out, activation), down, dropout_p)
    return y, gate_out, up_out, gate_xa, up_xa, down_xa


def _mlp_bwd(glu_fwd: GluFwd, glu_bwd: GluBwd, args: Sequence[Any]) -> AdapterGrads:
    """The backward op on its arguments; ``h`` recomputed from ``G`` and ``U``."""
    dy, x, gate_out, up_out, *rest = args
    gate, up, down = (_Bwd(*rest[_BWD_ARGS * i : _BWD_ARGS * (i + 1)]) for i in range(3))
    activation, dropout_p, compute_dx = rest[3 * _BWD_ARGS :]
    h = glu_fwd(gate_out, up_out, activation)
    dh, ddown_a, ddown_b = _project_bwd(dy, h, down, dropout_p, None, True)
    del h  # eager: freed before the GLU backward allocates dG and dU
    assert dh is not None
    dgate, dup = glu_bwd(dh, gate_out, up_out, activation)
    del dh
    dx, dgate_a, dgate_b = _project_bwd(dgate, x, gate, dropout_p, None, compute_dx)
    dx, dup_a, dup_b = _project_bwd(dup, x, up, dropout_p, dx, compute_dx)
    return _dx_or_empty(dx, x), dgate_a, dgate_b, dup_a, dup_b, ddown_a, ddown_b


def lora_mlp_fwd_math(
    x: Tensor,
    gate_weight: Tensor,
    gate_weight_quant: list[Tensor],
    gate_bias: Tensor | None,
    gate_lora_a: Tensor,
    gate_lora_b: Tensor,
    gate_scaling: float,
    gate_dropout_mask: Tensor | None,
    up_weight: Tensor,
    up_weight_quant: list[Tensor],
    up_bias: Tensor | None,
    up_lora_a: Tensor,
    up_lora_b: Tensor,
    up_scaling: float,
    up_dropout_mask: Tensor | None,
    down_weight: Tensor,
    down_weight_quant: list[Tensor],
    down_bias: Tensor | None,
    down_lora_a: Tensor,
    down_lora_b: Tensor,
    down_scaling: float,
    down_dropout_mask: Tensor | None,
    activation: str,
    dropout_p: float,
) -> MlpOutputs:
    """Aten-only forward (CPU branch and the backend's decomposition): the activation in aten math."""
    args = (gate_weight, gate_weight_quant, gate_bias, gate_lora_a, gate_lora_b, gate_scaling, gate_dropout_mask,
            up_weight, up_weight_quant, up_bias, up_lora_a, up_lora_b, up_scaling, up_dropout_mask,
            down_weight, down_weight_quant, down_bias, down_lora_a, down_lora_b, down_scaling, down_dropout_mask,
            activation, dropout_p)  # fmt: skip
    return _mlp_fwd(glu_fwd_math, x, args)


def lora_mlp_fwd_kernels(launch: Launch, x: Tensor, *args: Any) -> MlpOutputs:
    """The GEMMs through aten (cuBLAS), the activation in the GLU forward kernel."""
    return _mlp_fwd(lambda g, u, act: glu_fwd_kernels(launch, g, u, act), x, args)


def lora_mlp_bwd_math(
    dy: Tensor,
    x: Tensor,
    gate_out: Tensor,
    up_out: Tensor,
    gate_weight: Tensor,
    gate_weight_quant: list[Tensor],
    gate_lora_a: Tensor,
    gate_lora_b: Tensor,
    gate_xa: Tensor,
    gate_scaling: float,
    gate_dropout_mask: Tensor | None,
    up_weight: Tensor,
    up_weight_quant: list[Tensor],
    up_lora_a: Tensor,
    up_lora_b: Tensor,
    up_xa: Tensor,
    up_scaling: float,
    up_dropout_mask: Tensor | None,
    down_weight: Tensor,
    down_weight_quant: list[Tensor],
    down_lora_a: Tensor,
    down_lora_b: Tensor,
    down_xa: Tensor,
    down_scaling: float,
    down_dropout_mask: Tensor | None,
    activation: str,
    dropout_p: float,
    compute_dx: bool,
) -> AdapterGrads:
    """Aten-only backward: ``(dx, dA_gate, dB_gate, dA_up, dB_up, dA_down, dB_down)``. ``h`` is recomputed
    from ``G`` and ``U`` read through :func:`~inductor_ext.ops._gradient_tie.tied_to_gradient`: the
    forward's float32 upcasts of ``G`` and ``U`` are not merged into it (and so not saved)."""
    gate_out, up_out = tied_to_gradient(gate_out, dy), tied_to_gradient(up_out, dy)
    args = (dy, x, gate_out, up_out,
            gate_weight, gate_weight_quant, gate_lora_a, gate_lora_b, gate_xa, gate_scaling, gate_dropout_mask,
            up_weight, up_weight_quant, up_lora_a, up_lora_b, up_xa, up_scaling, up_dropout_mask,
            down_weight, down_weight_quant, down_lora_a, down_lora_b, down_xa, down_scaling, down_dropout_mask,
            activation, dropout_p, compute_dx)  # fmt: skip
    return _mlp_bwd(glu_fwd_math, glu_bwd_math, args)


def lora_mlp_bwd_kernels(launch: Launch, *args: Any) -> AdapterGrads:
    """The GEMMs through aten (cuBLAS); ``h``'s recomputation and the activation's backward in the GLU kernels."""
    return _mlp_bwd(
        lambda g, u, act: glu_fwd_kernels(launch, g, u, act),
        lambda dh, g, u, act: glu_bwd_kernels(launch, dh, g, u, act),
        args,
    )


def _mlp_setup_context(ctx: Any, inputs: Sequence[Any], output: MlpOutputs) -> None:
    ctx.activation, ctx.dropout_p = inputs[-2:]
    _save_projections(ctx, _fwd_groups(inputs, 1, 3), output[3:], inputs[0], output[1], output[2])
    ctx.mark_non_differentiable(*output[1:])


def _mlp_backward(ctx: Any, bwd: Any, dy: Tensor | None, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    if dy is None:
        return (None,) * (3 + 3 * _FWD_ARGS)
    (x, gate_out, up_out), projections = _saved_projections(ctx, 3)
    compute_dx = ctx.needs_input_grad[0]
    dx, *adapter_grads = bwd(dy, x, gate_out, up_out, *projections, ctx.activation, ctx.dropout_p, compute_dx)
    return (dx if compute_dx else None, *_adapter_grads(ctx, bwd, adapter_grads), None, None)


lora_mlp_family = define_op_family(
    "lora_mlp",
    fwd_math=lora_mlp_fwd_math,
    fwd_kernels=lora_mlp_fwd_kernels,
    bwd_math=lora_mlp_bwd_math,
    bwd_kernels=lora_mlp_bwd_kernels,
    setup_context=_mlp_setup_context,
    backward=_mlp_backward,
)


# --- public functions --------------------------------------------------------------------------


class LoraProjection(NamedTuple):
    """One LoRA projection's parameters: ``y = x Wᵀ + bias + scaling · (dropout(x) Aᵀ) Bᵀ``.

    ``weight`` (out, in) and ``bias`` (out,) are the frozen base layer's, in the input's dtype;
    ``weight`` may be a 4-bit one (:class:`~inductor_ext.ops.nf4.Nf4Weight`, a QLoRA base: bitsandbytes'
    NF4/FP4, double quantisation too) that dequantises to the input's dtype: the ops dequantise it
    for each GEMM that reads it, forward and backward, and keep only the 4-bit form between them;
    ``lora_a`` (r, in) and ``lora_b`` (out, r) the trainable adapters, in the input's dtype or
    float32 (PEFT keeps adapters in float32 over a 16-bit base by default: the rank-r products
    ``x Aᵀ`` and ``dy B`` and the adapters' gradients are then float32-accurate, as in PEFT's layers,
    on bf16 tensor cores on CUDA (:mod:`inductor_ext.ops._split_gemm`);
    the ``(N, out)`` and ``(N, in)`` terms go into the 16-bit ``y`` and ``dx`` by 16-bit GEMMs of
    the rank-r factors, where PEFT rounds its float32 term to 16 bits before adding it; under
    ``torch.autocast`` everything runs in the autocast dtype, as PEFT's layers do).
    From a PEFT ``lora.Linear`` ``m`` and adapter ``name``: ``LoraProjection(m.base_layer.weight,
    m.lora_A[name].weight, m.lora_B[name].weight, m.scaling[name], m.base_layer.bias)``.
    """

    weight: Tensor | Nf4Weight
    lora_a: Tensor
    lora_b: Tensor
    scaling: float
    bias: Tensor | None = None


def _check_input(fn: str, x: Any) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least 1 dimension (the features), got a scalar")


def _check_projection(fn: str, name: str, proj: Any, x: Tensor, in_features: int) -> None:
    """``proj`` (a :class:`LoraProjection`) fits an input of ``in_features`` like ``x`` (dtype, device)."""
    if not isinstance(proj, LoraProjection):
        raise TypeError(f"{fn}: {name} must be a LoraProjection, got {type(proj).__name__}")
    quantized = isinstance(proj.weight, Nf4Weight)
    if isinstance(proj.weight, Nf4Weight):
        check_nf4_weight(fn, f"{name}.weight", proj.weight)
        if proj.weight.device != x.device:
            raise ValueError(f"{fn}: {name}.weight is on {proj.weight.device} but x is on {x.device}")
    for arg in ("lora_a", "lora_b") if quantized else ("weight", "lora_a", "lora_b"):
        t = getattr(proj, arg)
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name}.{arg} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{fn}: {name}.{arg} must be 2-D, got shape {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{fn}: {name}.{arg} is on {t.device} but x is on {x.device}; both must be on one device")
    weight, lora_a, lora_b = proj.weight, proj.lora_a, proj.lora_b
    out, rank = weight.shape[0], lora_a.shape[0]
    if weight.shape[1] != in_features:
        raise ValueError(
            f"{fn}: {name}.weight must have shape (out, {in_features}) to match its input's features, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        what = "dequantise to" if quantized else "have"
        raise TypeError(f"{fn}: {name}.weight must {what} x's dtype ({x.dtype}), got {weight.dtype}")
    if isinstance(weight, Tensor) and weight.requires_grad:
        raise ValueError(f"{fn}: {name}.weight must be frozen (requires_grad=False): no base-weight gradient")
    if lora_a.shape[1] != in_features:
        raise ValueError(
            f"{fn}: {name}.lora_a must have shape (r, {in_features}) to match {name}.weight's in_features, "
            f"got {tuple(lora_a.shape)}"
        )
    if tuple(lora_b.shape) != (out, rank):
        raise ValueError(
            f"{fn}: {name}.lora_b must have shape (out, r) = ({out}, {rank}) for {name}.weight's {out} outputs "
            f"and {name}.lora_a's rank {rank}, got {tuple(lora_b.shape)}"
        )
    for arg, t in (("lora_a", lora_a), ("lora_b", lora_b)):
        if t.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{fn}: {name}.{arg} must have x's dtype ({x.dtype}) or float32, got {t.dtype}")
    if not isinstance(proj.scaling, (int, float)) or isinstance(proj.scaling, bool):
        raise TypeError(f"{fn}: {name}.scaling must be a float, got {type(proj.scaling).__name__}")
    bias = proj.bias
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"{fn}: {name}.bias must be a Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (out,):
            raise ValueError(f"{fn}: {name}.bias must have shape ({out},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"{fn}: {name}.bias must have x's dtype ({x.dtype}), got {bias.dtype}")
        if bias.device != x.device:
            raise ValueError(f"{fn}: {name}.bias is on {bias.device} but x is on {x.device}")
        if bias.requires_grad:
            raise ValueError(f"{fn}: {name}.bias must be frozen (requires_grad=False): no base-bias gradient")


def _check_dropout_p(fn: str, dropout_p: Any) -> None:
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be a float in [0, 1), got {dropout_p!r}")


def _check_mask(fn: str, name: str, mask: Any, shape: Sequence[int], device: torch.device) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{fn}: {name} must be a bool Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{fn}: {name} must be a bool keep-mask, got {mask.dtype}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{fn}: {name} must have its projection input's shape {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{fn}: {name} is on {mask.device} but x is on {device}")


def _keep_mask(shape: Sequence[int], dropout_p: float, device: torch.device) -> Tensor:
    """A fresh dropout keep-mask: True with probability ``1 - dropout_p`` (1 byte per element)."""
    return torch.empty(tuple(shape), dtype=torch.bool, device=device).bernoulli_(1.0 - dropout_p)


def _masks(
    fn: str, names: Sequence[str], given: Any, shapes: Sequence[Sequence[int]], dropout_p: float, device: torch.device
) -> list[Tensor | None]:
    """Each projection's keep-mask: ``given`` (``dropout_masks``, checked), else fresh ones when
    ``dropout_p > 0``, else None. ``names`` are the projections' names."""
    if given is None:
        if dropout_p == 0.0:
            return [None] * len(shapes)
        return [_keep_mask(shape, dropout_p, device) for shape in shapes]
    if not isinstance(given, (tuple, list)) or len(given) != len(shapes):
        raise TypeError(f"{fn}: dropout_masks must be None or a tuple of {len(shapes)} bool masks ({', '.join(names)})")
    for name, mask, shape in zip(names, given, shapes):
        if mask is not None:
            _check_mask(fn, f"dropout_masks[{name}]", mask, shape, device)
    return list(given)


def _fwd_args(proj: LoraProjection, x: Tensor, mask: Tensor | None) -> tuple[Any, ...]:
    """A projection's forward op arguments (the adapters as they are: x's dtype or float32)."""
    lora_a, lora_b = proj.lora_a, proj.lora_b
    weight, quant = proj.weight.op_arguments() if isinstance(proj.weight, Nf4Weight) else (proj.weight, [])
    return weight, quant, proj.bias, lora_a, lora_b, float(proj.scaling), None if mask is None else rows_2d(mask)


def lora_linear(
    x: Tensor, proj: LoraProjection, *, dropout_p: float = 0.0, dropout_mask: Tensor | None = None
) -> Tensor:
    """``x Wᵀ + bias + scaling · (dropout(x) Aᵀ) Bᵀ`` (a PEFT ``lora.Linear``, e.g. the output projection), fused.

    Args:
        x: ``(..., in)`` float32/bfloat16/float16.
        proj: the projection's frozen base weight and bias and its adapters (:class:`LoraProjection`).
        dropout_p: LoRA dropout probability in ``[0, 1)``; 0 (the default, and what eval mode
            should pass) adds no work. With ``dropout_p > 0`` a fresh keep-mask is drawn unless
            ``dropout_mask`` is given.
        dropout_mask: a bool keep-mask of ``x``'s shape (True keeps the element), scaled by
            ``1 / (1 - dropout_p)``.

    Returns ``(..., out)`` in ``x``'s dtype. Gradients flow to ``x``, ``lora_a`` and ``lora_b``
    only. The math and the memory kept for the backward are in this module's docstring.
    """
    fn = "lora_linear"
    _check_input(fn, x)
    _check_projection(fn, "proj", proj, x, x.shape[-1])
    _check_dropout_p(fn, dropout_p)
    if dropout_mask is not None:
        _check_mask(fn, "dropout_mask", dropout_mask, x.shape, x.device)
        mask: Tensor | None = dropout_mask
    else:
        (mask,) = _masks(fn, ("proj",), None, [x.shape], dropout_p, x.device)
    y, _xa = lora_linear_family(rows_2d(x), *_fwd_args(proj, x, mask), float(dropout_p))
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


def lora_qkv(
    x: Tensor,
    q: LoraProjection,
    k: LoraProjection,
    v: LoraProjection,
    *,
    dropout_p: float = 0.0,
    dropout_masks: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The query, key and value LoRA projections of one ``x``, fused: ``(q, k, v)``.

    Each is :func:`lora_linear` of ``x``; ``dropout_masks`` (``x``'s shape each) are the three
    projections' keep-masks, drawn fresh (independently, as PEFT's three dropout modules do)
    when None and ``dropout_p > 0``. The backward sums the three input gradients into one buffer.
    """
    fn = "lora_qkv"
    _check_input(fn, x)
    for name, proj in (("q", q), ("k", k), ("v", v)):
        _check_projection(fn, name, proj, x, x.shape[-1])
    _check_dropout_p(fn, dropout_p)
    masks = _masks(fn, ("q", "k", "v"), dropout_masks, [x.shape] * 3, dropout_p, x.device)
    args = [a for proj, mask in zip((q, k, v), masks) for a in _fwd_args(proj, x, mask)]
    yq, yk, yv, *_xa = lora_qkv_family(rows_2d(x), *args, float(dropout_p))
    if x.dim() == 2:
        return yq, yk, yv
    lead = x.shape[:-1]
    return yq.view(*lead, yq.shape[-1]), yk.view(*lead, yk.shape[-1]), yv.view(*lead, yv.shape[-1])


def lora_mlp(
    x: Tensor,
    gate: LoraProjection,
    up: LoraProjection,
    down: LoraProjection,
    *,
    activation: str = "silu",
    dropout_p: float = 0.0,
    dropout_masks: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
) -> Tensor:
    """``down(act(gate(x)) ⊙ up(x))`` with LoRA gate, up and down projections, fused (the Llama / Gemma MLP).

    Args:
        x: ``(..., hidden)``.
        gate, up: ``(intermediate, hidden)`` base weights; down: ``(hidden_out, intermediate)``.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, erf) or ``"gelu_tanh"`` (GeGLU,
            ``gelu_pytorch_tanh``).
        dropout_p: as :func:`lora_linear`; each projection drops its own input.
        dropout_masks: ``(gate's, up's, down's)`` keep-masks: ``x``'s shape for gate and up,
            ``(..., intermediate)`` for down (the activation's output, which only exists inside
            the op). Drawn fresh when None and ``dropout_p > 0``.

    Returns ``(..., hidden_out)``. The backward recomputes ``act(G) ⊙ U`` from the saved gate
    and up outputs (this module's docstring says what is kept).
    """
    fn = "lora_mlp"
    _check_input(fn, x)
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be one of {MLP_ACTIVATIONS}, got {activation!r}")
    hidden = x.shape[-1]
    _check_projection(fn, "gate", gate, x, hidden)
    intermediate = gate.weight.shape[0]
    _check_projection(fn, "up", up, x, hidden)
    if up.weight.shape[0] != intermediate:
        raise ValueError(
            f"{fn}: up.weight must have gate.weight's shape {tuple(gate.weight.shape)}, got {tuple(up.weight.shape)}"
        )
    _check_projection(fn, "down", down, x, intermediate)
    _check_dropout_p(fn, dropout_p)
    shapes = [x.shape, x.shape, (*x.shape[:-1], intermediate)]
    masks = _masks(fn, ("gate", "up", "down"), dropout_masks, shapes, dropout_p, x.device)
    args = [a for proj, mask in zip((gate, up, down), masks) for a in _fwd_args(proj, x, mask)]
    y, *_saved = lora_mlp_family(rows_2d(x), *args, activation, float(dropout_p))
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


# --- references --------------------------------------------------------------------------------


def lora_linear_ref(
    x: Tensor, proj: LoraProjection, *, dropout_p: float = 0.0, dropout_mask: Tensor | None = None
) -> Tensor:
    """Plain PyTorch, PEFT's spelling: ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` (differentiable).

    ``dropout_mask`` (bool, True keeps) applies dropout; None means none (no randomness here).
    With float64 inputs it is the exact reference (a 4-bit base: on its dequantised weights).
    """
    x_d = x if dropout_mask is None else x * dropout_mask / (1.0 - dropout_p)
    lora_a, lora_b = proj.lora_a.to(x.dtype), proj.lora_b.to(x.dtype)
    lora = torch.nn.functional.linear(torch.nn.functional.linear(x_d, lora_a), lora_b)
    weight = nf4_dequantize(proj.weight).to(x.dtype) if isinstance(proj.weight, Nf4Weight) else proj.weight
    return torch.nn.functional.linear(x, weight, proj.bias) + lora * proj.scaling


def lora_qkv_ref(
    x: Tensor,
    q: LoraProjection,
    k: LoraProjection,
    v: LoraProjection,
    *,
    dropout_p: float = 0.0,
    dropout_masks: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Three :func:`lora_linear_ref` of ``x``."""
    masks = dropout_masks or (None, None, None)
    yq, yk, yv = (lora_linear_ref(x, p, dropout_p=dropout_p, dropout_mask=m) for p, m in zip((q, k, v), masks))
    return yq, yk, yv


def lora_mlp_ref(
    x: Tensor,
    gate: LoraProjection,
    up: LoraProjection,
    down: LoraProjection,
    *,
    activation: str = "silu",
    dropout_p: float = 0.0,
    dropout_masks: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
) -> Tensor:
    """Plain PyTorch, the HF MLP over PEFT layers: ``down(act(gate(x)) * up(x))`` (differentiable)."""
    m_gate, m_up, m_down = dropout_masks or (None, None, None)
    g = lora_linear_ref(x, gate, dropout_p=dropout_p, dropout_mask=m_gate)
    u = lora_linear_ref(x, up, dropout_p=dropout_p, dropout_mask=m_up)
    h = swiglu_ref(g, u) if activation == "silu" else geglu_ref(g, u, "tanh" if activation == "gelu_tanh" else "none")
    return lora_linear_ref(h, down, dropout_p=dropout_p, dropout_mask=m_down)


__all__ = [
    "LoraProjection",
    "lora_linear",
    "lora_linear_family",
    "lora_linear_ref",
    "lora_mlp",
    "lora_mlp_family",
    "lora_mlp_ref",
    "lora_qkv",
    "lora_qkv_family",
    "lora_qkv_ref",
]

"""RMSNorm: ``torch.ops.fastops.rms_norm_fwd`` / ``rms_norm_bwd`` and :func:`rms_norm`; with a
fused residual add, ``add_rms_norm_fwd`` / ``add_rms_norm_bwd`` and :func:`add_rms_norm`.

Schemas::

    fastops::rms_norm_fwd(Tensor x, Tensor? weight, float eps, float offset, str casting)
        -> (Tensor y, Tensor rstd)
    fastops::rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset, str casting)
        -> (Tensor dx, Tensor dw)
    fastops::add_rms_norm_fwd(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, str casting)
        -> (Tensor y, Tensor rstd, Tensor h)
    fastops::add_rms_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd, float offset,
                              str casting) -> (Tensor dx, Tensor dw)

``add_rms_norm`` normalises ``h = x + residual`` (rounded to x's dtype, as the eager add) and
returns h too: a transformer's residual stream, ``h = x + attn(x)`` then ``norm(h)`` with h
used again by the next residual add. Its backward adds ``dh``, the gradient h received through
those other uses, to the norm's dx: the gradient of both x and residual, written once.

``x`` is 2-D ``(M, N)`` with unit stride along N (the public function flattens
leading dims before the autograd boundary); ``rstd`` is fp32 ``(M,)``; ``dw`` has
the weight's dtype, or shape ``(0,)`` when there is no weight. The math is in the
docstring of :mod:`inductor_ext.kernels.rms_norm`.
"""

from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor
from torch._ops import OpOverload

from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel, rms_norm_fwd_kernel
from inductor_ext.library.launch import Launch, grid_stride_programs
from inductor_ext.library.registration import define_op_family
from inductor_ext.library.sharding import Strategy, replicated, shard_inputs, sharding_rule, weight_grad_placement
from inductor_ext.ops._arguments import check_real
from inductor_ext.ops._layout import rows_2d, unit_last_stride
from inductor_ext.ops._reduce import sum_partial_rows
from inductor_ext.tuning.search_spaces.norm import programs_per_sm

CASTINGS = ("llama", "gemma")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _out_dtype(x: Tensor, weight: Tensor | None, casting: str) -> torch.dtype:
    """HF LlamaRMSNorm returns ``weight * h.to(x.dtype)`` (promoted); Gemma returns x's dtype."""
    if weight is None or casting == "gemma":
        return x.dtype
    return torch.promote_types(x.dtype, weight.dtype)


def _scale_math(xhat: Tensor, x_dtype: torch.dtype, weight: Tensor | None, offset: float, casting: str) -> Tensor:
    if weight is None:
        return xhat
    w_eff = weight.float() + offset
    if casting == "gemma":
        return xhat * w_eff
    return xhat.to(x_dtype).float() * w_eff


def rms_norm_output(x: Tensor, rstd: Tensor, weight: Tensor | None, offset: float, casting: str) -> Tensor:
    """The normalised output from the input and its ``rstd``, as the forward computes it (to the bit):
    ``y = scale(x * rstd)``. The backend recomputes norm outputs in the backward with it."""
    y = _scale_math(x.float() * rstd.unsqueeze(-1), x.dtype, weight, offset, casting)
    return y.to(_out_dtype(x, weight, casting))


@torch.library.custom_op("fastops::recomputable_norm_output", mutates_args=())
def _recomputable_norm_output(
    y: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, offset: float, casting: str
) -> Tensor:
    """``y`` (a copy: the marker only runs if a graph keeps it, which the pass's later stages prevent)."""
    return y.clone()


@_recomputable_norm_output.register_fake
def _(y: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None, offset: float, casting: str) -> Tensor:
    return torch.empty_like(y)


def _recomputable_norm_output_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    return grad, None, None, None, None, None


_recomputable_norm_output.register_autograd(_recomputable_norm_output_backward)

RECOMPUTABLE_OUTPUT: OpOverload = torch.ops.fastops.recomputable_norm_output.default
"""``fastops::recomputable_norm_output(y, x, rstd, weight, offset, casting) -> y``: ``y`` is
``rms_norm_output(x, rstd, weight, offset, casting)``; its gradient passes to ``y`` unchanged. A marker
of the backend's norm-recompute pass (:mod:`inductor_ext.inductor.recompute_norms`), which removes it before
Inductor compiles a graph."""


@sharding_rule(RECOMPUTABLE_OUTPUT)
def _recomputable_output_sharding(
    y: Any, x: Any, rstd: Any, weight: Any, offset: float, casting: str
) -> list[Strategy]:
    """Token rows (dim 0 of y, x and rstd) sharded, the weight replicated; or everything replicated."""
    from torch.distributed.tensor import Shard

    inputs = (y, x, rstd, weight)
    return [replicated(1, inputs), ([Shard(0)], shard_inputs(0, inputs, (True, True, True, False)))]


def rms_norm_fwd_math(
    x: Tensor, weight: Tensor | None, eps: float, offset: float, casting: str
) -> tuple[Tensor, Tensor]:
    """Aten-only forward (CPU branch and the backend's decomposition), computed in fp32."""
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
    return rms_norm_output(x, rstd, weight, offset, casting), rstd


def _bwd_math_fp32(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float) -> tuple[Tensor, Tensor]:
    """dx in fp32 (rounded by the caller) and dw: dx = rstd * (g - xhat * mean(g * xhat)), dw = sum_rows(dy * xhat)."""
    xhat = x.float() * rstd.unsqueeze(-1)
    dyf = dy.float()
    g = dyf if weight is None else dyf * (weight.float() + offset)
    dx = rstd.unsqueeze(-1) * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if weight is None:
        dw = x.new_empty((0,), dtype=torch.float32)
    else:
        dw = (dyf * xhat).sum(0).to(weight.dtype)
    return dx, dw


def rms_norm_bwd_math(
    dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, casting: str
) -> tuple[Tensor, Tensor]:
    """Aten-only backward: dx = rstd * (g - xhat * mean(g * xhat)), dw = sum_rows(dy * xhat)."""
    dx, dw = _bwd_math_fp32(dy, x, weight, rstd, offset)
    return dx.to(x.dtype), dw


def add_rms_norm_fwd_math(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float, casting: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Aten-only forward of the fused residual add: h = x + residual (x's dtype), then RMSNorm of h."""
    h = x + residual
    y, rstd = rms_norm_fwd_math(h, weight, eps, offset, casting)
    return y, rstd, h


def add_rms_norm_bwd_math(
    dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, casting: str
) -> tuple[Tensor, Tensor]:
    """Aten-only backward of the fused residual add: dx = dh + (RMSNorm's dx at h), rounded once."""
    dx, dw = _bwd_math_fp32(dy, h, weight, rstd, offset)
    if dh is not None:
        dx = dx + dh.float()
    return dx.to(h.dtype), dw


def _fwd_launch(
    launch: Launch, x: Tensor, residual: Tensor | None, weight: Tensor | None, eps: float, offset: float, casting: str
) -> tuple[Tensor, Tensor, Tensor | None]:
    """y, rstd and (with a residual) h = x + residual, from one forward kernel."""
    M, N = x.shape
    y = x.new_empty((M, N), dtype=_out_dtype(x, weight, casting))
    rstd = x.new_empty((M,), dtype=torch.float32)
    h = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    launch(
        rms_norm_fwd_kernel,
        lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),),
        x, residual, weight, y, h, rstd,
        x.stride(0), 0 if residual is None else residual.stride(0), y.stride(0), 0 if h is None else h.stride(0),
        M, N, eps, offset,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, GEMMA_CASTING=casting == "gemma",
    )  # fmt: skip
    return y, rstd, h


def _bwd_launch(
    launch: Launch, dy: Tensor, dres: Tensor | None, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float,
    casting: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """dx (plus ``dres`` when given) and dw, from one backward kernel and the dw partials' sum."""
    M, N = x.shape
    dy = unit_last_stride(dy)
    dres = None if dres is None else unit_last_stride(dres)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    programs = grid_stride_programs(x.device, programs_per_sm(N))  # also the dw partial rows
    partial = x.new_empty((programs, N) if weight is not None else (0,), dtype=torch.float32)
    launch(
        rms_norm_bwd_kernel,
        lambda meta: (programs,),
        dy, x, dres, weight, rstd, dx, partial,
        dy.stride(0), x.stride(0), 0 if dres is None else dres.stride(0), dx.stride(0), M, N, offset,
        HAS_DRES=dres is not None, HAS_WEIGHT=weight is not None, GEMMA_CASTING=casting == "gemma",
    )  # fmt: skip
    return dx, sum_partial_rows(launch, partial, weight)


def rms_norm_fwd_kernels(
    launch: Launch, x: Tensor, weight: Tensor | None, eps: float, offset: float, casting: str
) -> tuple[Tensor, Tensor]:
    y, rstd, _ = _fwd_launch(launch, x, None, weight, eps, offset, casting)
    return y, rstd


def rms_norm_bwd_kernels(
    launch: Launch, dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, offset: float, casting: str
) -> tuple[Tensor, Tensor]:
    return _bwd_launch(launch, dy, None, x, weight, rstd, offset, casting)


def add_rms_norm_fwd_kernels(
    launch: Launch, x: Tensor, residual: Tensor, weight: Tensor | None, eps: float, offset: float, casting: str
) -> tuple[Tensor, Tensor, Tensor]:
    y, rstd, h = _fwd_launch(launch, x, unit_last_stride(residual), weight, eps, offset, casting)
    assert h is not None
    return y, rstd, h


def add_rms_norm_bwd_kernels(
    launch: Launch, dy: Tensor, dh: Tensor | None, h: Tensor, weight: Tensor | None, rstd: Tensor, offset: float,
    casting: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _bwd_launch(launch, dy, dh, h, weight, rstd, offset, casting)


def _setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _eps, offset, casting = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.casting = offset, casting
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, bwd: Any, dy: Tensor, _drstd: Tensor | None) -> tuple[Tensor | None, ...]:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = bwd(dy, x, weight, rstd, ctx.offset, ctx.casting)
    needs_dw = weight is not None and ctx.needs_input_grad[1]
    return dx, (dw if needs_dw else None), None, None, None


rms_norm_family = define_op_family(
    "rms_norm",
    fwd_math=rms_norm_fwd_math,
    fwd_kernels=rms_norm_fwd_kernels,
    bwd_math=rms_norm_bwd_math,
    bwd_kernels=rms_norm_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)


@sharding_rule(rms_norm_family.fwd)
def _rms_norm_fwd_sharding(x: Any, weight: Any, eps: float, offset: float, casting: str) -> list[Strategy]:
    """Token rows (dim 0 of the 2-D x the public function passes) sharded, the weight replicated."""
    from torch.distributed.tensor import Shard

    inputs = (x, weight)
    return [replicated(2, inputs), ([Shard(0), Shard(0)], shard_inputs(0, inputs, (True, False)))]


@sharding_rule(rms_norm_family.bwd)
def _rms_norm_bwd_sharding(dy: Any, x: Any, weight: Any, rstd: Any, offset: float, casting: str) -> list[Strategy]:
    """Token rows sharded, the weight replicated; dw is a partial sum over the token shards."""
    from torch.distributed.tensor import Shard

    inputs = (dy, x, weight, rstd)
    outputs = [Shard(0), weight_grad_placement(weight)]
    return [replicated(2, inputs), (outputs, shard_inputs(0, inputs, (True, True, False, True)))]


def _add_setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _x, _residual, weight, _eps, offset, casting = inputs
    _y, rstd, h = output
    ctx.save_for_backward(h, weight, rstd)
    ctx.offset, ctx.casting = offset, casting
    ctx.mark_non_differentiable(rstd)


def _add_backward(
    ctx: Any, bwd: Any, dy: Tensor | None, _drstd: Tensor | None, dh: Tensor | None
) -> tuple[Tensor | None, ...]:
    """x and residual get the same gradient: dh plus the norm's dx (dh alone if y got no gradient)."""
    h, weight, rstd = ctx.saved_tensors
    dx, dw = (dh, None) if dy is None else bwd(dy, dh, h, weight, rstd, ctx.offset, ctx.casting)
    needs_dw = weight is not None and ctx.needs_input_grad[2] and dw is not None
    return dx, dx, (dw if needs_dw else None), None, None, None


add_rms_norm_family = define_op_family(
    "add_rms_norm",
    fwd_math=add_rms_norm_fwd_math,
    fwd_kernels=add_rms_norm_fwd_kernels,
    bwd_math=add_rms_norm_bwd_math,
    bwd_kernels=add_rms_norm_bwd_kernels,
    setup_context=_add_setup_context,
    backward=_add_backward,
)


@sharding_rule(add_rms_norm_family.fwd)
def _add_rms_norm_fwd_sharding(
    x: Any, residual: Any, weight: Any, eps: float, offset: float, casting: str
) -> list[Strategy]:
    """Token rows of x and residual (and so of y, rstd and h) sharded, the weight replicated."""
    from torch.distributed.tensor import Shard

    inputs = (x, residual, weight)
    return [replicated(3, inputs), ([Shard(0)] * 3, shard_inputs(0, inputs, (True, True, False)))]


@sharding_rule(add_rms_norm_family.bwd)
def _add_rms_norm_bwd_sharding(
    dy: Any, dh: Any, h: Any, weight: Any, rstd: Any, offset: float, casting: str
) -> list[Strategy]:
    """Token rows sharded, the weight replicated; dw is a partial sum over the token shards."""
    from torch.distributed.tensor import Shard

    inputs = (dy, dh, h, weight, rstd)
    outputs = [Shard(0), weight_grad_placement(weight)]
    return [replicated(2, inputs), (outputs, shard_inputs(0, inputs, (True, True, True, False, True)))]


def _check_inputs(x: Tensor, weight: Tensor | None, eps: float, offset: float, casting: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"rms_norm: x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least 1 dimension (the normalised one), got a scalar")
    if casting not in CASTINGS:
        raise ValueError(f"rms_norm: casting must be one of {CASTINGS}, got {casting!r}")
    check_real("rms_norm", "eps", eps)
    check_real("rms_norm", "offset", offset)
    if not eps >= 0:
        raise ValueError(f"rms_norm: eps must be >= 0, got {eps}")
    if weight is None:
        return
    if not isinstance(weight, Tensor):
        raise TypeError(f"rms_norm: weight must be a Tensor or None, got {type(weight).__name__}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm: weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}; both must be on one device")


def rms_norm(
    x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"
) -> Tensor:
    """RMSNorm over the last dimension of ``x``: ``y = x / sqrt(mean(x**2) + eps) * (offset + weight)``.

    Args:
        x: float32/bfloat16/float16, any leading dims, any strides (copied if the
            last dim is not unit-stride or the leading dims cannot be flattened).
        weight: ``(N,)`` or None.
        eps: added to the mean square.
        offset: added to the weight in fp32 (Gemma: ``offset=1.0``).
        casting: ``"llama"`` (normalise in fp32, cast to x's dtype, multiply by the
            weight; output in the promoted dtype of x and weight, like HF
            ``LlamaRMSNorm``) or ``"gemma"`` (multiply in fp32, cast to x's dtype once).
    """
    _check_inputs(x, weight, eps, offset, casting)
    y, _rstd = rms_norm_family(rows_2d(x), weight, float(eps), float(offset), casting)
    return y if x.dim() == 2 else y.view(x.shape)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
    casting: str = "llama",
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``h = x + residual`` and ``rms_norm(h, weight, eps)`` in one pass: returns ``(y, h)``.

    The residual stream of a pre-norm transformer (``h = x + attn(x)``, then the MLP's norm of h,
    and h again in the next residual add). ``residual`` must match x's shape, dtype and device;
    h has x's dtype (the sum rounded once, like the eager add). Other arguments as :func:`rms_norm`.
    """
    _check_inputs(x, weight, eps, offset, casting)
    if not isinstance(residual, Tensor):
        raise TypeError(f"add_rms_norm: residual must be a Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"add_rms_norm: residual must match x (shape {tuple(x.shape)}, {x.dtype}, {x.device}), "
            f"got shape {tuple(residual.shape)}, {residual.dtype}, {residual.device}"
        )
    y, _rstd, h = add_rms_norm_family(rows_2d(x), rows_2d(residual), weight, float(eps), float(offset), casting)
    return (y, h) if x.dim() == 2 else (y.view(x.shape), h.view(x.shape))


def rms_norm_ref(
    x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama"
) -> Tensor:
    """Plain-PyTorch RMSNorm, the HF spelling (differentiable). With float64 inputs it is the exact reference."""
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(x.dtype)
    if casting == "gemma":
        return (h * (offset + weight.to(compute))).to(x.dtype)
    if offset == 0.0:
        return weight * h.to(x.dtype)
    return (h.to(x.dtype).to(compute) * (offset + weight.to(compute))).to(_out_dtype(x, weight, casting))


def add_rms_norm_ref(
    x: Tensor, residual: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
    casting: str = "llama",
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Plain-PyTorch :func:`add_rms_norm`, the unfused HF spelling: the residual add, then
    :func:`rms_norm_ref` of the sum; ``(y, h)``."""
    h = x + residual
    return rms_norm_ref(h, weight, eps, offset=offset, casting=casting), h


__all__ = [
    "add_rms_norm", "add_rms_norm_family", "add_rms_norm_ref", "rms_norm", "rms_norm_family", "rms_norm_output",
    "rms_norm_ref",
]  # fmt: skip

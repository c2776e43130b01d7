"""LayerNorm: ``torch.ops.fastops.layer_norm_fwd`` / ``layer_norm_bwd`` and :func:`layer_norm`.

Schemas::

    fastops::layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps)
        -> (Tensor y, Tensor mean, Tensor rstd)
    fastops::layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd)
        -> (Tensor dx, Tensor dw, Tensor db)

``x`` is 2-D ``(M, N)`` (the public function flattens leading dims before the
autograd boundary); ``y`` has x's dtype; ``mean`` and ``rstd`` are fp32 ``(M,)``.
``dw`` and ``db`` have the weight's and the bias's dtype, or shape ``(0,)`` when
that parameter is absent. The backward takes ``bias`` only for its presence and
dtype (it does not read it). The math is in the docstring of
:mod:`inductor_ext.kernels.layer_norm`.
"""

from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.layer_norm import (
    layer_norm_bwd_kernel,
    layer_norm_bwd_param_grads_kernel,
    layer_norm_fwd_kernel,
)
from inductor_ext.library.launch import Launch, grid_stride_programs
from inductor_ext.library.registration import define_op_family
from inductor_ext.library.sharding import Strategy, replicated, shard_inputs, sharding_rule, weight_grad_placement
from inductor_ext.ops._arguments import check_real
from inductor_ext.ops._layout import rows_2d, unit_last_stride
from inductor_ext.ops._reduce import sum_partial_rows
from inductor_ext.tuning.search_spaces.norm import programs_per_sm

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_norm_fwd_math(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Aten-only forward (CPU branch and the backend's decomposition), computed in fp32."""
    xf = x.float()
    var, mean = torch.var_mean(xf, dim=-1, correction=0)
    rstd = torch.rsqrt(var + eps)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd_math(
    dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Aten-only backward: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w;
    dw = sum_rows(dy * xhat), db = sum_rows(dy)."""
    xhat = (x.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    dyf = dy.float()
    g = dyf if weight is None else dyf * weight.float()
    dx = rstd.unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = x.new_empty((0,), dtype=torch.float32) if weight is None else (dyf * xhat).sum(0).to(weight.dtype)
    db = x.new_empty((0,), dtype=torch.float32) if bias is None else dyf.sum(0).to(bias.dtype)
    return dx.to(x.dtype), dw, db


def layer_norm_fwd_kernels(
    launch: Launch, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    x = unit_last_stride(x)
    weight = None if weight is None else unit_last_stride(weight)
    bias = None if bias is None else unit_last_stride(bias)
    M, N = x.shape
    y = x.new_empty((M, N))
    mean = x.new_empty((M,), dtype=torch.float32)
    rstd = x.new_empty((M,), dtype=torch.float32)
    launch(
        layer_norm_fwd_kernel,
        lambda meta: (triton.cdiv(M, meta["BLOCK_M"]),),
        x, weight, bias, y, mean, rstd, x.stride(0), y.stride(0), M, N, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y, mean, rstd


TWO_PASS_BACKWARD_MIN_N = 16384
"""Rows at least this long take the two-pass backward (:func:`_param_grad_partials`): there the one-kernel
backward's whole-row dw/db accumulators spill (ptxas, sm_90, at N = 16384) and the two-pass one is
faster; below it the one-kernel backward does not spill and is faster."""


def layer_norm_bwd_kernels(
    launch: Launch, dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    x, dy, mean, rstd = unit_last_stride(x), unit_last_stride(dy), unit_last_stride(mean), unit_last_stride(rstd)
    weight = None if weight is None else unit_last_stride(weight)
    M, N = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    two_pass = N >= TWO_PASS_BACKWARD_MIN_N
    programs = grid_stride_programs(x.device, programs_per_sm(N))  # also the dw/db partial rows
    partial_rows = 0 if two_pass else programs
    dw_partial, db_partial = _partials(x, partial_rows, weight), _partials(x, partial_rows, bias)
    launch(
        layer_norm_bwd_kernel,
        lambda meta: (programs,),
        dy, x, weight, mean, rstd, dx, dw_partial, db_partial, dy.stride(0), x.stride(0), dx.stride(0), M, N,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, PARAM_GRADS=not two_pass,
    )  # fmt: skip
    if two_pass:
        dw_partial, db_partial = _param_grad_partials(launch, dy, x, weight, bias, mean, rstd)
    return dx, sum_partial_rows(launch, dw_partial, weight), sum_partial_rows(launch, db_partial, bias)


def _partials(x: Tensor, rows: int, param: Tensor | None) -> Tensor:
    """fp32 ``(rows, N)`` partial sums of ``param``'s gradient, or an empty placeholder without ``param``."""
    return x.new_empty((rows, x.shape[1]) if param is not None else (0,), dtype=torch.float32)


def _param_grad_partials(
    launch: Launch, dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    """The two-pass backward's second pass: dw and db partials ``(groups, N)``, each group of rows
    reduced in column tiles (:func:`layer_norm_bwd_param_grads_kernel`), x and dy read again.
    About 4 programs per SM at 256-column tiles (twice that at 128), each group at least 16 rows."""
    M, N = x.shape
    groups = max(1, min(triton.cdiv(M, 16), grid_stride_programs(x.device, 4) // triton.cdiv(N, 256)))
    dw_partial, db_partial = _partials(x, groups, weight), _partials(x, groups, bias)
    if weight is not None or bias is not None:
        launch(
            layer_norm_bwd_param_grads_kernel,
            lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), groups),
            dy, x, mean, rstd, dw_partial, db_partial, dy.stride(0), x.stride(0), M, N,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        )  # fmt: skip
    return dw_partial, db_partial


def _setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, weight, bias, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)


def _backward(
    ctx: Any, bwd: Any, dy: Tensor, _dmean: Tensor | None, _drstd: Tensor | None
) -> tuple[Tensor | None, ...]:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd(dy, x, weight, bias, mean, rstd)
    needs_dw = weight is not None and ctx.needs_input_grad[1]
    needs_db = bias is not None and ctx.needs_input_grad[2]
    return dx, (dw if needs_dw else None), (db if needs_db else None), None


layer_norm_family = define_op_family(
    "layer_norm",
    fwd_math=layer_norm_fwd_math,
    fwd_kernels=layer_norm_fwd_kernels,
    bwd_math=layer_norm_bwd_math,
    bwd_kernels=layer_norm_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)


@sharding_rule(layer_norm_family.fwd)
def _layer_norm_fwd_sharding(x: Any, weight: Any, bias: Any, eps: float) -> list[Strategy]:
    """Token rows (dim 0 of the 2-D x the public function passes) sharded, weight and bias replicated."""
    from torch.distributed.tensor import Shard

    inputs = (x, weight, bias)
    return [replicated(3, inputs), ([Shard(0)] * 3, shard_inputs(0, inputs, (True, False, False)))]


@sharding_rule(layer_norm_family.bwd)
def _layer_norm_bwd_sharding(dy: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any) -> list[Strategy]:
    """Token rows sharded, weight and bias replicated; dw and db are partial sums over the token shards."""
    from torch.distributed.tensor import Shard

    inputs = (dy, x, weight, bias, mean, rstd)
    outputs = [Shard(0), weight_grad_placement(weight), weight_grad_placement(bias)]
    return [replicated(3, inputs), (outputs, shard_inputs(0, inputs, (True, True, False, False, True, True)))]


def _check_param(name: str, param: Tensor | None, x: Tensor) -> None:
    if param is None:
        return
    if not isinstance(param, Tensor):
        raise TypeError(f"layer_norm: {name} must be a Tensor or None, got {type(param).__name__}")
    if param.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"layer_norm: {name} must be float32, bfloat16 or float16, got {param.dtype}")
    if param.shape != x.shape[-1:]:
        raise ValueError(
            f"layer_norm: {name} must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(param.shape)}"
        )
    if param.device != x.device:
        raise ValueError(f"layer_norm: {name} is on {param.device} but x is on {x.device}; both must be on one device")


def _check_inputs(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"layer_norm: x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"layer_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("layer_norm: x must have at least 1 dimension (the normalised one), got a scalar")
    check_real("layer_norm", "eps", eps)
    if not eps >= 0:
        raise ValueError(f"layer_norm: eps must be >= 0, got {eps}")
    _check_param("weight", weight, x)
    _check_param("bias", bias, x)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension of ``x``: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

    The semantics of ``torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)``:
    biased variance, statistics and affine in fp32, output in x's dtype.

    Args:
        x: float32/bfloat16/float16, any leading dims, any strides (copied if the
            last dim is not unit-stride or the leading dims cannot be flattened).
        weight: ``(N,)`` or None (no scale). Its dtype may differ from x's (e.g. fp32
            parameters with bf16 activations); its gradient has its dtype.
        bias: ``(N,)`` or None (no shift); as ``weight``.
        eps: added to the variance.
    """
    _check_inputs(x, weight, bias, eps)
    y, _mean, _rstd = layer_norm_family(rows_2d(x), weight, bias, float(eps))
    return y if x.dim() == 2 else y.view(x.shape)


def layer_norm_ref(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Plain-PyTorch LayerNorm over the last dim (differentiable); with float64 inputs, the exact reference.

    Computes in ``promote_types(x.dtype, float32)`` and rounds once to x's dtype, as
    ``torch.nn.functional.layer_norm`` does.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x.to(compute)
    centred = h - h.mean(-1, keepdim=True)
    h = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = h * weight.to(compute)
    if bias is not None:
        h = h + bias.to(compute)
    return h.to(x.dtype)


__all__ = ["layer_norm", "layer_norm_family", "layer_norm_ref"]

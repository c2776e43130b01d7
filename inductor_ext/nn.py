"""Drop-in ``nn.Module`` s calling the fastops functional ops."""

from typing import overload

import torch
from torch import Tensor

from inductor_ext.ops.cross_entropy import cross_entropy
from inductor_ext.ops.fused_linear_cross_entropy import WeightGradAccumulation, fused_linear_cross_entropy
from inductor_ext.ops.layer_norm import layer_norm
from inductor_ext.ops.rms_norm import add_rms_norm, rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same constructor and ``weight`` parameter) running :func:`inductor_ext.rms_norm`,
    or :func:`inductor_ext.add_rms_norm` when called with a ``residual``.

    Loads ``torch.nn.RMSNorm`` and HF ``LlamaRMSNorm`` state dicts (both hold one
    ``weight``). ``eps=None`` means 1e-6 (HF's default; ``torch.nn.RMSNorm``
    would use ``finfo(dtype).eps``). ``offset=1.0, casting="gemma"`` gives
    ``GemmaRMSNorm`` (whose checkpoints store ``w`` for ``1 + w``; build it
    with ``weight`` initialised to zeros to match a fresh Gemma module).
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        offset: float = 0.0,
        casting: str = "llama",
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"RMSNorm: normalized_shape must be one dimension, got {self.normalized_shape}")
        self.offset = offset
        self.casting = casting

    @overload
    def forward(self, x: Tensor, residual: None = None) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(h), h)`` for ``h = x + residual`` in one kernel
        (:func:`inductor_ext.add_rms_norm`; vLLM's ``RMSNorm`` convention)."""
        eps = 1e-6 if self.eps is None else self.eps
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, eps, offset=self.offset, casting=self.casting)
        return rms_norm(x, self.weight, eps, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, offset={self.offset}, casting={self.casting!r}"


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same constructor, parameters and state dicts) running :func:`inductor_ext.layer_norm`.

    ``elementwise_affine=False`` (no parameters) and ``bias=False`` (weight only) are
    supported. A ``normalized_shape`` of several dims normalises over x's flattened
    trailing dims, with the weight and bias flattened alike (the same math).
    """

    def forward(self, x: Tensor) -> Tensor:
        dims = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - dims :]) != self.normalized_shape:
            raise ValueError(
                f"LayerNorm: x's trailing dims must be normalized_shape {self.normalized_shape}, "
                f"got x of shape {tuple(x.shape)}"
            )
        if dims == 1:
            return layer_norm(x, self.weight, self.bias, self.eps)
        flat = [None if p is None else p.flatten() for p in (self.weight, self.bias)]
        return layer_norm(x.flatten(x.dim() - dims), flat[0], flat[1], self.eps).view(x.shape)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` (classes in the last dimension) running :func:`inductor_ext.cross_entropy`.

    Takes torch's constructor without class weights (``weight`` must be None), plus
    ``lse_square_scale`` (z-loss), ``softcap`` and ``inplace_backward``. The loss is
    float32 whatever the logits' dtype.
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        inplace_backward: bool = False,
    ) -> None:
        if weight is not None:
            raise ValueError("CrossEntropyLoss: class weights are not supported (weight must be None)")
        super().__init__(None, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.inplace_backward = inplace_backward

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return cross_entropy(
            logits,
            labels,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale,
            softcap=self.softcap,
            inplace_backward=self.inplace_backward,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, inplace_backward={self.inplace_backward}"
        )


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without the ``(N, V)`` logits, via
    :func:`inductor_ext.fused_linear_cross_entropy`. Holds no parameters: pass the LM head's
    ``weight`` (and ``bias``) to ``forward``."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        lse_square_scale: float = 0.0,
        softcap: float | None = None,
        chunk_size: int | None = None,
        memory_budget_bytes: int | None = None,
        weight_grad_accumulation: WeightGradAccumulation = "fp32",
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.chunk_size = chunk_size
        self.memory_budget_bytes = memory_budget_bytes
        self.weight_grad_accumulation = weight_grad_accumulation

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None) -> Tensor:
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale,
            softcap=self.softcap,
            chunk_size=self.chunk_size,
            memory_budget_bytes=self.memory_budget_bytes,
            weight_grad_accumulation=self.weight_grad_accumulation,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, chunk_size={self.chunk_size}, "
            f"memory_budget_bytes={self.memory_budget_bytes}"
        )

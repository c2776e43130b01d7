"""Float32-accurate GEMMs on bf16 tensor cores, for products of a bf16 tensor and a float32 one.

PEFT keeps LoRA adapters in float32 over a bf16 base, so the rank-r products (``x Aᵀ``, ``dy B``)
and the adapters' gradients (``dyᵀ · xa``, ``gᵀ · x``) are GEMMs of a bf16 operand (``x``, ``dy``)
and a float32 one. As float32 GEMMs they run on CUDA cores (no TF32 unless the user allows it), at a
small fraction of tensor-core throughput, and take a visible share of a LoRA step's GPU time. Here they
run on tensor cores with the same accuracy.

The float32 operand ``F`` splits exactly into three bf16 parts (each bf16 holds 8 significant bits,
float32 24)::

    F₁ = bf16(F),  F₂ = bf16(F − F₁),  F₃ = bf16(F − F₁ − F₂),   F = F₁ + F₂ + F₃ (to float32's rounding)

and the product of two bf16 numbers is exact in float32 (8 + 8 bits). So with ``B`` in bf16::

    B · F = B · F₁ + B · F₂ + B · F₃

is a sum of exact products accumulated in float32: what a float32 GEMM computes, up to the order of
the additions. The three parts are concatenated along the dimension that is not reduced, so the three
products are one bf16 GEMM with a float32 output (``torch.mm(..., out_dtype=torch.float32)``) that
reads the bf16 operand once; its rank-r side is three times as wide, which a memory-bound rank-16 GEMM
does not notice. Then the three blocks are summed.

Only on CUDA (aten's ``mm`` with ``out_dtype`` is CUDA's) and for bf16: float16's exponent range is too
narrow for the parts (``F₃`` would fall into its subnormals). Elsewhere :func:`float32_mm` is the float32
GEMM it stands for.
"""

from collections.abc import Callable

import torch
from torch import Tensor

PARTS = 3
"""bf16 parts of a float32 operand: 3 × 8 significant bits cover float32's 24."""

Mm16 = Callable[[Tensor, Tensor], Tensor]
"""``(a, b) -> a @ b``: 16-bit operands, float32 accumulation and output."""


def _tensor_core_mm(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


def split_bf16(t: Tensor) -> list[Tensor]:
    """The :data:`PARTS` bf16 tensors whose float32 sum is ``t`` (float32) to float32's rounding."""
    parts, rest = [], t
    for _ in range(PARTS):
        part = rest.to(torch.bfloat16)
        parts.append(part)
        rest = rest - part.float()
    return parts


def split_mm(a: Tensor, b: Tensor, mm16: Mm16 = _tensor_core_mm) -> Tensor:
    """``a @ b`` in float32 for a bf16 and a float32 2-D operand (either side), as three bf16 products
    in one ``mm16`` call (module docstring)."""
    if a.dtype == torch.float32:  # (N, k) float32 left: its parts stacked along N
        rows = a.shape[0]
        return mm16(torch.cat(split_bf16(a)), b).view(PARTS, rows, -1).sum(0)
    cols = b.shape[1]  # (k, M) float32 right: its parts side by side along M
    return mm16(a, torch.cat(split_bf16(b), dim=1)).view(-1, PARTS, cols).sum(1)


def float32_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` to float32 accuracy, in float32, for 2-D ``a`` and ``b`` each bf16, float16 or float32
    (16-bit operands are exact in float32): on bf16 tensor cores when one is bf16 and the other float32
    on CUDA (:func:`split_mm`), as a float32 GEMM otherwise."""
    if _splits(a, b):
        return split_mm(a, b)
    return a.float() @ b.float()


def _splits(a: Tensor, b: Tensor) -> bool:
    return a.is_cuda and {a.dtype, b.dtype} == {torch.bfloat16, torch.float32}


def float32_mm_upcasts(a: Tensor, b: Tensor) -> bool:
    """Whether :func:`float32_mm` of ``a`` and ``b`` reads a 16-bit operand through a float32 copy."""
    return not _splits(a, b) and torch.float32 in (a.dtype, b.dtype) and a.dtype != b.dtype

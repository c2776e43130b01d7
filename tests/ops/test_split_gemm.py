"""Float32-accurate GEMMs from bf16 parts (:mod:`inductor_ext.ops._split_gemm`), checked on CPU with the
tensor-core GEMM modelled exactly: bf16 products are exact in float32, accumulated in float32."""

import pytest
import torch

from inductor_ext.ops._split_gemm import PARTS, float32_mm, split_bf16, split_mm


def _tensor_core_model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.dtype == b.dtype == torch.bfloat16
    return a.float() @ b.float()


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_three_bf16_parts_hold_a_float32_tensor():
    t = torch.randn(4096) * torch.logspace(-6, 6, 4096)
    parts = split_bf16(t)
    assert len(parts) == PARTS and all(p.dtype == torch.bfloat16 for p in parts)
    total = parts[0].double() + parts[1].double() + parts[2].double()
    assert ((total - t.double()).abs() <= t.double().abs() * 2.0**-24).all()
    assert (parts[0].float() - t).abs().max() > 0  # one bf16 alone is not enough


@pytest.mark.parametrize("side", ["float32_right", "float32_left"])
def test_split_product_is_as_accurate_as_a_float32_gemm(side):
    """x (bf16) times an adapter (float32, right: x Aᵀ, dy B) or a float32 gradient times x (left: gᵀ x)."""
    torch.manual_seed(0)
    exact = torch.randn(512, 384).bfloat16()
    if side == "float32_right":
        a, b = exact, torch.randn(384, 16) / 20
    else:
        a, b = torch.randn(16, 512), exact
    ref = a.double() @ b.double()
    ours = split_mm(a, b, _tensor_core_model)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    float32_gemm = _err(a.float() @ b.float(), ref)
    assert _err(ours, ref) <= 2 * float32_gemm + 1e-7
    # a single bf16 rounding of the float32 operand is three orders worse: the split is what helps
    one_part = a.bfloat16().float() @ b.bfloat16().float()
    assert _err(one_part, ref) > 100 * _err(ours, ref)


def test_float32_mm_off_cuda_is_the_float32_gemm():
    a, b = torch.randn(64, 32).bfloat16(), torch.randn(32, 8)
    assert torch.equal(float32_mm(a, b), a.float() @ b)
    assert torch.equal(float32_mm(b.t(), a.t()), b.t() @ a.t().float())

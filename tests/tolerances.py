"""Relative-error bounds (‖out − ref‖ / ‖ref‖ against float64), in one place.

Under the Triton interpreter a float32 → bf16/fp16 cast truncates instead of
rounding to nearest, which doubles the error of every reduced-precision store;
the bounds below allow for that (on the GPU, tests/gpu holds our kernels to
the error of ``torch.compile`` of the reference instead).
"""

import torch

from benchmarks.harness import rel_err

__all__ = ["OUTPUT", "chunk_rounded_grad", "reduced_grad", "rel_err", "shifted_mean_output"]

# per element: a handful of roundings of the output type
OUTPUT = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def reduced_grad(dtype: torch.dtype, rows: int) -> float:
    """dW sums `rows` products in fp32 and is rounded once to `dtype`.

    fp32 accumulation adds about sqrt(rows) * 2^-24 relative error on random data;
    the final rounding adds the output type's unit roundoff (doubled for truncation).
    """
    return OUTPUT[dtype] + 4 * rows**0.5 * 2.0**-24


def chunk_rounded_grad(dtype: torch.dtype, rows: int, chunks: int) -> float:
    """dW summed over `chunks` chunks in `dtype` itself (fused linear cross-entropy's
    ``weight_grad_accumulation="weight_dtype"``, Liger-Kernel's numerics).

    Each chunk's GEMM adds its product to the running sum S_k in fp32 and rounds the sum
    once: an error of at most u·|S_k| per element (u = eps/2, round to nearest). The
    roundings are independent with mean zero, so they add in quadrature:
    ‖err‖² ≤ u² Σ_k ‖S_k‖², which for partial sums of random chunks (‖S_k‖² ≈ k/K ‖S‖²)
    is u² (K + 1)/2 ‖S‖². Bound: u·sqrt(K), which leaves room for partial sums larger
    than the total, on top of :func:`reduced_grad`'s rounding of the gradient that both
    modes share. (Measured, bf16, 128 chunks: 0.010 against this bound's 0.059; the
    exact fp32 accumulation: 0.004.)
    """
    return reduced_grad(dtype, rows) + torch.finfo(dtype).eps / 2 * chunks**0.5


def shifted_mean_output(mean_over_std: float) -> float:
    """fp32 output of a centring normalisation (LayerNorm) on rows whose mean is ``mean_over_std`` stds.

    Even a correctly rounded fp32 mean is off by up to half a unit in the last place
    (``mean_over_std * 2^-24`` stds; one or two units once summed), and every
    centred value carries that error.
    """
    return OUTPUT[torch.float32] + 2 * mean_over_std * 2.0**-24

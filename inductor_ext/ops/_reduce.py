"""Shared launch of :func:`~inductor_ext.kernels.reduce.sum_rows_kernel`: parameter gradients
(dW, dB) from the per-program fp32 partial rows a backward kernel wrote."""

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.reduce import (
    SUM_ROWS_BLOCK_N,
    SUM_ROWS_BLOCK_R,
    sum_rows_kernel,
)
from inductor_ext.ops._launch import Launch


def sum_partial_rows(launch: Launch, partial: Tensor, param: Tensor | None) -> Tensor:
    """Column sums of the ``(programs, N)`` fp32 ``partial`` in ``param``'s dtype and shape;
    ``partial`` itself (the empty placeholder) when there is no ``param``."""
    if param is None:
        return partial
    programs, n = partial.shape
    out = torch.empty_like(param, memory_format=torch.contiguous_format)
    # the interpreter runs programs one after another: fewer, wider ones there
    block_n = SUM_ROWS_BLOCK_N if partial.device.type == "cuda" else 4096
    launch(sum_rows_kernel, lambda meta: (triton.cdiv(n, block_n),), partial, out, programs, n,
           BLOCK_R=SUM_ROWS_BLOCK_R, BLOCK_N=block_n)  # fmt: skip
    return out

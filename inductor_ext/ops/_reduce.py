"""Shared launch of :func:`~inductor_ext.kernels.reduce.sum_rows_kernel`: parameter gradients
(dW, dB) from the per-program fp32 partial rows a backward kernel wrote."""

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.reduce import sum_rows_kernel, sum_rows_tuned_kernel
from inductor_ext.library.launch import Launch

INTERPRETER_BLOCK_N = 4096


def sum_partial_rows(launch: Launch, partial: Tensor, param: Tensor | None) -> Tensor:
    """Column sums of the ``(programs, N)`` fp32 ``partial`` in ``param``'s dtype and shape;
    ``partial`` itself (the empty placeholder) when there is no ``param``."""
    if param is None:
        return partial
    programs, n = partial.shape
    out = torch.empty_like(param, memory_format=torch.contiguous_format)
    if partial.device.type == "cuda":
        launch(sum_rows_tuned_kernel, lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),), partial, out, programs, n)
    else:  # the interpreter runs programs one after another: fewer, wider ones there
        launch(sum_rows_kernel, lambda meta: (triton.cdiv(n, INTERPRETER_BLOCK_N),), partial, out, programs, n,
               BLOCK_R=16, BLOCK_N=INTERPRETER_BLOCK_N)  # fmt: skip
    return out

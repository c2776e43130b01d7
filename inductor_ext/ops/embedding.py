"""Embedding lookup whose backward writes the weight gradient in one pass (``fastops::embedding_fwd``/``_bwd``).

The forward is ``F.embedding`` (a gather; no kernel of ours). The backward's dense ``(V, H)`` gradient is
the sum of the output gradient's rows per token id. Inductor's code for it (its decomposition of
``aten.embedding_dense_backward``) zero-fills an fp32 ``(V, H)`` buffer, adds the rows into it with
atomics and converts it to the weight's dtype: 10 bytes moved per weight element in bf16 (written 4, read
4, written 2: 2.6 GB at Llama-3.2-1B's 128256 × 2048), and last bits that vary from run to run. Our kernel
(:mod:`inductor_ext.kernels.embedding`) sorts the token rows by id, finds each id's run by binary search,
zero-fills the gradient in the weight's dtype (2 bytes an element in bf16: 0.5 GB there) and writes the
rows of the ids that occur, each the fp32 sum of its run rounded once: for a given launch config the same
bits on every run.

Under the ``fastops_inductor`` backend, ``F.embedding`` calls (HF's ``nn.Embedding``) without
``max_norm``, ``scale_grad_by_freq`` or ``sparse`` become this op, and route timing picks our kernel or
Inductor's code for the backward.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

from inductor_ext.kernels.embedding import embedding_bwd_kernel, embedding_bwd_tuned_kernel
from inductor_ext.ops._launch import Launch
from inductor_ext.ops._library import define_op_family

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRETER_BLOCKS = {"BLOCK_H": 1024, "BLOCK_T": 16}
"""The interpreter runs programs one after another: wide ones there."""


def embedding_fwd_math(weight: Tensor, token_ids: Tensor, padding_idx: int) -> Tensor:
    return F.embedding(token_ids, weight, None if padding_idx < 0 else padding_idx)


def embedding_bwd_math(dy: Tensor, token_ids: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    """Aten's dense backward (Inductor decomposes it: an fp32 buffer, atomic adds, a cast)."""
    return torch.ops.aten.embedding_dense_backward(dy, token_ids, num_weights, padding_idx, False)


def embedding_bwd_kernels(launch: Launch, dy: Tensor, token_ids: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    """dW[v] = the fp32 sum of ``dy``'s rows of id ``v``, rounded once; 0 for ``padding_idx``."""
    hidden = dy.shape[-1]
    rows = dy.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    flat_ids = token_ids.reshape(-1)
    dw = torch.zeros((num_weights, hidden), dtype=dy.dtype, device=dy.device)
    if flat_ids.numel() == 0:
        return dw
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    run_ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    args = (rows, sorted_ids, order, run_ends, dw, hidden, rows.stride(0), padding_idx)
    on_gpu = dy.device.type == "cuda"

    def grid(meta: dict[str, Any]) -> tuple[int, int]:
        return flat_ids.numel(), triton.cdiv(hidden, (meta if on_gpu else INTERPRETER_BLOCKS)["BLOCK_H"])

    if on_gpu:
        launch(embedding_bwd_tuned_kernel, grid, *args)
    else:
        launch(embedding_bwd_kernel, grid, *args, **INTERPRETER_BLOCKS)
    return dw


def _setup_context(ctx: Any, inputs: Sequence[Any], output: Tensor) -> None:
    weight, token_ids, ctx.padding_idx = inputs
    ctx.num_weights = weight.shape[0]
    ctx.save_for_backward(token_ids)


def _backward(ctx: Any, bwd: Any, dy: Tensor | None) -> tuple[Tensor | None, ...]:
    (token_ids,) = ctx.saved_tensors
    if dy is None or not ctx.needs_input_grad[0]:
        return None, None, None
    return bwd(dy, token_ids, ctx.num_weights, ctx.padding_idx), None, None


embedding_family = define_op_family(
    "embedding",
    fwd_math=embedding_fwd_math,
    fwd_kernels=None,
    bwd_math=embedding_bwd_math,
    bwd_kernels=embedding_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)


def embedding(token_ids: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """``F.embedding(token_ids, weight, padding_idx)`` whose weight gradient our kernel writes in one pass.

    Args:
        token_ids: integer ids in ``[0, V)``, any shape.
        weight: ``(V, H)`` float32/bfloat16/float16.
        padding_idx: an id whose row gets no gradient (negative: counted from ``V``), or None.

    The gradient (on CUDA, and on CPU under Triton's interpreter) is each row's fp32 sum of its tokens'
    gradients rounded once to the weight's dtype, with the same bits on every run for a given launch
    config (Inductor's code for it adds with atomics).
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"embedding: weight must be a 2-D (V, H) tensor, got {_describe(weight)}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"embedding: weight must be float32, bfloat16 or float16, got {weight.dtype}")
    if not isinstance(token_ids, Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"embedding: token_ids must be an int64 or int32 tensor, got {_describe(token_ids)}")
    if token_ids.device != weight.device:
        raise ValueError(f"embedding: token_ids are on {token_ids.device} but weight is on {weight.device}")
    num_weights = weight.shape[0]
    if padding_idx is not None and not -num_weights <= padding_idx < num_weights:
        raise ValueError(f"embedding: padding_idx must be in [-{num_weights}, {num_weights}), got {padding_idx}")
    index = -1 if padding_idx is None else padding_idx % num_weights
    return embedding_family(weight, token_ids.long(), index)


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__

"""Embedding lookup whose backward is aten's sort-based kernel, kept out of Inductor's decomposition
(``fastops::embedding_fwd``/``_bwd``).

The forward is ``F.embedding`` (a gather). The backward's dense ``(V, H)`` gradient is the sum of the
output gradient's rows per token id. Inductor lowers ``aten.embedding_dense_backward`` on CUDA through
its decomposition: an fp32 ``(V, H)`` buffer zero-filled, the rows added into it with atomics, a cast to
the weight's dtype (10 bytes moved per weight element in bf16: 2.6 GB at Llama-3.2-1B's 128256 × 2048),
with last bits that vary from run to run. Aten's own CUDA kernel zero-fills the gradient in the weight's
dtype, sorts the ids and sums each id's rows in fp32 in a fixed order (the same bits on every run). Aten's
kernel is faster than Inductor's decomposition at LLM vocabularies and than a Triton kernel of the same
sort-and-sum (``python -m benchmarks embedding``), so it is the kernel route.

The op's ``kernel`` route is therefore aten's kernel behind an opaque custom op
(``fastops::embedding_dense_backward_aten``), which Inductor calls as it is; under the ``fastops_inductor``
backend, ``F.embedding`` calls (HF's ``nn.Embedding``) with a trainable weight, without ``max_norm``,
``scale_grad_by_freq`` or ``sparse``, become this op, and route timing picks aten's kernel or Inductor's
decomposition for the backward.
"""

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from inductor_ext.library.launch import Launch
from inductor_ext.library.registration import define_op_family

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def embedding_fwd_math(weight: Tensor, token_ids: Tensor, padding_idx: int) -> Tensor:
    return F.embedding(token_ids, weight, None if padding_idx < 0 else padding_idx)


def embedding_bwd_math(dy: Tensor, token_ids: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    """Aten's dense backward, as a graph sees it (Inductor decomposes it: an fp32 buffer, atomic adds, a cast)."""
    return torch.ops.aten.embedding_dense_backward(dy, token_ids, num_weights, padding_idx, False)


@torch.library.custom_op("fastops::embedding_dense_backward_aten", mutates_args=())
def embedding_dense_backward_aten(dy: Tensor, token_ids: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    """:func:`embedding_bwd_math` behind an op Inductor does not decompose (a compiled graph calls aten's kernel)."""
    return embedding_bwd_math(dy, token_ids, num_weights, padding_idx)


@embedding_dense_backward_aten.register_fake
def _(dy: Tensor, token_ids: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    return dy.new_empty((num_weights, dy.shape[-1]))


def embedding_bwd_kernels(launch: Launch, dy: Tensor, token_ids: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    """Aten's kernel (sorted ids, fp32 sums per id, no atomics), opaque to Inductor; ``launch`` is unused
    (no Triton kernel of ours)."""
    del launch
    return embedding_dense_backward_aten(dy, token_ids, num_weights, padding_idx)


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
    """``F.embedding(token_ids, weight, padding_idx)`` whose weight gradient aten's sort-based kernel
    writes, also under ``torch.compile`` (where Inductor would otherwise decompose it).

    Args:
        token_ids: integer ids in ``[0, V)``, any shape.
        weight: ``(V, H)`` float32/bfloat16/float16.
        padding_idx: an id whose row gets no gradient (negative: counted from ``V``), or None.

    On CUDA the gradient is each row's fp32 sum of its tokens' gradients rounded once to the weight's
    dtype, with the same bits on every run (Inductor's code for it adds with atomics).
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

"""Decode attention: ``torch.ops.fastops.decode_attention`` and :func:`decode_attention`.

Schema::

    fastops::decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor

``query`` ``(b, heads, t, d)``: the new tokens (one a row at a decode step, the prompt at a prefill); ``key``/``value``
``(b, kv_heads, s, d)``: a KV cache (``heads`` a multiple of ``kv_heads``: grouped-query attention, the
cache's own heads, never repeated); ``mask`` ``(b, t, s)`` bool, True where token ``i`` of row ``b``
sees slot ``j``. Returns ``(b, heads, t, d)`` in ``query``'s dtype: SDPA's result for
``enable_gqa=True`` and that boolean mask, except that a token with no visible slot gets zeros (SDPA:
NaN). Inference only: there is no backward. Any strides with a unit last one. The math and the split
over the cache are in :mod:`inductor_ext.kernels.decode_attention`.

The kernels read every visible key and value once per group of query heads. One token gets many splits
of the cache (flash-decoding); a prompt one split, with the causal triangle skipped tile by tile. So one
graph serves prefill and decode with no branch on the token count.
"""

import math

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.decode_attention import (
    DOT_ROWS,
    KEYS_PER_SPLIT,
    MAX_HEAD_DIM,
    decode_attention_combine_kernel,
    decode_attention_partial_kernel,
    decode_attention_partial_sum_kernel,
)
from inductor_ext.library.launch import Launch, interpreter_enabled
from inductor_ext.library.registration import define_inference_op
from inductor_ext.ops._layout import unit_last_stride

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

COMBINE_SPLITS = 64
"""Splits the combine kernel merges per iteration."""


def decode_attention_math(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Aten-only :func:`decode_attention` (the CPU branch and the reference, in float32 or wider)."""
    work = torch.promote_types(query.dtype, torch.float32)
    group = query.shape[1] // key.shape[1]
    keys = key.to(work).repeat_interleave(group, dim=1)
    values = value.to(work).repeat_interleave(group, dim=1)
    scores = (query.to(work) @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a token with no visible slot: zeros
    return (weights @ values).to(query.dtype)


def decode_attention_kernels(
    launch: Launch, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float
) -> Tensor:
    query, key, value, mask = (unit_last_stride(t) for t in (query, key, value, mask))
    batch, heads, tokens, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = heads // kv_heads
    # symbolic under export (a traced token count): Max and FloorDiv, no branch on the sizes
    splits = torch.sym_max(1, triton.cdiv(slots, KEYS_PER_SPLIT) // tokens)
    keys_per_split = triton.cdiv(triton.cdiv(slots, splits), KEYS_PER_SPLIT) * KEYS_PER_SPLIT
    device = query.device
    part_max = torch.empty((batch, heads, tokens, splits), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((batch, heads, tokens, splits, head_dim), dtype=torch.float32, device=device)
    use_dot = query.dtype != torch.float32 and not interpreter_enabled()
    group_pad = triton.next_power_of_2(group)
    block_t = max(1, DOT_ROWS // group_pad) if use_dot else 1
    d_pad = max(16, triton.next_power_of_2(head_dim))
    kernel = decode_attention_partial_kernel if use_dot else decode_attention_partial_sum_kernel
    launch(
        kernel,
        lambda meta: (batch * kv_heads * triton.cdiv(tokens, block_t), splits),
        query, key, value, mask, part_max, part_sum, part_acc,
        scale, slots, tokens, kv_heads, group, splits, keys_per_split,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), mask.stride(0), mask.stride(1), mask.stride(2),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP_PAD=group_pad, BLOCK_T=block_t, USE_DOT=use_dot,
    )  # fmt: skip
    out = torch.empty((batch, heads, tokens, head_dim), dtype=query.dtype, device=device)
    launch(
        decode_attention_combine_kernel,
        lambda meta: (batch * heads * tokens,),
        part_max, part_sum, part_acc, out, splits, heads, tokens, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_S=min(COMBINE_SPLITS, triton.next_power_of_2(splits)),
    )  # fmt: skip
    return out


_decode_attention = define_inference_op(
    "decode_attention", math=decode_attention_math, kernels=decode_attention_kernels
)


def _check(query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value), ("mask", mask)):
        if not isinstance(t, Tensor):
            raise TypeError(f"decode_attention: {name} must be a tensor, got {type(t).__name__}")
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(
            "decode_attention: query must be (b, heads, t, d) and key, value (b, kv_heads, s, d) of one shape, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    batch, heads, tokens, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim or heads % key.shape[1] != 0:
        raise ValueError(
            f"decode_attention: key/value {tuple(key.shape)} must share query's batch {batch} and head dim "
            f"{head_dim}, with kv_heads dividing its {heads} heads"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"decode_attention: head dim {head_dim} exceeds the kernels' {MAX_HEAD_DIM}")
    if mask.dtype != torch.bool or tuple(mask.shape) != (batch, tokens, key.shape[2]):
        raise ValueError(
            f"decode_attention: mask must be a bool (b, t, s) = {(batch, tokens, key.shape[2])} tensor, got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )
    if query.dtype not in SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            "decode_attention: query, key and value must share one of float32, bfloat16, float16, got "
            f"{query.dtype}, {key.dtype}, {value.dtype}"
        )
    if len({query.device, key.device, value.device, mask.device}) != 1:
        raise ValueError("decode_attention: query, key, value and mask must be on one device")


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Attention of ``query``'s few tokens against a KV cache (module docstring); ``scale`` defaults to
    ``1 / sqrt(d)``. Differentiable inputs are refused: the op has no backward."""
    _check(query, key, value, mask)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError("decode_attention: inference only (no backward); call it under torch.no_grad()")
    return _decode_attention(query, key, value, mask, 1 / math.sqrt(query.shape[-1]) if scale is None else scale)


def decode_attention_ref(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Reference for tests: the math in float64."""
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    return decode_attention_math(query.double(), key.double(), value.double(), mask, scale)

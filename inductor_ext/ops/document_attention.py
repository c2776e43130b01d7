"""Document-causal attention over packed rows: each token attends to the earlier tokens of its own document.

Packed (padding-free) batches concatenate documents into full rows and restart ``position_ids`` at
each document, as transformers' ``DataCollatorWithFlattening`` and TRL's ``padding_free=True`` do.
transformers then attends with the mask ``document_causal`` (attention-gym's name for it)::

    doc = cumsum(diff(position_ids, prepend=position_ids[:, :1] - 1) != 1)   # HF's find_packed_sequence_indices
    document_causal(b, h, q, kv) = (kv <= q) & (doc[b, q] == doc[b, kv])

materialised as a ``(B, 1, S, S)`` tensor, so SDPA computes every ``(q, kv)`` pair of the row and
reads the mask. Here the same mask is a FlexAttention block mask built from ``doc`` alone: blocks of
``BLOCK_SIZE`` queries by keys that hold no pair of one document are skipped, blocks inside one
document (below the diagonal) run without the mask, the others apply ``document_causal``. For
documents much shorter than the row the work falls from ``S^2`` pairs to about ``sum(len^2) / 2``.

Everything is tensor ops of fixed shapes (``B x S/BLOCK_SIZE x S/BLOCK_SIZE`` block tables), so a
new packing of the same row shape recompiles nothing and syncs nothing with the host. On CUDA the
attention is FlexAttention's higher-order op, which Inductor compiles into its Triton kernels
(forward and backward); FlexAttention has no CPU backward, so on CPU the same mask is materialised
and SDPA runs it (the reference math, used by the CPU tests).
"""

import dataclasses
import functools
import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

BLOCK_SIZE = 128
"""Queries and keys per block of the block mask (FlexAttention's default sparsity block)."""


@dataclasses.dataclass(frozen=True)
class FlexSettings:
    """How FlexAttention runs the document mask: the block mask's block size, and FlexAttention
    ``kernel_options`` (tile sizes of the forward, ``fwd_*``, and of the backward, ``bwd_*``), as
    ``(name, value)`` pairs so that the settings hash (one compiled eager wrapper per setting)."""

    block_size: int = BLOCK_SIZE
    kernel_options: tuple[tuple[str, int | bool], ...] = ()


def document_ids(position_ids: Tensor) -> Tensor:
    """``(B, S)`` document index of each token, as transformers' ``find_packed_sequence_indices``
    derives it: a new document starts wherever the position does not grow by exactly one."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def document_causal_mask_ref(position_ids: Tensor) -> Tensor:
    """The ``(B, 1, S, S)`` boolean ``document_causal`` mask (True: attend), materialised."""
    doc = document_ids(position_ids)
    index = torch.arange(position_ids.shape[-1], device=position_ids.device)
    causal = index[:, None] >= index[None, :]
    return (causal[None] & (doc[:, :, None] == doc[:, None, :]))[:, None]


def document_block_masks(doc: Tensor, block_size: int = BLOCK_SIZE) -> tuple[Tensor, Tensor]:
    """``(partial, full)``: ``(B, 1, S/block_size, S/block_size)`` booleans over (query block, key block) of
    ``document_causal`` over document ids ``doc`` (``(B, S)``, non-decreasing along each row).

    Query block ``i`` and key block ``j`` hold a pair of one document iff ``j <= i`` and the key
    block's last document is not before the query block's first (documents only grow along a row).
    The pair block is *full* (every pair allowed, no mask applied) iff ``j < i``, both blocks lie
    inside the row and one document covers both. Partial blocks are the others that hold a pair.
    """
    length = doc.shape[1]
    blocks = (length + block_size - 1) // block_size
    index = torch.arange(blocks, device=doc.device)
    first = doc[:, index * block_size]
    last = doc[:, torch.clamp(index * block_size + block_size - 1, max=length - 1)]
    q_first, kv_last = first[:, :, None], last[:, None, :]
    lower = index[:, None] >= index[None, :]
    touching = lower & (kv_last >= q_first)
    whole = index * block_size + block_size <= length
    one_doc = first == last
    full = (
        (index[:, None] > index[None, :])
        & (whole[:, None] & whole[None, :])
        & (one_doc[:, :, None] & one_doc[:, None, :])
        & (q_first == first[:, None, :])
    )
    return (touching & ~full)[:, None], full[:, None]


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of ``blocks`` (``(..., N)`` booleans): the count of set entries (int32), and their column
    indices in ascending order, then zeros (``(..., N)`` int32).

    Without a sort. Built with ``argsort`` (and FlexAttention's ``_transpose_ordered`` for the query
    tables) inside the compiled graph, FlexAttention on CUDA (torch 2.11) gave wrong rows for some
    packings with several rows per batch (the last row of a 4 x 512 batch 8% off, a NaN loss at
    Llama-1B 4 x 2048), while ``create_block_mask``'s tables gave the right ones; the fault was not
    isolated (the compiled ``argsort`` alone matched eager). These tables match, and the attention
    with them matches float64 there.

    With ``rank[j]`` the number of set entries up to column ``j`` (non-decreasing), the columns before
    the ``k``-th set one (from 0) are those with ``rank <= k``: their count is its index.
    """
    width = blocks.shape[-1]
    count = blocks.sum(-1, dtype=torch.int32)
    rank = blocks.cumsum(-1, dtype=torch.int32)
    slot = torch.arange(width, dtype=torch.int32, device=blocks.device)
    indices = (rank[..., None, :] <= slot[:, None]).sum(-1, dtype=torch.int32)
    return count, torch.where(slot < count[..., None], indices, 0)


def document_block_mask(doc: Tensor, mask_mod: Any, block_size: int = BLOCK_SIZE) -> Any:
    """The FlexAttention ``BlockMask`` of ``document_causal`` over ``doc``, key and query tables alike
    built by :func:`_ordered` (the query tables, for the backward, from the transposed block masks)."""
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = document_block_masks(doc, block_size)
    kv_num, kv_indices = _ordered(partial)
    full_kv_num, full_kv_indices = _ordered(full)
    q_num, q_indices = _ordered(partial.transpose(-1, -2))
    full_q_num, full_q_indices = _ordered(full.transpose(-1, -2))
    length = doc.shape[1]
    return BlockMask(
        seq_lengths=(length, length),
        kv_num_blocks=kv_num,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_indices,
        q_num_blocks=q_num,
        q_indices=q_indices,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_indices,
        BLOCK_SIZE=(block_size, block_size),
        mask_mod=mask_mod,
    )


def _document_causal_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor, doc: Tensor) -> Tensor:
    return (q >= kv) & (doc[b, q] == doc[b, kv])


def _identity_score(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return score


def document_causal_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    position_ids: Tensor,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    use_flex: bool | None = None,
    flex_settings: FlexSettings = FlexSettings(),
) -> Tensor:
    """``scaled_dot_product_attention(query, key, value, attn_mask=document_causal_mask_ref(position_ids),
    scale=scale, enable_gqa=enable_gqa)`` computed block-sparsely (module docstring).

    ``query`` is ``(B, H, S, D)``, ``key``/``value`` ``(B, H_kv, S, D)`` (``H_kv`` divides ``H`` with
    ``enable_gqa``), ``position_ids`` ``(B, S)`` integers. ``use_flex``: None picks FlexAttention where
    :func:`flex_is_trusted` and the materialised mask elsewhere; True forces FlexAttention (CPU: forward only).
    ``flex_settings``: the block size and FlexAttention kernel options (default: FlexAttention's own).
    """
    _check_inputs(query, key, value, position_ids, enable_gqa)
    if use_flex is None:
        use_flex = flex_is_trusted(query, key, value)
    if not use_flex:
        mask = document_causal_mask_ref(position_ids)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    if query.device.type == "cuda" and not (torch.compiler.is_compiling() or is_fake(query)):
        return _compiled_flex(flex_settings)(query, key, value, position_ids, scale)
    return _flex(query, key, value, position_ids, scale, flex_settings)


def flex_is_trusted(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether the block-sparse FlexAttention runs: on CUDA, where a gradient is needed (training graphs).

    Forward-only graphs keep SDPA on the materialised mask, correct but not faster. Compiled by Inductor
    (torch 2.11 on CUDA; 4 x 2048 packed rows, 32/8 heads of 64, bf16) into one inference graph with the
    attention, the tables built here give garbage (relative error 4e17 against float64 SDPA; with 64 x 64
    tiles, an illegal memory access). The same tables built outside the graph, or returned by it (as a
    training graph saves them for the backward), give FlexAttention's bf16 error (2e-3), and they equal
    ``create_block_mask``'s row for row. ``scripts/flex_no_grad.py`` reproduces it.
    """
    return query.device.type == "cuda" and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))


def _flex(
    query: Tensor, key: Tensor, value: Tensor, position_ids: Tensor, scale: float | None, settings: FlexSettings
) -> Tensor:
    """FlexAttention on the document block mask.

    Traced by Dynamo (the patched model under ``torch.compile``, the eager wrapper): the public
    ``flex_attention``, whose mask function closes over ``doc`` (Dynamo lifts it into an input; its
    higher-order-op handler takes no buffer arguments). Traced by ``make_fx`` (AOTAutograd after the
    backend's rewrite, export): the higher-order op itself, with ``doc`` passed as the mask
    function's buffer argument, so it is traced as an input and not as a closed-over constant.
    """
    from torch.nn.attention.flex_attention import _apply_kernel_options, flex_attention

    doc = document_ids(position_ids)
    gqa = query.shape[1] != key.shape[1]

    def document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return _document_causal_mod(b, h, q, kv, doc)

    block_mask = document_block_mask(doc, document_causal, settings.block_size)
    options = dict(settings.kernel_options)
    if torch.compiler.is_dynamo_compiling():
        out = flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                             kernel_options=cast(Any, options))  # fmt: skip
        assert isinstance(out, Tensor)
        return out
    from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op

    kernel_options: dict[str, Any] = dict(_apply_kernel_options(query, key, value, False, cast(Any, options)))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    mask = (*block_mask.as_tuple()[:-1], _document_causal_mod)
    out, *_ = flex_attention_op(query, key, value, _identity_score, mask, scale, kernel_options, (), (doc,))
    return out


_COMPILED: dict[FlexSettings, Any] = {}


def _compiled_flex(settings: FlexSettings) -> Any:
    """``_flex`` with ``settings`` under ``torch.compile``, for eager callers on CUDA (FlexAttention's fused
    kernels exist only compiled; eager runs its unfused math over the whole score matrix)."""
    if settings not in _COMPILED:
        _COMPILED[settings] = torch.compile(functools.partial(_flex, settings=settings), fullgraph=True, dynamic=False)
    return _COMPILED[settings]


def _check_inputs(query: Tensor, key: Tensor, value: Tensor, position_ids: Tensor, enable_gqa: bool) -> None:
    name = "document_causal_attention"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"{name}: query, key and value must be 4-D (B, H, S, D), got {query.dim()}, {key.dim()}, "
                         f"{value.dim()} dimensions")  # fmt: skip
    batch, heads, length, _ = query.shape
    if key.shape[0] != batch or key.shape[2] != length or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"{name}: key {tuple(key.shape)} and value {tuple(value.shape)} must be (B, H_kv, S, D) "
                         f"with the query's B and S {tuple(query.shape)}")  # fmt: skip
    if key.shape[1] != heads and not (enable_gqa and heads % key.shape[1] == 0):
        raise ValueError(f"{name}: key has {key.shape[1]} heads, query {heads}: equal, or dividing with enable_gqa")
    if position_ids.dim() != 2 or tuple(position_ids.shape) != (batch, length):
        raise ValueError(f"{name}: position_ids must be (B, S) = {(batch, length)}, got {tuple(position_ids.shape)}")
    if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise ValueError(f"{name}: position_ids must hold integers, got {position_ids.dtype}")
    if position_ids.device != query.device:
        raise ValueError(f"{name}: position_ids is on {position_ids.device}, query on {query.device}")

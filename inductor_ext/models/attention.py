"""The patched model's attention: transformers' SDPA, except on packed rows, which run block-sparse.

:func:`inductor_ext.models.apply` switches an ``"sdpa"`` model to :data:`ATTENTION`, registered with
transformers' ``AttentionInterface`` (the attention) and ``AttentionMaskInterface`` (its masks:
transformers' own ``sdpa_mask``, so every mask is built exactly as for ``"sdpa"``). The attention is
transformers' ``sdpa_attention_forward`` on the mask it is given, unless the causal LM's forward
(:func:`inductor_ext.models.forwards.causal_lm_forward`) passes :data:`DOCUMENT_POSITIONS`: it does
so only for a call whose mask transformers builds as the packed-document mask (``position_ids``, no
``attention_mask``, no KV cache), and then the layer runs
:func:`~inductor_ext.ops.document_attention.document_causal_attention` on those positions instead
(FlexAttention on a block mask on CUDA, eager or compiled). Layers with a sliding window, attention
dropout or a KV cache keep SDPA on transformers' mask.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from inductor_ext.ops.document_attention import document_causal_attention

ATTENTION = "fastops_sdpa"
"""The ``attn_implementation`` name of the patched model's attention."""

DOCUMENT_POSITIONS = "fastops_document_positions"
"""Keyword argument (through the decoder to each attention call): the packed rows' ``position_ids``."""


def register() -> bool:
    """Register :data:`ATTENTION` with transformers (idempotent); False if this transformers has no
    attention or mask interface to register with."""
    return register_sdpa_variant(ATTENTION, sdpa_or_document_attention)


def register_sdpa_variant(name: str, attention: Callable[..., tuple[Tensor, None]]) -> bool:
    """Register ``attention`` as the ``attn_implementation`` ``name``, its masks built as for ``"sdpa"``
    (transformers' ``sdpa_mask``); idempotent. False if this transformers has no attention or mask
    interface to register with."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return True


def sdpa_or_document_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-interface signature: ``(B, H, S, D)`` query, ``(B, H_kv, S, D)`` key and
    value in, ``(B, S, H, D)`` out (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions = kwargs.pop(DOCUMENT_POSITIONS, None)
    if (
        positions is not None
        and dropout == 0.0
        and kwargs.get("sliding_window", getattr(module, "sliding_window", None)) is None
        and query.shape[-2] == key.shape[-2]
    ):
        out = document_causal_attention(query, key, value, positions, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )

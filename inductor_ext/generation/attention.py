"""The generation step's optional attention: grouped-query SDPA over the cache, with no ``repeat_kv``.

With a mask (the step always passes one) transformers' SDPA attention repeats each key/value head
for the query heads that share it (``repeat_kv``) whenever it is traced, so a compiled or exported
step writes and reads the whole cache ``heads / kv_heads`` times over in each layer.

:func:`grouped_query_sdpa` folds the query heads of a group into the query rows instead: query
``(b, kv_heads * g, t, d)`` becomes ``(b, kv_heads, g * t, d)`` (row ``j * t + i`` is head ``j`` of the
group, token ``i``), the ``(b, 1, t, s)`` mask is repeated ``g`` times along its rows to match, and
SDPA runs on the cache's own ``(b, kv_heads, s, d)`` keys and values. Every query row attends to the
same keys under the same mask as before: the same attention, as ``g``-times fewer, ``g``-times taller
problems. At a decode step (``t = 1``) the fold is a view of the query and the repeated mask is
``g * s`` booleans a row. Recent transformers do the same for ``t = 1``, in eager mode only (``pack_gqa``).

It is opt-in (``export_generation(..., fold_query_heads_from_batch=n)``) because it trades batch-1
speed for batched speed. Measured on the H200 (Llama-3.2-1B shape, 2048-token prompt, decode from
the C++ loop, folding at every batch): batch 64 12.96 -> 5.88 ms a token, batch 8 2.98 -> 2.56, but
batch 1 1.66 -> 2.47. Its batch-1 cost, about 50 us a layer, was not profiled; which SDPA kernel
Inductor picks for 8 heads of 4 rows against 32 heads of 1 row is the first suspect. With ``n > 1``
and a traced batch the step chooses at run time (``torch.cond``: folded from ``n`` rows, repeated
below), so one package can fold for batches and not for a single sequence; that choice has not been
timed on the H200.

:func:`grouped_query_attention` switches a model to it for the duration of a call, when the model
runs SDPA (``"sdpa"``, or :mod:`inductor_ext.models.attention`'s, which on a KV cache is SDPA);
other implementations (eager, flash attention) are the user's choice and are left alone.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from inductor_ext.models import attention as patched_attention

GROUPED_QUERY_SDPA = "fastops_grouped_query_sdpa"
"""The ``attn_implementation`` name of :func:`grouped_query_sdpa`."""

FOLD_FROM_BATCH = "fastops_fold_from_batch"
"""Keyword argument (through the decoder to each attention call): the batch from which
:func:`grouped_query_sdpa` folds; below it, it repeats the key/value heads as transformers does."""

_SDPA_IMPLEMENTATIONS = ("sdpa", patched_attention.ATTENTION)


def grouped_query_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-interface signature: ``(b, heads, t, d)`` query, ``(b, kv_heads, s, d)``
    key and value, ``(b or 1, 1, t, s)`` mask in; ``(b, t, heads, d)`` out (module docstring). Folds
    from :data:`FOLD_FROM_BATCH` rows (default 1: always); with a traced batch the choice is made at
    run time (``torch.cond``). Calls transformers' SDPA attention unchanged when there is nothing to
    fold (as many key/value heads as query heads, no mask, a per-head mask) or when it must refuse the
    call (softcap)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    from_batch = kwargs.pop(FOLD_FROM_BATCH, 1)
    batch, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    if (
        heads == kv_heads
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    group = heads // kv_heads

    # Each branch returns the (b, t, heads, d) output flattened, and reads the traced sizes from its
    # operands: torch.cond refuses outputs whose strides it cannot prove dense (a 4-D output's leading
    # stride is heads * d * Max(1, t) under dynamic shapes), and Dynamo cannot close a branch over a
    # traced size.
    def folded(query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> Tensor:
        batch, tokens, rows, slots = query.shape[0], query.shape[2], mask.shape[0], mask.shape[3]
        query = query.reshape(batch, kv_heads, group * tokens, head_dim)
        mask = mask[:, :, None].expand(rows, 1, group, tokens, slots).reshape(rows, 1, group * tokens, slots)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
        )
        return out.reshape(batch, heads, tokens, head_dim).transpose(1, 2).contiguous().flatten()

    def repeated(query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> Tensor:
        key, value = repeat_kv(key, group), repeat_kv(value, group)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
        )
        return out.transpose(1, 2).contiguous().flatten()

    if from_batch <= 1:
        out = folded(query, key, value, attention_mask)
    elif isinstance(batch, int):  # eager, or a static batch: the branch is known now
        out = (folded if batch >= from_batch else repeated)(query, key, value, attention_mask)
    else:
        # contiguous operands: with a strided query, Inductor's C++ wrapper (AOTInductor, torch 2.13,
        # CPU) gave the branch a buffer in another layout than the one it was compiled for (wrong
        # attention; its Python wrapper was right)
        operands = (query.contiguous(), key, value, attention_mask.contiguous())
        out = torch.cond(batch >= from_batch, folded, repeated, operands)
    return out.view(batch, tokens, heads, head_dim), None


def register() -> bool:
    """Register :data:`GROUPED_QUERY_SDPA` with transformers (idempotent); False if this transformers
    has no attention interface."""
    return patched_attention.register_sdpa_variant(GROUPED_QUERY_SDPA, grouped_query_sdpa)


@contextmanager
def grouped_query_attention(model: nn.Module) -> Iterator[bool]:
    """Run ``model``'s attention as :func:`grouped_query_sdpa` inside the block, if it runs SDPA;
    yields whether it does."""
    config: Any = model.config
    current = getattr(config, "_attn_implementation", None)
    if current not in _SDPA_IMPLEMENTATIONS or not register():
        yield False
        return
    config._attn_implementation = GROUPED_QUERY_SDPA
    try:
        yield True
    finally:
        config._attn_implementation = current

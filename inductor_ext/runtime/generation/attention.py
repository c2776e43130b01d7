"""The generation step's attention choices, ``export_generation(..., attention=...)``: transformers' own
(``"sdpa"``, the default), or one of two that read the cache's own key/value heads.

With a mask (the step always passes one) transformers' SDPA attention repeats each key/value head for
the query heads that share it (``repeat_kv``) whenever it is traced, so a compiled or exported step
copies the whole filled cache ``heads / kv_heads`` times over in each layer before SDPA reads it again:
at batch 64 after a long prompt, most of a decode step.

- ``"folded_sdpa"`` (:data:`folded_sdpa`): the query heads of a group become query rows, query
  ``(b, kv_heads * g, t, d)`` -> ``(b, kv_heads, g * t, d)`` (row ``j * t + i`` is head ``j`` of the
  group, token ``i``), the ``(b, 1, t, s)`` mask is repeated ``g`` times along its rows to match, and
  SDPA runs on the cache's ``(b, kv_heads, s, d)`` keys and values: the same attention, as ``g``-times
  fewer, ``g``-times taller problems. Against ``"sdpa"`` (dynamic graph, C++ loop, Llama-3.2-1B shape,
  2048-token prompt; docs/benchmarks/generate_llama-3.2-1b_prompt2048.json) it decodes 2.2x faster at
  batch 64 and 1.16x at batch 8, but 1.49x slower at batch 1, where cuDNN runs one program per
  key/value head.
- ``"decode_attention"`` (:data:`decode_kernel_attention`): our decode-attention op
  (:mod:`inductor_ext.ops.decode_attention`), split over the cache, for the prefill and every decode
  step (one op for any token count: the exported step, one graph with a symbolic token count, needs no
  run-time branch). In the same comparison it decodes 2-7% faster at every batch but prefills 1.6x
  slower: its kernels are far from the copy bandwidth yet.

A ``torch.cond`` choosing per call (folded from some batch, or the decode op for one token and SDPA
for a prompt) did not survive export (torch 2.11): Dynamo refuses a branch's key and value
operands when they are views of one cache (aliasing), and with separate example tensors instead the
package gave wrong tokens and an illegal memory access (which of the two changes caused that was not
isolated). So each choice is one code path for every call.

:func:`generation_attention` switches a model to a choice for the duration of a call, when the model
runs transformers' SDPA (``"sdpa"``); other implementations (eager, flash attention) are the user's
choice and are left alone.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from inductor_ext.ops.decode_attention import SUPPORTED_DTYPES, decode_attention

ATTENTION_CHOICES = ("sdpa", "folded_sdpa", "decode_attention")
"""``export_generation``'s ``attention`` values; each but ``"sdpa"`` is registered with transformers as
``"fastops_<choice>"``."""


def check_attention_choice(choice: object, caller: str) -> None:
    """A clear error naming ``caller`` unless ``choice`` is one of :data:`ATTENTION_CHOICES`."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(
            f"{caller}: attention must be one of {', '.join(map(repr, ATTENTION_CHOICES))}, got {choice!r}"
        )


def _transformers_sdpa_needed(query: Tensor, attention_mask: Tensor | None, dropout: float, kwargs: dict) -> bool:
    """What the two choices do not take: no mask, a float or per-head mask, dropout, softcap, float64."""
    return (
        attention_mask is None
        or attention_mask.dtype != torch.bool
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or bool(dropout)
        or kwargs.get("softcap") is not None
        or query.dtype not in SUPPORTED_DTYPES
    )


def sdpa_on_cache_heads(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """SDPA of ``(b, heads, t, d)`` queries on ``(b, kv_heads, s, d)`` keys and values with a
    ``(b or 1, 1, t, s)`` mask, the query heads of a group folded into query rows (module docstring);
    ``(b, heads, t, d)`` out."""
    batch, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    group, rows, slots = heads // kv_heads, mask.shape[0], mask.shape[3]
    folded = query.reshape(batch, kv_heads, group * tokens, head_dim)
    mask = mask[:, :, None].expand(rows, 1, group, tokens, slots).reshape(rows, 1, group * tokens, slots)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, tokens, head_dim)


def _decode_op_on_cache_heads(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None) -> Tensor:
    """Our decode-attention op with :func:`sdpa_on_cache_heads`' arguments and result."""
    batch, _, tokens, _ = query.shape
    return decode_attention(query, key, value, mask[:, 0].expand(batch, tokens, key.shape[2]), scale)


def _attention_interface(
    attend: Callable[[Tensor, Tensor, Tensor, Tensor, float | None], Tensor], *, only_grouped: bool
) -> Callable[..., tuple[Tensor, None]]:
    """A transformers attention-interface function that runs ``attend`` (``(b, heads, t, d)`` query,
    ``(b, kv_heads, s, d)`` key and value, ``(b or 1, 1, t, s)`` boolean mask, scale -> ``(b, heads, t, d)``)
    and transformers' SDPA attention for a call ``attend`` does not take (and, if ``only_grouped``, when
    there are as many key/value heads as query heads: nothing to fold)."""

    def attention(
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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        ungrouped = only_grouped and query.shape[1] == key.shape[1]
        if ungrouped or _transformers_sdpa_needed(query, attention_mask, dropout, kwargs):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                **kwargs,
            )  # fmt: skip
        assert attention_mask is not None  # checked above
        return attend(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None

    return attention


folded_sdpa = _attention_interface(sdpa_on_cache_heads, only_grouped=True)
"""``"folded_sdpa"``: SDPA with the query heads of a group folded into query rows (module docstring)."""
decode_kernel_attention = _attention_interface(_decode_op_on_cache_heads, only_grouped=False)
"""``"decode_attention"``: our decode-attention op on the cache's own heads (module docstring)."""

_VARIANTS = {"folded_sdpa": folded_sdpa, "decode_attention": decode_kernel_attention}
"""Each choice but ``"sdpa"`` -> its attention function."""


def register_sdpa_variant(name: str, attention: Callable[..., tuple[Tensor, None]]) -> bool:
    """Register ``attention`` with transformers as the ``attn_implementation`` ``name``, its masks built as
    for ``"sdpa"`` (transformers' ``sdpa_mask``); idempotent. False if this transformers has no attention
    or mask interface to register with."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return True


@contextmanager
def generation_attention(model: nn.Module, choice: str) -> Iterator[bool]:
    """Run ``model``'s attention as ``choice`` (one of :data:`ATTENTION_CHOICES`) inside the block, if
    the model runs SDPA and the choice is not ``"sdpa"``; yields whether it switched."""
    check_attention_choice(choice, "generation_attention")
    config: Any = model.config
    current = getattr(config, "_attn_implementation", None)
    if choice == "sdpa" or current != "sdpa":
        yield False
        return
    name = f"fastops_{choice}"
    if not register_sdpa_variant(name, _VARIANTS[choice]):
        yield False
        return
    config._attn_implementation = name
    try:
        yield True
    finally:
        config._attn_implementation = current

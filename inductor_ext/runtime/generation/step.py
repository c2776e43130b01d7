"""One generation step of an HF causal LM over a caller-owned static KV cache, as one exportable module.

:class:`GenerationStep` runs the model on ``t`` new tokens per sequence (``t`` = the prompt's length
for the prefill, 1 for a decode step), writes their keys and values into the cache at
``cache_position`` and returns the float32 logits of each sequence's last token. The package
exports it with a dynamic batch and token count (prefill and decode) and with static shapes for
chosen decode batch sizes (:mod:`inductor_ext.runtime.generation.export`).

The cache is owned by the caller and updated in place: one tensor ``(layers, 2, max_batch, kv_heads,
max_seq_len, head_dim)`` whose per-layer keys and values (``cache[layer, 0 or 1, :b]``, each contiguous)
the step takes as a list (:mod:`inductor_ext.runtime.generation.cache_layout`). The prefill and every decode step
see the same storage, and a C++ loop can capture the decode step in a CUDA graph over fixed addresses.
One input per layer's keys and values, not the whole cache as one input: an in-place write into a view
of an input becomes a copy of the whole input in the compiled graph, once per layer (measured on the
H200: 9.9 ms a decode step at batch 8 for the Llama-3.2-1B shape, 14× the bandwidth floor).

Masking is explicit: slot ``j`` of the cache is visible to the token at slot ``i`` iff ``j <= i`` and
``attention_mask[b, j]`` is 1. With a left-padded batch this is exactly what transformers'
``generate`` computes (``position_ids`` count only real tokens, padding slots are never attended);
the boolean mask is passed to the model as a 4-D mask, which transformers uses as is. A model that
runs SDPA attends as ``attention`` chooses (:mod:`inductor_ext.runtime.generation.attention`): transformers'
SDPA attention by default, or attention on the cache's own key/value heads.
"""

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from inductor_ext.runtime.generation.attention import check_attention_choice, generation_attention


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values: views of the caller's cache, written at the step's slots."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: Tensor, values: Tensor, slots: Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.slots = keys, values, slots
        self.cache_keys, self.cache_values = keys, values  # typed: the base class's may be None
        self.max_cache_len = keys.shape[2]
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise AssertionError("SlotLayer views the caller's cache: nothing to allocate")

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        self.cache_keys.index_copy_(2, self.slots, key_states.to(self.cache_keys.dtype))
        self.cache_values.index_copy_(2, self.slots, value_states.to(self.cache_values.dtype))
        return self.cache_keys, self.cache_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        raise NotImplementedError("SlotLayer: the step passes position_ids and a 4-D mask; no length is tracked")

    def get_max_length(self) -> int:
        return self.max_cache_len


class SlotCache(Cache):
    """transformers ``Cache`` of :class:`SlotLayer` s over ``[keys_0, values_0, keys_1, ...]``."""

    def __init__(self, kv_cache: list[Tensor], slots: Tensor) -> None:
        pairs = zip(kv_cache[0::2], kv_cache[1::2], strict=True)
        super().__init__(layers=[SlotLayer(keys, values, slots) for keys, values in pairs])


class GenerationStep(nn.Module):
    """``forward(input_ids, position_ids, cache_position, attention_mask, kv_cache) -> logits``.

    - ``input_ids``, ``position_ids``: ``(b, t)``; the new tokens and their positions (RoPE).
    - ``cache_position``: ``(t,)`` int64; the cache slots of the new tokens (the same for every row).
    - ``attention_mask``: ``(b, max_seq_len)``; 1 where a slot holds a real token (HF's 2-D mask padded
      with zeros to the cache length).
    - ``kv_cache``: ``[keys_0, values_0, keys_1, ...]``, each ``(b, kv_heads, max_seq_len, head_dim)``, updated
      in place (:func:`inductor_ext.runtime.generation.cache_layout.layer_caches`).
    - returns ``(b, vocab)`` float32: the logits of each row's last new token.

    ``attention``: one of :data:`~inductor_ext.runtime.generation.attention.ATTENTION_CHOICES` (``"sdpa"``:
    transformers' attention as the model has it).
    """

    def __init__(self, model: nn.Module, *, attention: str = "sdpa") -> None:
        super().__init__()
        check_attention_choice(attention, "GenerationStep")
        self.model, self.attention = model, attention
        parameters = inspect.signature(model.forward).parameters
        # transformers >= 5.20 names the cache argument ``cache`` (``past_key_values`` deprecated) and has
        # no ``cache_position``; older versions compute it from the cache's length unless it is passed
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.takes_cache_position = "cache_position" in parameters

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        cache_position: Tensor,
        attention_mask: Tensor,
        kv_cache: list[Tensor],
    ) -> Tensor:
        slots = torch.arange(kv_cache[0].shape[2], device=input_ids.device)
        visible = (slots[None, :] <= cache_position[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
        kwargs: dict[str, Any] = {self.cache_argument: SlotCache(kv_cache, cache_position)}
        if self.takes_cache_position:
            kwargs["cache_position"] = cache_position
        with generation_attention(self.model, self.attention):
            logits = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=visible, use_cache=True, logits_to_keep=1,
                **kwargs,
            ).logits  # fmt: skip
        return logits[:, -1].float()

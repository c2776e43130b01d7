"""One generation step of an HF causal LM over a caller-owned static KV cache, as one exportable module.

:class:`GenerationStep` runs the model on ``t`` new tokens per sequence (``t`` = the prompt's length
for the prefill, 1 for a decode step), writes their keys and values into the cache at
``cache_position`` and returns the float32 logits of each sequence's last token. One graph serves
both, exported with a dynamic batch and a dynamic token count (:mod:`inductor_ext.generation.export`).

The cache is one tensor, ``(batch, layers, 2, kv_heads, max_seq_len, head_dim)``, owned by the caller
and updated in place: the prefill and every decode step see the same storage, batch rows are
contiguous (a smaller batch is the prefix ``cache[:b]``), and a C++ loop can capture the decode step
in a CUDA graph over fixed addresses.

Masking is explicit: slot ``j`` of the cache is visible to the token at slot ``i`` iff ``j <= i`` and
``attention_mask[b, j]`` is 1. With a left-padded batch this is exactly what transformers'
``generate`` computes (``position_ids`` count only real tokens, padding slots are never attended);
the boolean mask is passed to the model as a 4-D mask, which transformers uses as is.
"""

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin


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
    """transformers ``Cache`` over :class:`SlotLayer` views of one ``(b, layers, 2, kv_heads, S, head_dim)`` tensor."""

    def __init__(self, kv_cache: Tensor, slots: Tensor) -> None:
        super().__init__(
            layers=[SlotLayer(kv_cache[:, i, 0], kv_cache[:, i, 1], slots) for i in range(kv_cache.shape[1])]
        )


def kv_cache_shape(config: Any, batch: int, max_seq_len: int) -> tuple[int, ...]:
    """``(batch, layers, 2, kv_heads, max_seq_len, head_dim)`` for an HF config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return batch, config.num_hidden_layers, 2, kv_heads, max_seq_len, head_dim


class GenerationStep(nn.Module):
    """``forward(input_ids, position_ids, cache_position, attention_mask, kv_cache) -> logits``.

    - ``input_ids``, ``position_ids``: ``(b, t)``; the new tokens and their positions (RoPE).
    - ``cache_position``: ``(t,)`` int64; the cache slots of the new tokens (the same for every row).
    - ``attention_mask``: ``(b, max_seq_len)``; 1 where a slot holds a real token (HF's 2-D mask padded
      with zeros to the cache length).
    - ``kv_cache``: ``(b, layers, 2, kv_heads, max_seq_len, head_dim)``, updated in place.
    - returns ``(b, vocab)`` float32: the logits of each row's last new token.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        parameters = inspect.signature(model.forward).parameters
        # transformers >= 5.20 names the cache argument ``cache`` (``past_key_values`` deprecated) and has
        # no ``cache_position``; older versions compute it from the cache's length unless it is passed
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.takes_cache_position = "cache_position" in parameters

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, cache_position: Tensor, attention_mask: Tensor, kv_cache: Tensor
    ) -> Tensor:
        slots = torch.arange(kv_cache.shape[4], device=input_ids.device)
        visible = (slots[None, :] <= cache_position[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
        kwargs: dict[str, Any] = {self.cache_argument: SlotCache(kv_cache, cache_position)}
        if self.takes_cache_position:
            kwargs["cache_position"] = cache_position
        logits = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=visible, use_cache=True, logits_to_keep=1,
            **kwargs,
        ).logits  # fmt: skip
        return logits[:, -1].float()

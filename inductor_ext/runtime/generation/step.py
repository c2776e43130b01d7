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
of an input becomes a copy of the whole input in the compiled graph, once per layer: a decode step
then moves the whole cache once per layer instead of one slot.

Masking is explicit: slot ``j`` of the cache is visible to the token at slot ``i`` iff ``j <= i`` and
``attention_mask[b, j]`` is 1, and, in a layer with a sliding window ``w``, ``j > i - w`` (transformers'
``sliding_window_overlay``, over cache slots as ``generate`` counts them, padding included). With a
left-padded batch this is exactly what transformers' ``generate`` computes (``position_ids`` count only
real tokens, padding slots are never attended). The boolean masks are passed to the model as 4-D masks,
which transformers uses as they are: one tensor when every layer attends alike, else one per layer type
(``config.layer_types``), as transformers' own mask mapping. :func:`attention_windows` reads each layer's
window from the config and refuses a model whose attention it cannot reproduce. A model that
runs SDPA attends as ``attention`` chooses (:mod:`inductor_ext.runtime.generation.attention`): transformers'
SDPA attention by default, or attention on the cache's own key/value heads.
"""

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from inductor_ext.runtime.generation.attention import check_attention_choice, generation_attention

LAYER_TYPE_WINDOWS = {"full_attention": False, "sliding_attention": True}
"""The ``config.layer_types`` the step reproduces -> whether the layer applies ``config.sliding_window``."""

EVERY_LAYER_SLIDING_MODEL_TYPES = frozenset(
    {"mistral", "mixtral", "ministral3", "phi3", "phimoe", "qwen3_moe", "starcoder2"}
)
"""Model types without ``layer_types`` whose models window every layer's attention when ``config.sliding_window``
is set (their forward calls transformers' ``create_sliding_window_causal_mask`` then)."""


def attention_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal attention), as transformers' model applies it.

    Raises ``ValueError`` for a model whose attention masks the step cannot reproduce exactly: a layer type
    other than full or sliding attention, a sliding window that is not a positive integer, or a
    ``sliding_window`` on a model type not known to apply it to every layer."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    model_type = getattr(config, "model_type", "?")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_TYPE_WINDOWS))
        if unknown:
            raise ValueError(
                f"export_generation: {model_type} has layers of type {unknown}; the generation step reproduces only "
                f"{sorted(LAYER_TYPE_WINDOWS)}"
            )
        windowed = [LAYER_TYPE_WINDOWS[kind] for kind in layer_types]
    elif window is None:
        windowed = [False] * config.num_hidden_layers
    elif model_type in EVERY_LAYER_SLIDING_MODEL_TYPES:
        windowed = [True] * config.num_hidden_layers
    else:
        raise ValueError(
            f"export_generation: {model_type} sets sliding_window={window} without layer_types; which of its layers "
            "apply it is not known, so its attention cannot be reproduced"
        )
    if any(windowed) and not (isinstance(window, int) and window >= 1):
        raise ValueError(f"export_generation: {model_type}'s sliding_window must be a positive integer, got {window!r}")
    return [window if slides else None for slides in windowed]


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
        config: Any = model.config
        windows = attention_windows(config)
        self.windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
        """The distinct windows (None: full attention), one mask each."""
        layer_types = getattr(config, "layer_types", None)
        self.layer_type_windows = dict(zip(layer_types, windows)) if layer_types and len(self.windows) > 1 else {}
        """Layer type -> window, where the model gets one mask per layer type (a dict) rather than one for all."""

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        cache_position: Tensor,
        attention_mask: Tensor,
        kv_cache: list[Tensor],
    ) -> Tensor:
        slots = torch.arange(kv_cache[0].shape[2], device=input_ids.device)[None, :]
        query_slots = cache_position[:, None]
        real = attention_mask.bool()[:, None, None, :]
        masks = {}
        for window in self.windows:
            allowed = slots <= query_slots
            if window is not None:
                allowed = allowed & (slots > query_slots - window)
            masks[window] = allowed[None, None] & real
        visible: Tensor | dict[str, Tensor] = masks[self.windows[0]]
        if self.layer_type_windows:
            visible = {kind: masks[window] for kind, window in self.layer_type_windows.items()}
        kwargs: dict[str, Any] = {self.cache_argument: SlotCache(kv_cache, cache_position)}
        if self.takes_cache_position:
            kwargs["cache_position"] = cache_position
        with generation_attention(self.model, self.attention):
            logits = self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=visible, use_cache=True, logits_to_keep=1,
                **kwargs,
            ).logits  # fmt: skip
        return logits[:, -1].float()

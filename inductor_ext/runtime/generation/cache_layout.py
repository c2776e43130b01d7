"""The KV cache of a generation package: one caller-owned tensor ``(layers, 2, max_batch, kv_heads,
max_seq_len, head_dim)``; the step takes each layer's keys and values (the first ``b`` rows, each a
contiguous block) as a list (:mod:`inductor_ext.runtime.generation.step` says why)."""

from typing import Any

from torch import Tensor


def kv_cache_shape(config: Any, batch: int, max_seq_len: int) -> tuple[int, ...]:
    """``(layers, 2, batch, kv_heads, max_seq_len, head_dim)`` for an HF config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, 2, batch, kv_heads, max_seq_len, head_dim


def layer_caches(kv_cache: Tensor, batch: int) -> list[Tensor]:
    """The step's cache argument: ``[keys_0, values_0, keys_1, ...]``, the first ``batch`` rows of each."""
    return [kv_cache[layer, kind, :batch] for layer in range(kv_cache.shape[0]) for kind in (0, 1)]

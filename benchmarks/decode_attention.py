"""Decode attention benchmark: one new token per sequence against a filled KV cache, grouped-query heads.

Shapes are ``batch x heads x kv_heads x slots x head_dim`` (the Llama-3.2-1B attention after a 2048-token
prompt at batch 1, 8 and 64, and Llama-3.1-8B's at 32k), every slot visible. Providers:

- ``torch_compile`` (the baseline): what an exported or compiled transformers model runs, ``repeat_kv`` of
  the keys and values then SDPA with the boolean mask, under ``torch.compile``;
- ``folded_sdpa``: the query heads of a group folded into query rows, SDPA on the cache's own heads,
  under ``torch.compile`` (``export_generation(attention="folded_sdpa")``);
- ``fastops``: our decode-attention op, launched directly.

Minimal bytes (``s`` bytes per element): the keys and values read once, the query read and the output
written, and the mask, ``2 b kv S d s + 2 b h d s + b S``.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import Inputs, Provider, Result, run_providers
from inductor_ext.ops.decode_attention import decode_attention
from inductor_ext.runtime.generation.attention import sdpa_on_cache_heads

SHAPES = [(1, 32, 8, 2112, 64), (8, 32, 8, 2112, 64), (64, 32, 8, 2112, 64), (1, 32, 8, 32768, 128)]


def _make_inputs(
    batch: int, heads: int, kv_heads: int, slots: int, dim: int, dtype: torch.dtype
) -> Callable[[], Inputs]:
    def make() -> Inputs:
        query = torch.randn(batch, 1, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
        key, value = (torch.randn(batch, kv_heads, slots, dim, device="cuda", dtype=dtype) for _ in range(2))
        mask = torch.ones(batch, 1, 1, slots, dtype=torch.bool, device="cuda")  # as transformers passes it
        return {"query": query, "key": key, "value": value, "mask": mask}

    return make


def _repeated(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' traced SDPA attention: every key/value head repeated for its query heads."""
    from transformers.integrations.sdpa_attention import repeat_kv

    group = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, repeat_kv(key, group), repeat_kv(value, group), attn_mask=mask)


def _folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return sdpa_on_cache_heads(query, key, value, mask, None)


def _ours(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return decode_attention(query, key, value, mask[:, 0])


def _provider(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        args = (inp["query"], inp["key"], inp["value"], inp["mask"])
        return lambda: f(*args)

    return build


def providers() -> list[Provider]:
    return [
        Provider("torch_compile", _provider(torch.compile(_repeated, fullgraph=True))),
        Provider("folded_sdpa", _provider(torch.compile(_folded, fullgraph=True))),
        Provider("fastops", _provider(_ours)),
    ]


def run(shapes: list[tuple[int, ...]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    results = []
    s = torch.finfo(dtype).bits // 8
    for batch, heads, kv_heads, slots, dim in shapes:
        torch._dynamo.reset()
        min_bytes = 2 * batch * kv_heads * slots * dim * s + 2 * batch * heads * dim * s + batch * slots
        with torch.no_grad():
            results += run_providers(
                "decode_attention", "decode", f"{batch}x{heads}x{kv_heads}x{slots}x{dim}", dtype,
                _make_inputs(batch, heads, kv_heads, slots, dim, dtype), min_bytes, providers(), copy_gbps,
                baseline="torch_compile",
            )  # fmt: skip
    return results

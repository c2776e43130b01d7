"""Embedding lookup forward + backward at 8192 tokens: HF's ``nn.Embedding`` (``F.embedding``) eager and
under ``torch.compile``, :func:`inductor_ext.embedding` eager and compiled, and the HF spelling under
``backend="fastops_inductor"`` (rewritten into the embedding op; route chosen at compile time, and each
route forced). Shapes are ``(V, H)``, the weight's.

Token ids are skewed towards low ids (``V * u**3``, ``u`` uniform), so that ids repeat as a text's do.
Minimal bytes (weight's dtype): the forward reads and writes ``N H`` (the gathered rows); the backward
reads ``dy`` (``N H``) and writes the dense gradient once (``V H``): ``(V + 3 N) H`` elements.
Gradients through ``torch.autograd.grad``.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import Inputs, Provider, Result, reference_and_backend_providers, run_providers
from benchmarks.rms_norm import route_check
from inductor_ext.ops.embedding import embedding

SHAPES = [(128256, 2048), (128256, 4096), (151936, 1024), (32768, 4096)]
TOKENS = 8192


def _make_inputs(vocab: int, hidden: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        ids = (torch.rand(TOKENS, device="cuda") ** 3 * vocab).long().clamp_(max=vocab - 1)
        weight = torch.randn(vocab, hidden, device="cuda", dtype=dtype, requires_grad=True)
        return {"ids": ids, "weight": weight, "dy": torch.randn(TOKENS, hidden, device="cuda", dtype=dtype)}

    return make


def _fwd_bwd(f: Callable[..., Any]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        ids, weight, dy = inp["ids"], inp["weight"], inp["dy"]
        return lambda: torch.autograd.grad(f(ids, weight), (weight,), dy)

    return build


def _hf(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    results = []
    element_size = torch.finfo(dtype).bits // 8
    providers: list[Provider] = reference_and_backend_providers(_fwd_bwd, _hf, embedding)
    for vocab, hidden in shapes:
        torch._dynamo.reset()
        min_bytes = (vocab + 3 * TOKENS) * hidden * element_size
        results += run_providers("embedding", "fwd_bwd", f"{vocab}x{hidden}", dtype, _make_inputs(vocab, hidden, dtype),
                                 min_bytes, providers, copy_gbps, baseline="torch_compile")  # fmt: skip
    return results


__all__ = ["SHAPES", "route_check", "run"]

"""RMSNorm with a fused residual add: ``h = x + r``, ``y = norm(h)``, both returned (a pre-norm
transformer's residual stream). HF eager (the add, then ``LlamaRMSNorm``), torch.compile of it,
fastops eager and compiled (:func:`inductor_ext.add_rms_norm`), and the HF spelling under
``backend="fastops_inductor"`` (rewritten into ``add_rms_norm``; route chosen at compile time, and
each route forced).

Minimal bytes (bf16, weight ignored): forward reads x and r and writes h and y (4·M·N·s);
forward+backward adds reading dy, the gradient reaching h directly and h, and writing the one
gradient x and r share (8·M·N·s). Gradients through ``torch.autograd.grad``.
"""

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Inputs, Provider, Result, reference_and_backend_providers, run_matrix_op
from benchmarks.rms_norm import route_check
from inductor_ext.ops.rms_norm import add_rms_norm, add_rms_norm_ref

SHAPES = [(32768, 4096), (16384, 8192), (4096, 16384)]
EPS = 1e-6


def _make_inputs(m: int, n: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        x, r = (torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        w = (1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
        dy, dh = (torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(2))
        return {"x": x, "r": r, "w": w, "dy": dy, "dh": dh}

    return make


def _fwd(f: Callable[..., Any]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        x, r, w = (inp[k].detach() for k in ("x", "r", "w"))
        return lambda: f(x, r, w)

    return build


def _fwd_bwd(f: Callable[..., Any]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        x, r, w, dy, dh = (inp[k] for k in ("x", "r", "w", "dy", "dh"))
        return lambda: torch.autograd.grad(f(x, r, w), (x, r, w), (dy, dh))

    return build


def _hf(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF spelling with eps a constant (as a module attribute is), so the backend can match it."""
    return add_rms_norm_ref(x, r, w, EPS)


def _ours(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(x, r, w, EPS)


def providers(mode: str) -> list[Provider]:
    return reference_and_backend_providers(_fwd if mode == "fwd" else _fwd_bwd, _hf, _ours)


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    return run_matrix_op("add_rms_norm", {"fwd": 4, "fwd_bwd": 8}, shapes, dtype, copy_gbps, _make_inputs, providers)


__all__ = ["SHAPES", "route_check", "run"]

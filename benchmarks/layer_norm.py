"""LayerNorm benchmark (weight and bias): the plain-PyTorch reference in eager, ATen's fused
``F.layer_norm`` in eager, torch.compile of the reference (the baseline), fastops eager,
fastops under torch.compile.

Minimal bytes (weight and bias ignored, statistics ignored): forward reads x and
writes y (2·M·N·s); forward+backward adds reading x and dy and writing dx
(5·M·N·s). The backward is timed through ``torch.autograd.grad`` so no gradient
accumulation is counted.
"""

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Inputs, Provider, Result, run_matrix_op
from inductor_ext.ops.layer_norm import layer_norm, layer_norm_ref

SHAPES = [(32768, 4096), (16384, 8192), (4096, 16384), (65536, 2048)]
EPS = 1e-5


def _make_inputs(m: int, n: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
        b = (0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
        return {"x": x, "w": w, "b": b, "dy": torch.randn(m, n, device="cuda", dtype=dtype)}

    return make


def _fwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        x, w, b = inp["x"].detach(), inp["w"].detach(), inp["b"].detach()
        return lambda: f(x, w, b, EPS)

    return build


def _fwd_bwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        x, w, b, dy = inp["x"], inp["w"], inp["b"], inp["dy"]
        return lambda: torch.autograd.grad(f(x, w, b, EPS), (x, w, b), dy)

    return build


def _aten_layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)


def providers(mode: str) -> list[Provider]:
    wrap = _fwd if mode == "fwd" else _fwd_bwd
    compiled_ref = torch.compile(layer_norm_ref, fullgraph=True)
    compiled_ours = torch.compile(layer_norm, fullgraph=True)
    return [
        Provider("ref_eager", wrap(layer_norm_ref)),
        Provider("aten_eager", wrap(_aten_layer_norm)),
        Provider("torch_compile", wrap(compiled_ref)),
        Provider("fastops_eager", wrap(layer_norm)),
        Provider("fastops_compile", wrap(compiled_ours)),
    ]


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    return run_matrix_op("layer_norm", {"fwd": 2, "fwd_bwd": 5}, shapes, dtype, copy_gbps, _make_inputs, providers)

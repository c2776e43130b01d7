"""SwiGLU benchmark: HF eager ``silu(gate) * up``, torch.compile of it (the baseline), fastops eager,
fastops under torch.compile, and fastops eager on one concatenated gate-up tensor (``swiglu_packed``).

Shapes are ``M x I`` (tokens x intermediate size). Minimal bytes (``s`` bytes per
element): the forward reads gate and up and writes y (3·M·I·s); forward+backward
adds reading dy, gate and up and writing dgate and dup (8·M·I·s; the activation is
recomputed, nothing else is saved). The packed form moves the same bytes. The
backward is timed through ``torch.autograd.grad`` so no gradient accumulation is
counted. On the H200, torch.compile runs 16384x14336 bf16 fwd+bwd in 0.87 ms, at
the bandwidth floor: the target is to match it.
"""

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Inputs, Provider, Result, run_matrix_op
from inductor_ext.ops.glu import swiglu, swiglu_packed, swiglu_ref

SHAPES = [(16384, 14336), (8192, 11008), (4096, 28672)]


def _make_inputs(m: int, n: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        return {
            "gate": torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True),
            "up": torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True),
            "gate_up": torch.randn(m, 2 * n, device="cuda", dtype=dtype, requires_grad=True),
            "dy": torch.randn(m, n, device="cuda", dtype=dtype),
        }

    return make


def _fwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        gate, up = inp["gate"].detach(), inp["up"].detach()
        return lambda: f(gate, up)

    return build


def _fwd_bwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        gate, up, dy = inp["gate"], inp["up"], inp["dy"]
        return lambda: torch.autograd.grad(f(gate, up), (gate, up), dy)

    return build


def _packed(mode: str) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        gate_up, dy = inp["gate_up"], inp["dy"]
        if mode == "fwd":
            detached = gate_up.detach()
            return lambda: swiglu_packed(detached)
        return lambda: torch.autograd.grad(swiglu_packed(gate_up), gate_up, dy)

    return build


def providers(mode: str) -> list[Provider]:
    wrap = _fwd if mode == "fwd" else _fwd_bwd
    compiled_ref = torch.compile(swiglu_ref, fullgraph=True)
    compiled_ours = torch.compile(swiglu, fullgraph=True)
    return [
        Provider("hf_eager", wrap(swiglu_ref)),
        Provider("torch_compile", wrap(compiled_ref)),
        Provider("fastops_eager", wrap(swiglu)),
        Provider("fastops_compile", wrap(compiled_ours)),
        Provider("fastops_packed_eager", _packed(mode)),
    ]


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    return run_matrix_op("glu", {"fwd": 3, "fwd_bwd": 8}, shapes, dtype, copy_gbps, _make_inputs, providers)

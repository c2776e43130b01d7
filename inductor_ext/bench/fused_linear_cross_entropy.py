"""Fused linear cross-entropy benchmark: HF eager (``F.linear`` + cross-entropy), torch.compile of it,
fastops eager, fastops under torch.compile; plus each provider's peak memory.

Shapes are ``N x H x V`` (tokens, hidden size, vocabulary), bf16, 1 in 8 labels ignored.
The op is compute-bound (``2·N·H·V`` FLOPs forward, ``6·N·H·V`` forward+backward), so
the harness's "minimal bytes" (hidden and weight read, plus dhidden and dweight written
for forward+backward) only make its GB/s column comparable between providers; the
time is what counts. :func:`run` also prints achieved TFLOP/s and the peak memory one
call adds (``torch.cuda.max_memory_allocated`` above what the inputs hold).
"""

from collections.abc import Callable
from typing import Any

import torch

from inductor_ext.bench.harness import Inputs, Provider, Result, run_providers
from inductor_ext.ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
)

SHAPES = [(8192, 4096, 128256), (16384, 2048, 128256)]


def _make_inputs(n: int, h: int, v: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        hidden = torch.randn(n, h, device="cuda", dtype=dtype, requires_grad=True)
        weight = (2 * torch.randn(v, h, device="cuda") / h**0.5).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda")
        labels[::8] = -100
        return {"hidden": hidden, "weight": weight, "labels": labels}

    return make


def _fwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        hidden, weight, labels = inp["hidden"].detach(), inp["weight"].detach(), inp["labels"]
        return lambda: f(hidden, weight, labels)

    return build


def _fwd_bwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        hidden, weight, labels = inp["hidden"], inp["weight"], inp["labels"]
        return lambda: torch.autograd.grad(f(hidden, weight, labels), (hidden, weight))

    return build


def providers(mode: str) -> list[Provider]:
    wrap = _fwd if mode == "fwd" else _fwd_bwd
    return [
        Provider("hf_eager", wrap(fused_linear_cross_entropy_ref)),
        Provider("torch_compile", wrap(torch.compile(fused_linear_cross_entropy_ref, fullgraph=True))),
        Provider("fastops_eager", wrap(fused_linear_cross_entropy)),
        Provider("fastops_compile", wrap(torch.compile(fused_linear_cross_entropy, fullgraph=True))),
    ]


def peak_memory_bytes(make_inputs: Callable[[], Inputs], mode: str) -> dict[str, int]:
    """Peak memory one call of each provider adds above its inputs (after a warm-up call)."""
    inputs = make_inputs()
    peaks = {}
    for provider in providers(mode):
        fn = provider.build(inputs)
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peaks[provider.name] = torch.cuda.max_memory_allocated() - base
    return peaks


def run(shapes: list[tuple[int, int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    results = []
    es = torch.finfo(dtype).bits // 8
    for mode in ("fwd", "fwd_bwd"):
        for n, h, v in shapes:
            torch._dynamo.reset()
            make = _make_inputs(n, h, v, dtype)
            min_bytes = (n * h + v * h) * es * (2 if mode == "fwd_bwd" else 1)
            shape_results = run_providers(
                "fused_linear_cross_entropy", mode, f"{n}x{h}x{v}", dtype, make, min_bytes,
                providers(mode), copy_gbps, baseline="torch_compile",
            )  # fmt: skip
            flops = (6 if mode == "fwd_bwd" else 2) * n * h * v
            peaks = peak_memory_bytes(make, mode)
            for r in shape_results:
                print(
                    f"{mode} {r.shape} {r.provider}: {r.ms:.3f} ms, {flops / r.ms / 1e9:.0f} TFLOP/s, "
                    f"peak +{peaks[r.provider] / 2**30:.2f} GiB"
                )
            results += shape_results
    return results

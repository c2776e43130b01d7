"""RMSNorm benchmark: HF eager, torch.compile of it, fastops eager, fastops under torch.compile,
and the HF spelling under ``backend="fastops_inductor"`` (rewritten, route chosen at compile time,
and each route forced).

Minimal bytes (bf16, weight ignored): forward reads x and writes y (2·M·N·s);
forward+backward adds reading x and dy and writing dx (5·M·N·s). The backward
is timed through ``torch.autograd.grad`` so no gradient accumulation is counted.
"""

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Inputs, Provider, Result, reference_and_backend_providers, run_matrix_op
from inductor_ext.ops.rms_norm import rms_norm, rms_norm_ref

SHAPES = [(32768, 4096), (16384, 8192), (4096, 16384), (65536, 2048)]
EPS = 1e-6


def _make_inputs(m: int, n: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(n, device="cuda", dtype=dtype)).requires_grad_()
        return {"x": x, "w": w, "dy": torch.randn(m, n, device="cuda", dtype=dtype)}

    return make


def _fwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        x, w = inp["x"].detach(), inp["w"].detach()
        return lambda: f(x, w)

    return build


def _fwd_bwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        x, w, dy = inp["x"], inp["w"], inp["dy"]
        return lambda: torch.autograd.grad(f(x, w), (x, w), dy)

    return build


def _hf(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The HF spelling with eps a constant (as a module attribute is), so the backend can match it."""
    return rms_norm_ref(x, w, EPS)


def _ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w, EPS)


def providers(mode: str) -> list[Provider]:
    return reference_and_backend_providers(_fwd if mode == "fwd" else _fwd_bwd, _hf, _ours)


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    return run_matrix_op("rms_norm", {"fwd": 2, "fwd_bwd": 5}, shapes, dtype, copy_gbps, _make_inputs, providers)


def host_overhead_us(n: int = 4096, calls: int = 500, rounds: int = 15) -> dict[str, float]:
    """Host µs per eager fwd+bwd call on a tiny input: ours vs a bare autograd.Function around the same launches."""
    from inductor_ext.library.launch import DirectLaunch
    from inductor_ext.ops.rms_norm import rms_norm_bwd_kernels, rms_norm_fwd_kernels

    launch = DirectLaunch()

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y, rstd = rms_norm_fwd_kernels(launch, x, w, EPS, 0.0, "llama")
            ctx.save_for_backward(x, w, rstd)
            return y

        @staticmethod
        def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, w, rstd = ctx.saved_tensors
            return rms_norm_bwd_kernels(launch, dy, x, w, rstd, 0.0, "llama")

    x = torch.randn(4, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def make_step(f: Callable[..., torch.Tensor], grad: bool) -> Callable[[], None]:
        def step() -> None:
            if grad:
                torch.autograd.grad(f(x, w), (x, w), dy)
            else:
                with torch.no_grad():
                    f(x, w)

        return step

    steps = {
        f"{name}{'_grad' if grad else ''}_us": make_step(f, grad)
        for name, f in (("bare_autograd_function", Bare.apply), ("fastops_eager", lambda x, w: rms_norm(x, w, EPS)))
        for grad in (False, True)
    }
    out = dict.fromkeys(steps, float("inf"))
    for step in steps.values():
        for _ in range(50):
            step()
    # interleaved rounds, best of each: the host is shared and its speed drifts
    for _ in range(rounds):
        for key, step in steps.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
            out[key] = min(out[key], (time.perf_counter() - t0) / calls * 1e6)
    out["ratio_no_grad"] = out["fastops_eager_us"] / out["bare_autograd_function_us"]
    out["ratio_grad"] = out["fastops_eager_grad_us"] / out["bare_autograd_function_grad_us"]
    return out


def route_check(results: list[Result]) -> dict[str, float]:
    """Per (mode, shape): the ``"auto"`` route's time over the faster forced route's (target: within 1.03)."""
    by_case: dict[str, dict[str, float]] = {}
    for r in results:
        by_case.setdefault(f"{r.mode} {r.shape}", {})[r.provider] = r.ms
    return {
        case: ms["fastops_backend"] / min(ms["fastops_backend_kernel"], ms["fastops_backend_inductor"])
        for case, ms in by_case.items()
        if {"fastops_backend", "fastops_backend_kernel", "fastops_backend_inductor"} <= ms.keys()
    }

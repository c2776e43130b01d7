"""Fused linear cross-entropy benchmark: HF eager (``F.linear`` + cross-entropy), torch.compile of it,
fastops eager, fastops under torch.compile; plus each provider's peak memory.

Shapes are ``N x H x V`` (tokens, hidden size, vocabulary), bf16, 1 in 8 labels ignored.
The op is compute-bound (``2·N·H·V`` FLOPs forward, ``6·N·H·V`` forward+backward), so
the harness's "minimal bytes" (hidden and weight read, plus dhidden and dweight written
for forward+backward) only make its GB/s column comparable between providers; the
time is what counts. :func:`run` also prints achieved TFLOP/s and the peak memory one
call adds (``torch.cuda.max_memory_allocated`` above what the inputs hold).

:func:`weight_grad_numerics` (any device, CPU by default; ``python -m
benchmarks.fused_linear_cross_entropy``) measures the relative error of ``dW``
against float64 for each ``weight_grad_accumulation`` and a Liger-Kernel-style emulation.
"""

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from benchmarks.harness import Inputs, Provider, Result, rel_err, run_providers
from inductor_ext.ops.fused_linear_cross_entropy import (
    WEIGHT_GRAD_ACCUMULATIONS,
    WeightGradAccumulation,
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_ref,
    resolve_chunk_size,
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


# --- numerics of dW's accumulation ------------------------------------------------------------------

NUMERICS_SHAPE = (4096, 256, 8192)
"""``N x H x V`` of :func:`weight_grad_numerics`: V / H = 32 as Llama-3-8B's 128256 / 4096, small
enough for a CPU."""


def liger_chunk_size(n: int, h: int, v: int) -> int:
    """Liger-Kernel's rows per chunk (``fused_linear_cross_entropy_forward``, 0.5-0.8):
    ``next_power_of_2(cdiv(N, cdiv(V, H)))``, about ``V / H`` chunks."""
    return triton.next_power_of_2(triton.cdiv(n, triton.cdiv(v, h)))


def liger_style_weight_grad(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """dW of the mean cross-entropy as Liger-Kernel computes it, in plain torch: per chunk, the logits in
    the inputs' dtype, the gradient ``(softmax - onehot) / count`` in fp32 rounded to that dtype (its
    kernel writes it over the logits), and ``addmm`` into a ``grad_weight`` of the weight's dtype."""
    count = (labels != ignore_index).sum()
    grad_weight = torch.zeros_like(weight)
    for start in range(0, hidden.shape[0], chunk_size):
        h_c, y_c = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        grad = torch.softmax((h_c @ weight.t()).float(), dim=-1)
        valid = y_c != ignore_index
        grad[valid, y_c[valid]] -= 1.0
        grad[~valid] = 0.0
        dlogits = (grad / count).to(weight.dtype)
        torch.addmm(grad_weight, dlogits.t(), h_c, out=grad_weight)
    return grad_weight


def weight_grad_numerics(
    shape: tuple[int, int, int] = NUMERICS_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
    chunk_counts: Sequence[int] = (4, 8, 16, 32),
    device: str = "cpu",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Relative error ``‖dW - dW_64‖ / ‖dW_64‖`` against float64 (on the same 16-bit inputs; mean
    reduction, 1 in 8 labels ignored), per chunk count: ``weight_grad_accumulation="fp32"``,
    ``"weight_dtype"`` and :func:`liger_style_weight_grad`; then each at its default chunking
    (``chunks`` None: the row says each one's count). ``rounding_floor`` is float64's dW rounded
    to ``dtype``: no mode can be closer. ``hf_unfused`` is the loss as transformers spells it,
    ``cross_entropy((hidden @ weight.T).float(), labels)`` (dW: one GEMM from the fp32 gradient rounded
    to ``dtype``), and ``hf_compiled`` the same under ``torch.compile``: the standard the fused modes
    are held to."""
    n, h, v = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, device=device, generator=gen).to(dtype)
    weight = (2 * torch.randn(v, h, device=device, generator=gen) / h**0.5).to(dtype)  # logits with std ~2
    labels = torch.randint(0, v, (n,), device=device, generator=gen)
    labels[::8] = -100
    w64 = weight.double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(hidden.double() @ w64.t(), labels, ignore_index=-100)
    (ref,) = torch.autograd.grad(loss, w64)
    del loss

    def ours(mode: WeightGradAccumulation, chunk_size: int | None) -> float:
        w = weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(hidden, w, labels, chunk_size=chunk_size, weight_grad_accumulation=mode)
        (dw,) = torch.autograd.grad(loss, w)
        return rel_err(dw, ref)

    floor = rel_err(ref.to(dtype), ref)

    def hf_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy((h @ w.t()).float(), y, ignore_index=-100)

    def hf_error(loss_fn: Callable[..., torch.Tensor]) -> float:
        w = weight.clone().requires_grad_()
        (dw,) = torch.autograd.grad(loss_fn(hidden, w, labels), w)
        return rel_err(dw, ref)

    hf_unfused, hf_compiled = hf_error(hf_loss), hf_error(torch.compile(hf_loss))
    rows: list[dict[str, Any]] = []
    for chunks in chunk_counts:
        chunk = math.ceil(n / chunks)
        rows.append({
            "chunks": chunks, "chunk_rows": chunk, "fp32": ours("fp32", chunk),
            "weight_dtype": ours("weight_dtype", chunk),
            "liger_style": rel_err(liger_style_weight_grad(hidden, weight, labels, chunk), ref),
            "hf_unfused": hf_unfused, "hf_compiled": hf_compiled, "rounding_floor": floor,
        })  # fmt: skip
    liger_chunk = liger_chunk_size(n, h, v)
    default_chunks = {
        mode: math.ceil(n / resolve_chunk_size(v, h, hidden.element_size(), None, None, mode))
        for mode in WEIGHT_GRAD_ACCUMULATIONS
    }
    rows.append({
        "chunks": None, "default_chunks": {**default_chunks, "liger_style": math.ceil(n / liger_chunk)},
        "fp32": ours("fp32", None), "weight_dtype": ours("weight_dtype", None),
        "liger_style": rel_err(liger_style_weight_grad(hidden, weight, labels, liger_chunk), ref),
        "hf_unfused": hf_unfused, "hf_compiled": hf_compiled, "rounding_floor": floor,
    })  # fmt: skip
    return rows


def format_weight_grad_numerics(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of :func:`weight_grad_numerics`' rows."""
    lines = [
        '| chunks | `"fp32"` (exact) | `"weight_dtype"` | Liger-style | HF | HF compiled | dW_64 rounded once |',
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["chunks"] is None:
            d = r["default_chunks"]
            label = f"defaults ({d['fp32']} / {d['weight_dtype']} / {d['liger_style']})"
        else:
            label = f"{r['chunks']} ({r['chunk_rows']} rows)"
        values = " | ".join(
            f"{r[k]:.2e}"
            for k in ("fp32", "weight_dtype", "liger_style", "hf_unfused", "hf_compiled", "rounding_floor")
        )
        lines.append(f"| {label} | {values} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fused_linear_cross_entropy",
        description="dW's relative error against float64 per weight_grad_accumulation and chunk count",
    )
    parser.add_argument("--shape", default="x".join(map(str, NUMERICS_SHAPE)), help="NxHxV")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--chunks", type=int, nargs="*", default=[4, 8, 16, 32])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    n, h, v = map(int, args.shape.split("x"))
    rows = weight_grad_numerics((n, h, v), getattr(torch, args.dtype), args.chunks, args.device)
    print(format_weight_grad_numerics(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

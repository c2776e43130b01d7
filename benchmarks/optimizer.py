"""``python -m benchmarks optimizer [--models llama-3.2-1b ...] [--out DIR]``: one AdamW step over a
model's parameters against its bandwidth floor, as PyTorch offers it: ``fused=True`` (one
``multi_tensor_apply`` kernel per chunk of tensors, what ``bench train`` steps with), ``foreach=True``,
and the ``foreach`` step compiled by Inductor (``torch.compile(optimizer.step)``, the ``*_compiled_adamw``
providers of ``bench train``).

The floor: an AdamW step reads the parameter, its gradient and both moments and writes the parameter and
the moments, 7 tensors of the parameters' dtype (14 bytes a bf16 parameter: 17.3 GB for Llama-3.2-1B),
at the measured copy bandwidth. ``GPU ms`` is the kernels' time from the profiler (the compiled step's
Triton kernels included), ``wall ms`` the step's time on the stream with its host work, so their gap is
host time the step adds when the GPU does not hide it.
"""

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from inductor_ext.bench.train import MODELS, build_model

LEARNING_RATE = 1e-6
"""Small, so that the repeated timed steps keep the parameters near their start."""


KINDS = ("fused", "foreach", "compiled")


def optimizer_step(kind: str, params: list[torch.nn.Parameter]) -> Callable[[], Any]:
    """One AdamW step of ``kind`` (``"fused"``, ``"foreach"``, ``"compiled"``) over ``params``."""
    if kind == "fused":
        return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True).step
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE, foreach=True)
    return torch.compile(optimizer.step) if kind == "compiled" else optimizer.step


def floor_bytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes an AdamW step must move: read the parameter, its gradient and both moments, write the
    parameter and both moments (the moments have the parameter's dtype)."""
    return sum(7 * p.numel() * p.element_size() for p in params)


def measure(model: str, copy_gbps: float) -> list[dict[str, Any]]:
    """Every :data:`KINDS` over the parameters of one :data:`MODELS` shape (bf16, random gradients)."""
    params = list(build_model(model, "cuda", torch.bfloat16).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    floor_ms = floor_bytes(params) / copy_gbps / 1e6
    rows = []
    for kind in KINDS:
        step = optimizer_step(kind, params)
        for _ in range(3):  # the moments' allocation, and the compile
            step()
        wall_ms, _, _ = harness.do_bench_median(step, rep_ms=500)
        gpu_ms = sum(harness.kernel_us(step, steps=5).values()) / 1e3
        rows.append({"model": model, "kind": kind, "params": sum(p.numel() for p in params), "floor_ms": floor_ms,
                     "gpu_ms": gpu_ms, "wall_ms": wall_ms, "of_floor": floor_ms / gpu_ms})  # fmt: skip
        print(f"{model} {kind}: GPU {gpu_ms:.2f} ms ({100 * floor_ms / gpu_ms:.0f}% of floor {floor_ms:.2f}), "
              f"wall {wall_ms:.2f} ms", flush=True)  # fmt: skip
        del step
        torch.cuda.empty_cache()
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks optimizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["llama-3.2-1b"])
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for optimizer_adamw.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_on_gpu(parser(), argv)
    copy_gbps = statistics.median(harness.copy_bandwidth_gbps() for _ in range(3))
    rows = [row for model in args.models for row in measure(model, copy_gbps)]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps}
    (args.out / "optimizer_adamw.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return 0

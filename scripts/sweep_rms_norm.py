"""H200 diagnostics for RMSNorm: GPU time of every kernel config (and grid size) at the benchmark
shapes, each checked against the aten math, next to torch.compile of the HF reference; Inductor's
generated kernels are written to $OUT for comparison.

    PYTHONPATH=$PWD python scripts/sweep_rms_norm.py [--out DIR] [--shapes 4096x16384 ...]

Thread-block clusters (``num_ctas=2``, two CTAs sharing a row) are not offered: Triton 3.6
fails to compile the backward with them for sm_90 (``TritonGPUPlanCTAPass``; checked with
``triton.compile(..., target=GPUTarget("cuda", 90, 32), options={"num_ctas": 2})``).
"""

# ruff: noqa: B023  (every closure here runs within the loop iteration that defines it)
import argparse
import importlib
import json
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code

from inductor_ext.bench.harness import bench_graph_median, copy_bandwidth_gbps, rel_err
from inductor_ext.bench.rms_norm import SHAPES
from inductor_ext.kernels.norm_config import search_space
from inductor_ext.ops._library import DirectLaunch, force_launch_config

EPS = 1e-6
ops = importlib.import_module("inductor_ext.ops.rms_norm")  # the package re-exports a function of that name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    parser.add_argument("--shapes", nargs="*", default=None, help="MxN (default: the benchmark's shapes)")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    args.out.mkdir(parents=True, exist_ok=True)
    launch = DirectLaunch()
    copy = copy_bandwidth_gbps()
    rows = []
    for m, n in shapes:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        y_ref, rstd = ops.rms_norm_fwd_math(x, w, EPS, 0.0, "llama")
        dx_ref, dw_ref = ops.rms_norm_bwd_math(dy, x, w, rstd, 0.0, "llama")
        fwd_bytes, bwd_bytes = 2 * m * n * 2, 3 * m * n * 2

        def record(kind: str, config: object, ms: float, nbytes: int, err: float) -> None:
            row = {"shape": f"{m}x{n}", "kind": kind, "config": str(config), "ms": ms,
                   "copy_fraction": nbytes / ms / 1e6 / copy, "rel_err": err}  # fmt: skip
            rows.append(row)
            print(f"{row['shape']:12s} {kind:4s} {ms:.4f} ms {row['copy_fraction']:6.1%} err {err:.1e} {config}")

        def variants(forward: bool) -> list[tuple[str, dict]]:
            return [(str(c), c.to_triton().all_kwargs()) for c in search_space(n, forward=forward)]

        for name, config in variants(forward=True):
            with force_launch_config(config):
                y, _ = ops.rms_norm_fwd_kernels(launch, x, w, EPS, 0.0, "llama")
                ms = bench_graph_median(lambda: ops.rms_norm_fwd_kernels(launch, x, w, EPS, 0.0, "llama"))[0]
            record("fwd", name, ms, fwd_bytes, rel_err(y, y_ref))
        default_per_sm = ops.programs_per_sm
        for per_sm in (1, 2, 4):
            ops.programs_per_sm = lambda _n, p=per_sm: p
            for name, config in variants(forward=False):
                with force_launch_config(config):
                    dx, dw = ops.rms_norm_bwd_kernels(launch, dy, x, w, rstd, 0.0, "llama")
                    bwd = lambda: ops.rms_norm_bwd_kernels(launch, dy, x, w, rstd, 0.0, "llama")
                    ms = bench_graph_median(bwd)[0]
                record("bwd", f"{name} per_sm={per_sm}", ms, bwd_bytes, max(rel_err(dx, dx_ref), rel_err(dw, dw_ref)))
        ops.programs_per_sm = default_per_sm

        torch._dynamo.reset()
        ref = torch.compile(ops.rms_norm_ref, fullgraph=True)
        _, code = run_and_get_code(ref, x, w, EPS)
        (args.out / f"inductor_fwd_{m}x{n}.py").write_text("\n\n".join(code))
        record("fwd", "torch.compile", bench_graph_median(lambda: ref(x, w, EPS))[0], fwd_bytes, 0.0)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        full = bench_graph_median(lambda: torch.autograd.grad(ref(xg, wg, EPS), (xg, wg), dy))[0]
        record("f+b", "torch.compile", full, fwd_bytes + bwd_bytes, 0.0)
    (args.out / "sweep.json").write_text(json.dumps({"copy_gbps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""``python -m benchmarks OP [--out DIR] [--shapes 32768x4096 ...] [--dtype bfloat16]`` for an op's
micro-benchmark, or ``python -m benchmarks TOOL [options]`` for a model-level benchmark or developer tool
(see its ``--help``). Run from the repository root; this folder is not part of the wheel.

Each op's benchmark is a module ``benchmarks.<op>`` with ``SHAPES`` (its default shape list),
``run(shapes, dtype, copy_gbps) -> list[Result]`` and, optionally, ``host_overhead_us() -> dict`` (eager
host cost vs a bare launch) and ``route_check(results) -> dict`` (the backend's "auto" route against the
forced ones).
"""

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

from benchmarks import harness

OPS = ["rms_norm", "add_rms_norm"]
"""Ops with a benchmark module; a new op adds its name here."""
OPS += ["layer_norm"]
OPS += ["cross_entropy", "fused_linear_cross_entropy"]
OPS += ["glu", "rope"]
OPS += ["nf4_dequantize"]
OPS += ["decode_attention"]
OPS += ["embedding"]


MODEL_BENCHES = {
    "backend": "benchmarks.backend",
    "export": "benchmarks.export",
    "autotune": "benchmarks.autotune",
    "document_attention": "benchmarks.document_attention",
    "sft_trainer": "benchmarks.sft_trainer",
}
"""Model-level benchmarks, each with its own ``main(argv)``: ``python -m benchmarks backend --help``.
(``bench train`` and ``bench generate`` are the package's: ``python -m inductor_ext.bench``.)"""

TOOLS = {
    "compile_cost": "benchmarks.compile_cost",
    "compile_time_ab": "benchmarks.compile_time_ab",
    "profile_compile": "benchmarks.profile_compile",
    "guards": "benchmarks.guards",
    "projections": "benchmarks.projections",
    "optimizer": "benchmarks.optimizer",
    "kernel_table": "benchmarks.kernel_table",
    "export_time": "benchmarks.export_time",
}
"""Developer tools, each with its own ``main(argv)``: our kernels' compile cost for sm_90 on a CPU host
(no GPU needed), a compile-time A/B of an environment variable, a sampling profile of a compile, the
host cost of Dynamo's guards per guard filter (CPU), a layer's projections fused or separate (GPU),
PyTorch's AdamW steps against their floor (GPU), where ``export_generation`` spends its time."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    subcommands = {**MODEL_BENCHES, **TOOLS}
    if argv and argv[0] in subcommands:
        return int(importlib.import_module(subcommands[argv[0]]).main(argv[1:]))
    usage = (
        "python -m benchmarks {" + ",".join(OPS) + "} [--out OUT] [--shapes ...] [--dtype ...]\n"
        "       python -m benchmarks {" + ",".join(subcommands) + "} [options] (see their --help)"
    )
    parser = argparse.ArgumentParser(prog="python -m benchmarks", usage=usage, description=__doc__)
    parser.add_argument(
        "op", choices=OPS, help=f"an op, or {' / '.join({**MODEL_BENCHES, **TOOLS})} (see their --help)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for JSON and PNG")
    parser.add_argument("--shapes", nargs="*", default=None, help="MxN shapes (default: the op's list)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("benchmarks need a CUDA GPU")
    bench = importlib.import_module(f"benchmarks.{args.op}")

    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else bench.SHAPES
    dtype = getattr(torch, args.dtype)
    copy_gbps = harness.copy_bandwidth_gbps()
    results = bench.run(shapes, dtype, copy_gbps)
    overhead = bench.host_overhead_us() if hasattr(bench, "host_overhead_us") else {}
    routes = bench.route_check(results) if hasattr(bench, "route_check") else {}
    from inductor_ext.tuning.first_launch import tuned_launch_configs

    tuned = {f"{key[0].fn.__name__}{key[1:]}": config for key, config in tuned_launch_configs().items()}
    extra = {
        "eager_tuned_configs": {k: {n: v for n, v in c.items() if v is not None} for k, c in tuned.items()},
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
        "host_overhead": overhead,
        "auto_route_over_best_forced": routes,
    }
    stem = f"{args.op}_{args.dtype}"
    harness.write_results(results, extra, args.out, stem)
    harness.plot(results, args.out / f"{stem}.png", f"{args.op} {args.dtype}")
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s")
    print(harness.table(results))
    print(json.dumps(overhead, indent=1))
    if routes:
        print("auto route / faster forced route:", json.dumps(routes, indent=1))
    print(json.dumps(extra["eager_tuned_configs"], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""H200 check of LayerNorm's two-pass backward (``ops.layer_norm.TWO_PASS_BACKWARD_MIN_N``): fwd+bwd GPU time
with the two-pass backward and with the one-kernel backward (persistent or looped, autotuned), side
by side with ``torch.compile`` of the reference, each checked against float64.

    PYTHONPATH=$PWD python scripts/sweep_layer_norm_bwd.py [--shapes 4096x16384 2048x32768 8192x8192] [--out DIR]

Session 10 (H200), fwd+bwd ms, torch.compile / one-kernel / two-pass: 4096 x 16384 0.418 / 0.356 /
0.277 (predicted ~0.28); 2048 x 32768 0.478 / 0.649 / 0.398; 8192 x 8192 0.380 / 0.185 / 0.260, hence
the threshold at 16384. The split backward of session 9 (small second-pass tiles) measured 0.517 ms
at 4096 x 16384: too few bytes in flight.
"""

# ruff: noqa: B023  (every closure here runs within the loop iteration that defines it)
import argparse
import json
import sys
from pathlib import Path

import torch

from inductor_ext.bench.harness import bench_graph_median, copy_bandwidth_gbps, rel_err
from inductor_ext.ops.layer_norm import layer_norm, layer_norm_ref

# the module itself: ``inductor_ext.ops.layer_norm`` as an attribute is the function of that name
layer_norm_ops = sys.modules["inductor_ext.ops.layer_norm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["4096x16384", "2048x32768", "8192x8192"])
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = copy_bandwidth_gbps()
    rows = []
    for shape in args.shapes:
        m, n = map(int, shape.split("x"))
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16).requires_grad_()
        b = (0.1 * torch.randn(n, device="cuda")).to(torch.bfloat16).requires_grad_()
        dy = torch.randn_like(x)
        ref = torch.autograd.grad(layer_norm_ref(x.double(), w.double(), b.double()), (x, w, b), dy.double())
        floor_ms = 5 * m * n * 2 / copy / 1e6  # fwd: read x, write y; bwd: read x, dy, write dx
        torch._dynamo.reset()
        compiled = torch.compile(layer_norm_ref, fullgraph=True)
        providers = {
            "torch.compile": compiled,
            "ours, one-kernel backward": layer_norm,
            "ours, two-pass backward": layer_norm,
        }
        for name, f in providers.items():
            layer_norm_ops.TWO_PASS_BACKWARD_MIN_N = n if "two-pass" in name else n + 1

            def step() -> tuple[torch.Tensor, ...]:
                return torch.autograd.grad(f(x, w, b), (x, w, b), dy)

            errors = [rel_err(g, r) for g, r in zip(step(), ref)]
            ms = bench_graph_median(step)[0]
            row = {"shape": shape, "provider": name, "ms": ms, "floor_fraction": floor_ms / ms, "rel_err": errors}
            rows.append(row)
            print(f"{shape:11s} {name:28s} {ms:.4f} ms {floor_ms / ms:6.1%} of the 5-pass floor, "
                  f"errors dx/dw/db {errors[0]:.1e} {errors[1]:.1e} {errors[2]:.1e}", flush=True)  # fmt: skip
    (args.out / "sweep_layer_norm_bwd.json").write_text(json.dumps({"copy_gbps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

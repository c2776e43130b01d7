"""H200 sweep of cross-entropy's eager training path: the gradient written by the forward.

Times fwd+bwd (``torch.autograd.grad`` with ``grad_output = 1``, CUDA-graph replay, two input
sets alternating so nothing stays in L2) of ``torch.compile`` of HF's spelling, the library's
three-pass kernels (forward, then backward; what compiled graphs run), the public
``inductor_ext.cross_entropy`` (autotuned two-pass path) and that path with each of its configs
forced, plus each config's errors against float64 (loss) and the three-pass gradient.

    PYTHONPATH=$PWD python scripts/sweep_cross_entropy.py [--shapes 8192x128256 16384x32000] [--out DIR]
"""

import argparse
import json
from pathlib import Path

import torch

from inductor_ext.bench.harness import bench_graph_median, copy_bandwidth_gbps, rel_err
from inductor_ext.kernels.cross_entropy import grad_in_forward_search_space
from inductor_ext.ops._library import force_launch_config
from inductor_ext.ops.cross_entropy import cross_entropy, cross_entropy_family, cross_entropy_ref


def three_pass(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_family(logits, labels, -100, 0.0, 0.0, 0.0, "mean")[0]


def sweep(n: int, v: int, copy_gbps: float) -> dict:
    torch.manual_seed(0)
    sets = []
    for _ in range(2):
        logits = (3 * torch.randn(n, v, device="cuda")).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda")
        labels[::8] = -100
        sets.append((logits, labels))
    floor_ms = 2 * n * v * 2 / copy_gbps / 1e6  # read the logits, write the gradient
    result = {"shape": [n, v], "two_pass_floor_ms": floor_ms, "rows": []}
    ref_loss = cross_entropy_ref(sets[0][0].detach().double(), sets[0][1])
    ref_grad = torch.autograd.grad(three_pass(*sets[0]), sets[0][0])[0]

    def timed(name: str, f, **extra) -> float:
        state = {"i": 0}

        def run():
            state["i"] ^= 1
            logits, labels = sets[state["i"]]
            return torch.autograd.grad(f(logits, labels), logits)

        ms, p20, p80 = bench_graph_median(run)
        row = {"name": name, "ms": ms, "p20": p20, "p80": p80, **extra}
        result["rows"].append(row)
        base = result["rows"][0]["ms"]
        print(
            f"{n}x{v} {name:58s} {ms:.4f} ms  {floor_ms / ms:4.0%} of the 2-pass floor  {base / ms:.2f}x compile {extra}",
            flush=True,
        )
        return ms

    timed("torch.compile(F.cross_entropy(logits.float()))", torch.compile(cross_entropy_ref, fullgraph=True))
    timed("inductor_ext three-pass kernels (compiled graphs' path)", three_pass)
    timed("inductor_ext.cross_entropy (two-pass, autotuned)", cross_entropy)
    for config in grad_in_forward_search_space(v):
        with force_launch_config(config.all_kwargs()):
            x = sets[0][0].detach().clone().requires_grad_()
            loss = cross_entropy(x, sets[0][1])
            (grad,) = torch.autograd.grad(loss, x)
            errors = {"loss_err": rel_err(loss, ref_loss), "grad_vs_three_pass": rel_err(grad, ref_grad)}
            timed(f"  BLOCK_V {config.kwargs['BLOCK_V']} warps {config.num_warps}", cross_entropy, **errors)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["8192x128256", "16384x32000"])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    copy = copy_bandwidth_gbps()
    results = {"copy_gbps": copy, "sweeps": [sweep(*map(int, s.split("x")), copy) for s in args.shapes]}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep_cross_entropy.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

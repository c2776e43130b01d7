"""H200 diagnostics for RoPE (forward 0.93x of torch.compile in session 3): GPU time of every
kernel config at the benchmark shapes, each checked against the float32 reference, next to
torch.compile of the HF spelling; Inductor's generated kernels are written to --out.

    PYTHONPATH=$PWD python scripts/sweep_rope.py [--out DIR]
"""

# ruff: noqa: B023  (every closure here runs within the loop iteration that defines it)
import argparse
import json
from pathlib import Path

import torch
import triton
from torch._inductor.utils import run_and_get_code

from inductor_ext.bench.harness import bench_graph_median, copy_bandwidth_gbps, rel_err
from inductor_ext.bench.rope import SHAPES, _make_inputs
from inductor_ext.kernels.rope import search_space
from inductor_ext.ops import apply_rotary_pos_emb, apply_rotary_pos_emb_ref
from inductor_ext.ops._library import force_launch_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy = copy_bandwidth_gbps()
    rows = []
    for b, hq, hk, s, d in SHAPES:
        inp = _make_inputs(b, hq, hk, s, d, torch.bfloat16)()
        q, k, cos, sin = inp["q"].detach(), inp["k"].detach(), inp["cos"], inp["sin"]
        ref = apply_rotary_pos_emb_ref(q.float(), k.float(), cos.float(), sin.float())
        nbytes = (2 * b * (hq + hk) * s * d + 2 * s * d) * 2

        def record(config: object, ms: float, err: float) -> None:
            row = {"shape": f"{b}x{hq}x{hk}x{s}x{d}", "config": str(config), "ms": ms,
                   "copy_fraction": nbytes / ms / 1e6 / copy, "rel_err": err}  # fmt: skip
            rows.append(row)
            print(f"{row['shape']:18s} {ms:.4f} ms {row['copy_fraction']:6.1%} err {err:.1e} {config}", flush=True)

        for config in search_space(hq, hk, triton.next_power_of_2(d // 2)):
            with force_launch_config(config.to_triton().all_kwargs()):
                out = apply_rotary_pos_emb(q, k, cos, sin)
                ms = bench_graph_median(lambda: apply_rotary_pos_emb(q, k, cos, sin))[0]
            record(config, ms, max(rel_err(o, r) for o, r in zip(out, ref)))
        torch._dynamo.reset()
        compiled = torch.compile(apply_rotary_pos_emb_ref, fullgraph=True)
        out, code = run_and_get_code(compiled, q, k, cos, sin)
        (args.out / f"inductor_rope_{b}x{hq}x{hk}x{s}x{d}.py").write_text("\n\n".join(code))
        record("torch.compile", bench_graph_median(lambda: compiled(q, k, cos, sin))[0],
               max(rel_err(o, r) for o, r in zip(out, ref)))  # fmt: skip
    (args.out / "sweep_rope.json").write_text(json.dumps({"copy_gbps": copy, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""H200 diagnosis (not part of the library): where does the HF-spelled decoder stack of
``python -m inductor_ext.bench backend`` spend its GPU time under each compile variant?

Compiles the stack (:mod:`inductor_ext.bench.llama`) under ``torch.compile`` default, default
with multi-kernel, and ``fastops_inductor`` with each route, with multi-kernel off, and with
its pattern rewrites off; times every variant's fwd+bwd step side by side (CUDA-graph replay,
interleaved rounds, ratio to ``torch.compile`` per round), then profiles a few steps of each
and prints GPU time per kernel class (GEMM, attention, Triton/other) and the largest kernels.
Each variant's generated code goes to ``OUT/code_<variant>.py``.

    PYTHONPATH=$PWD python scripts/profile_decoder.py --layers 4 --out /tmp/prof
"""

import argparse
import functools
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch._inductor.utils import run_and_get_code

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext.bench.backend import decoder_step_inputs
from inductor_ext.bench.harness import interleaved_graph_ms, kernel_class, kernel_us, kernel_us_by_class

VARIANTS: dict[str, dict[str, Any]] = {
    "torch_compile": {},
    "torch_compile_multi_kernel": {"options": {"triton.multi_kernel": 1}},
    "fastops_auto": {"backend": "fastops_inductor"},
    "fastops_kernel": {"backend": "fastops_inductor", "options": {"fastops.route": "kernel"}},
    "fastops_inductor": {"backend": "fastops_inductor", "options": {"fastops.route": "inductor"}},
    "fastops_inductor_no_mk": {"backend": "fastops_inductor",
                               "options": {"fastops.route": "inductor", "fastops.multi_kernel": 0}},
    "fastops_no_patterns": {"backend": "fastops_inductor", "options": {"fastops.patterns": False}},
}  # fmt: skip


def _step(fn: Any, x: torch.Tensor, params: list[torch.Tensor], dy: torch.Tensor) -> Any:
    return torch.autograd.grad(fn(x), (x, *params), dy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/profile_decoder"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, params, x, dy = decoder_step_inputs(args)
    steps = {}
    for name in args.variants:
        spec = VARIANTS[name]
        fn = torch.compile(model, backend=spec.get("backend", "inductor"), options=spec.get("options"))
        steps[name] = step = functools.partial(_step, fn, x, params, dy)
        _, codes = run_and_get_code(step)
        (args.out / f"code_{name}.py").write_text("\n\n# ---- next graph ----\n\n".join(codes))
        print(f"compiled {name}", flush=True)
    times = interleaved_graph_ms(steps)
    report: dict[str, Any] = {}
    for name, ms in times.items():
        ratios = [base / own for base, own in zip(times["torch_compile"], ms)]
        kernels = kernel_us(steps[name])
        classes = kernel_us_by_class(kernels)
        report[name] = {"ms": statistics.median(ms), "vs_compile": statistics.median(ratios),
                        "classes_us": dict(classes), "kernels_us": kernels}  # fmt: skip
        print(f"\n== {name}: {statistics.median(ms):.3f} ms, vs torch.compile {statistics.median(ratios):.4f}; "
              + ", ".join(f"{k} {v:.0f} us" for k, v in sorted(classes.items())))  # fmt: skip
        top = sorted(((us, k) for k, us in kernels.items() if kernel_class(k) == "other"), reverse=True)
        for us, kernel in top[:40]:
            print(f"   {us:9.1f} us  {kernel[:150]}")
    (args.out / "profile_decoder.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

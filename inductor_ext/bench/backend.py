"""``python -m inductor_ext.bench backend [--out DIR] [--layers 4] [--hidden 4096] [--batch 2] [--seq 2048]``:
an unmodified (HF-spelled) Llama-style decoder stack (:mod:`inductor_ext.bench.llama`), bf16,
forward+backward, side by side: eager, ``torch.compile`` default, and
``torch.compile(backend="fastops_inductor")`` with each route (``auto``, ``kernel``, ``inductor``).

Per provider: compile time (the first step, wall clock), GPU time per step from CUDA-graph
replay (host cost excluded; every provider's graph replayed in turn over 40 rounds, and the
ratio to ``torch.compile`` taken per round, so drift cancels), the stream median (host
included), and, for the backend, the route each fastops op took. A step is ``torch.autograd.grad(model(x), (x, *params), dy)``.
"""

import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters

from inductor_ext.bench.harness import (
    do_bench_median,
    interleaved_graph_ms,
    model_bench_parser,
    parse_on_gpu,
    show_route_timing,
)
from inductor_ext.bench.llama import LlamaStyleDecoder

ROUTES = ("auto", "kernel", "inductor")


def _step(fn: Any, x: torch.Tensor, params: Sequence[torch.Tensor], dy: torch.Tensor) -> Any:
    return lambda: torch.autograd.grad(fn(x), (x, *params), dy)


def main(argv: list[str] | None = None) -> int:
    parser = model_bench_parser("python -m inductor_ext.bench backend", __doc__, layers=4, batch=2, seq=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parse_on_gpu(parser, argv)
    show_route_timing()
    from tabulate import tabulate

    torch.manual_seed(0)
    hidden = args.hidden
    model = LlamaStyleDecoder(
        hidden=hidden, heads=hidden // 128, kv_heads=max(1, hidden // 512), intermediate=hidden * 7 // 2,
        layers=args.layers, spelling="hf",
    ).cuda().to(torch.bfloat16)  # fmt: skip
    params = list(model.parameters())
    x = torch.randn(args.batch, args.seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    providers: dict[str, Any] = {"eager": model, "torch_compile": torch.compile(model)}
    for route in ROUTES:
        options: dict[str, Any] = {"fastops.route": route}
        providers[f"fastops_{route}"] = torch.compile(model, backend="fastops_inductor", options=options)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
        "hidden": hidden, "shape": [args.batch, args.seq], "providers": {},
    }  # fmt: skip
    steps = {}
    for name, fn in providers.items():
        counters["inductor_ext"].clear()
        steps[name] = step = _step(fn, x, params, dy)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - start
        stream_ms, _, _ = do_bench_median(step)
        routes = {k: v for k, v in counters["inductor_ext"].items() if "->" in k}
        report["providers"][name] = {"first_step_s": first_s, "ms_stream": stream_ms, "routes": routes}
        print(f"{name}: first step {first_s:.1f} s, {stream_ms:.3f} ms (stream)", flush=True)
    # GPU time: every provider's CUDA graph replayed in turn, 40 rounds; ratios to torch.compile per round
    times = interleaved_graph_ms(steps)
    for name, ms in times.items():
        ratios = [base / own for base, own in zip(times["torch_compile"], ms)]
        deciles, ratio_deciles = statistics.quantiles(ms, n=10), statistics.quantiles(ratios, n=10)
        report["providers"][name].update(ms=statistics.median(ms), p20=deciles[1], p80=deciles[7],
                                         vs_compile=statistics.median(ratios),
                                         vs_compile_p20=ratio_deciles[1], vs_compile_p80=ratio_deciles[7])  # fmt: skip
    base = report["providers"]["torch_compile"]
    rows = [
        (name, f"{r['ms']:.3f}", f"{r['vs_compile']:.4f} ({r['vs_compile_p20']:.4f}-{r['vs_compile_p80']:.4f})",
         f"{r['ms_stream']:.3f}", f"{r['first_step_s']:.1f}", f"{r['first_step_s'] / base['first_step_s']:.2f}")
        for name, r in report["providers"].items()
    ]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backend_llama.json").write_text(json.dumps(report, indent=1))
    headers = ["provider", "ms (graph)", "vs compile (p20-p80 of rounds)", "ms (stream)", "first step s", "vs compile's"]
    print(tabulate(rows, headers=headers))
    print(json.dumps(report["providers"]["fastops_auto"]["routes"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

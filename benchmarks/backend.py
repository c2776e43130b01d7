"""``python -m benchmarks backend [--out DIR] [--layers 4] [--hidden 4096] [--batch 2] [--seq 2048]
[--no-compile-times | --compile-times-only] [--compile-providers PROVIDER ...]``:
an unmodified (HF-spelled) Llama-style decoder stack (:mod:`benchmarks.llama_style`), bf16,
forward+backward, side by side: eager, ``torch.compile`` default, and
``torch.compile(backend="fastops_inductor")`` with each route (``auto``, ``kernel``, ``inductor``).

Per provider: compile time (the first step's wall clock, each in a fresh process with empty
Inductor and Triton caches and an empty tuning database, so that no provider inherits another's
compiled kernels or the process's start-up costs; ``auto`` once more with the database its
first process filled: a restart's compile), GPU time per step from CUDA-graph
replay (host cost excluded; every provider's graph replayed in turn over 40 rounds, and the
ratio to ``torch.compile`` taken per round, so drift cancels), the stream median (host
included), the profiler's GPU time per step in GEMMs, attention and all other kernels (the
others are where our ops act: GEMM time alone varies by about 1% between compiled graphs), and,
for the backend, the route each fastops op took. Beside them, to explain a graph-replay time that
differs from the stream one: each provider's GPU time per kernel class inside its graph's replay,
and its peak memory over one step. A step is ``torch.autograd.grad(model(x), (x, *params), dy)``.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters

from benchmarks.harness import (
    capture_graphs,
    do_bench_median,
    fresh_cache_env,
    graph_kernel_us,
    interleaved_replay_ms,
    kernel_us,
    kernel_us_by_class,
    model_bench_parser,
    parse_on_gpu,
    print_child_result,
    run_child,
    show_route_timing,
)
from benchmarks.llama_style import LlamaStyleDecoder
from inductor_ext.inductor.options import ROUTES


def _step(fn: Any, x: torch.Tensor, params: Sequence[torch.Tensor], dy: torch.Tensor) -> Any:
    return lambda: torch.autograd.grad(fn(x), (x, *params), dy)


def _provider(name: str, model: torch.nn.Module) -> Any:
    if name == "eager":
        return model
    if name == "torch_compile":
        return torch.compile(model)
    route = name.removeprefix("fastops_")
    return torch.compile(model, backend="fastops_inductor", options={"fastops.route": route})


def decoder_step_inputs(args: Any) -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The HF-spelled stack of ``args`` (``hidden``, ``layers``, ``batch``, ``seq``) in bf16 on the GPU,
    its parameters, an input and a cotangent: what every provider's step runs on."""
    torch.manual_seed(0)
    hidden = args.hidden
    model = LlamaStyleDecoder(
        hidden=hidden, heads=hidden // 128, kv_heads=max(1, hidden // 512), intermediate=hidden * 7 // 2,
        layers=args.layers, spelling="hf",
    ).cuda().to(torch.bfloat16)  # fmt: skip
    x = torch.randn(args.batch, args.seq, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return model, list(model.parameters()), x, torch.randn_like(x)


def _first_step_s(name: str, args: Any) -> float:
    """Wall seconds of ``name``'s first step (its compile) in this process."""
    model, params, x, dy = decoder_step_inputs(args)
    step = _step(_provider(name, model), x, params, dy)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def first_step_command(args: Any, provider: str) -> list[str]:
    """The child process that prints ``provider``'s first-step (compile) seconds for ``args``'s decoder
    (``layers``, ``batch``, ``seq``, ``hidden``); run it with :func:`run_child`."""
    return [sys.executable, "-m", "benchmarks", "backend", "--layers", str(args.layers),
            "--batch", str(args.batch), "--seq", str(args.seq), "--hidden", str(args.hidden),
            "--first-step", provider]  # fmt: skip


COMPILE_PROVIDERS = ("torch_compile", *(f"fastops_{route}" for route in ROUTES), "fastops_auto_warm_db")
"""Whose compile times the bench can take, in the order it takes them."""


def _compile_times(args: Any) -> dict[str, float]:
    """First-step seconds of each provider in ``args.compile_providers``, each in a fresh process
    (:func:`fresh_cache_env`); ``fastops_auto_warm_db`` reuses the tuning database ``fastops_auto``'s
    process filled."""
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="backend_bench_") as scratch:
        auto_db = tempfile.mkdtemp(dir=scratch)
        for name in (name for name in COMPILE_PROVIDERS if name in args.compile_providers):
            tuning_dir = auto_db if name.startswith("fastops_auto") else tempfile.mkdtemp(dir=scratch)
            command = first_step_command(args, name.removesuffix("_warm_db"))
            seconds[name] = run_child(command, fresh_cache_env(scratch, tuning_dir))["seconds"]
            print(f"{name}: first step (compile) {seconds[name]:.1f} s in a fresh process", flush=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = model_bench_parser("python -m benchmarks backend", __doc__, layers=4, batch=2, seq=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    compile_times = parser.add_mutually_exclusive_group()
    compile_times.add_argument("--no-compile-times", action="store_true",
                       help="skip the fresh-process compile times (about half of the run)")  # fmt: skip
    compile_times.add_argument("--compile-times-only", action="store_true",
                       help="only the fresh-process compile times (about half of the run)")  # fmt: skip
    parser.add_argument("--compile-providers", nargs="+", choices=COMPILE_PROVIDERS, default=list(COMPILE_PROVIDERS),
                        metavar="PROVIDER", help=f"whose compile times to take (default: all of {', '.join(COMPILE_PROVIDERS)}); "
                        "torch_compile is the ratios' base, and fastops_auto_warm_db needs fastops_auto's database")  # fmt: skip
    parser.add_argument("--first-step", help=argparse.SUPPRESS)  # a child process: one provider's compile time
    args = parse_on_gpu(parser, argv, check=_check_compile_providers)
    show_route_timing()
    if args.first_step is not None:
        print_child_result({"seconds": _first_step_s(args.first_step, args)})
        return 0
    from tabulate import tabulate

    compile_s = {} if args.no_compile_times else _compile_times(args)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers,
        "hidden": args.hidden, "shape": [args.batch, args.seq], "providers": {},
        "first_step_s_fresh_process": compile_s,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compile_times_only:
        _print_compile_times(compile_s)
        (args.out / "backend_llama_compile_times.json").write_text(json.dumps(report, indent=1))
        return 0
    model, params, x, dy = decoder_step_inputs(args)
    providers = {name: _provider(name, model) for name in ("eager", "torch_compile", *(f"fastops_{r}" for r in ROUTES))}
    steps = {}
    for name, fn in providers.items():
        counters["inductor_ext"].clear()
        steps[name] = step = _step(fn, x, params, dy)
        step()  # compiles (the compile times above come from fresh processes)
        torch.cuda.reset_peak_memory_stats()  # the allocator's statistics are kept on the host: no sync
        step()
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        stream_ms, _, _ = do_bench_median(step)
        routes = {k: v for k, v in counters["inductor_ext"].items() if "->" in k}
        kernels = kernel_us(step)
        report["providers"][name] = {"ms_stream": stream_ms, "routes": routes, "peak_gib": peak_gib,
                                     "kernel_us_by_class": kernel_us_by_class(kernels), "kernel_us": kernels}  # fmt: skip
        print(f"{name}: {stream_ms:.3f} ms (stream)", flush=True)
    # GPU time: every provider's CUDA graph replayed in turn, 40 rounds; ratios to torch.compile per round
    graphs = capture_graphs(steps)
    times = interleaved_replay_ms(graphs)
    for name, graph in graphs.items():
        in_graph = graph_kernel_us(graph)
        report["providers"][name].update(
            kernel_us_by_class_graph=kernel_us_by_class(in_graph), kernel_us_graph=in_graph
        )
    for name, ms in times.items():
        ratios = [base / own for base, own in zip(times["torch_compile"], ms)]
        deciles, ratio_deciles = statistics.quantiles(ms, n=10), statistics.quantiles(ratios, n=10)
        report["providers"][name].update(ms=statistics.median(ms), p20=deciles[1], p80=deciles[7],
                                         vs_compile=statistics.median(ratios),
                                         vs_compile_p20=ratio_deciles[1], vs_compile_p80=ratio_deciles[7])  # fmt: skip
    rows = [
        (name, f"{r['ms']:.3f}", f"{r['vs_compile']:.4f} ({r['vs_compile_p20']:.4f}-{r['vs_compile_p80']:.4f})",
         f"{r['ms_stream']:.3f}", *(f"{r['kernel_us_by_class'][c]:.0f}" for c in ("gemm", "attention", "other")),
         *(f"{r['kernel_us_by_class_graph'][c]:.0f}" for c in ("gemm", "attention", "other")), f"{r['peak_gib']:.2f}")
        for name, r in report["providers"].items()
    ]  # fmt: skip
    headers = ["provider", "ms (graph)", "vs compile (p20-p80 of rounds)", "ms (stream)", "GEMM us", "attention us",
               "other kernels us", "in graph: GEMM", "attention", "other", "peak GiB"]  # fmt: skip
    print(tabulate(rows, headers=headers))
    if compile_s:
        _print_compile_times(compile_s)
    print(json.dumps(report["providers"]["fastops_auto"]["routes"], indent=1))
    (args.out / "backend_llama.json").write_text(json.dumps(report, indent=1))
    return 0


def _check_compile_providers(args: Any) -> str | None:
    providers = args.compile_providers
    if "torch_compile" not in providers:
        return "--compile-providers must include torch_compile (the compile times' ratios are to it)"
    if "fastops_auto_warm_db" in providers and "fastops_auto" not in providers:
        return "--compile-providers: fastops_auto_warm_db needs fastops_auto (it reuses its tuning database)"
    return None


def _print_compile_times(compile_s: dict[str, float]) -> None:
    from tabulate import tabulate

    base_s = compile_s["torch_compile"]
    rows = [(name, f"{s:.1f}", f"{s / base_s:.2f}") for name, s in compile_s.items()]
    print(tabulate(rows, headers=["provider", "first step s (fresh process)", "vs torch.compile's"]))


if __name__ == "__main__":
    raise SystemExit(main())

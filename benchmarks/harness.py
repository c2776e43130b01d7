"""The op micro-benchmarks' harness: median time, GB/s over minimal bytes, fraction of copy bandwidth.

Every provider of one op runs in the same process and on the same inputs; the copy bandwidth is measured
in the same run (a 2 GiB device-to-device copy, bytes read plus bytes written). Inputs are rotated among
several copies when one set would fit in L2.
"""

import argparse
import dataclasses
import json
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from inductor_ext.bench.harness import (
    LAUNCH_GAP_US,
    ClockSampler,
    Timeline,
    copy_bandwidth_gbps,
    do_bench_median,
    fresh_cache_env,
    gpu_timeline,
    idle_gaps,
    kernel_class,
    kernel_us,
    kernel_us_by_class,
    print_child_result,
    run_child,
)
from inductor_ext.tuning.timing import capture_graph, graph_replay_ms, replay_ms

__all__ = [
    "LAUNCH_GAP_US",
    "ClockSampler",
    "Timeline",
    "copy_bandwidth_gbps",
    "do_bench_median",
    "fresh_cache_env",
    "gpu_timeline",
    "idle_gaps",
    "kernel_class",
    "kernel_us",
    "kernel_us_by_class",
    "print_child_result",
    "rel_err",
    "run_child",
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64 (an all-zero ``ref`` divides by 1e-30): the numerics check the
    benchmarks print and the tests bound (a host sync)."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # shared with bench train/generate


Inputs = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Provider:
    """A way to run the op: ``build(inputs) -> zero-arg callable`` that runs it once."""

    name: str
    build: Callable[[Inputs], Callable[[], Any]]


@dataclasses.dataclass
class Result:
    """One provider at one shape. ``ms`` is the GPU time per call from CUDA-graph replay
    (kernels back to back, host cost excluded); ``ms_stream`` is the plain stream timing,
    which includes host-bound gaps when Python and autograd are slower than the GPU."""

    op: str
    mode: str
    shape: str
    dtype: str
    provider: str
    ms: float
    ms_p20: float
    ms_p80: float
    ms_stream: float
    gbps: float
    copy_fraction: float
    speedup_vs_compile: float = float("nan")


def model_bench_parser(
    prog: str, description: str | None, *, layers: int, batch: int, seq: int
) -> argparse.ArgumentParser:
    """The arguments every model-level benchmark takes (``--out``, ``--layers``, ``--batch``,
    ``--seq``), with that benchmark's defaults; it adds its own."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON")
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers")
    parser.add_argument("--batch", type=int, default=batch, help="tokens per step: batch")
    parser.add_argument("--seq", type=int, default=seq, help="tokens per step: sequence length")
    return parser


def parse_on_gpu(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    check: Callable[[argparse.Namespace], str | None] = lambda args: None,
) -> argparse.Namespace:
    """``parser``'s arguments; a usage error if ``check(args)`` returns one (a message), then on a
    machine without a CUDA GPU."""
    args = parser.parse_args(argv)
    if (error := check(args)) is not None:
        parser.error(error)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    return args


def show_route_timing() -> None:
    """Print the backend's route decisions and what each route timing spent, per stage (the INFO
    records of :mod:`inductor_ext.inductor.route_planner` and :mod:`inductor_ext.tuning.routes`):
    where a cold compile's time goes."""
    for name in ("inductor_ext.inductor.route_planner", "inductor_ext.tuning.routes"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def bench_graph_median(
    fn: Callable[[], Any], calls_per_graph: int = 10, replays: int = 30
) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) ms per call from replays of a CUDA graph of ``calls_per_graph``
    calls (:func:`inductor_ext.tuning.timing.graph_replay_ms`); autograd backward inside the
    capture is supported by PyTorch (whole-network capture)."""
    times = graph_replay_ms([fn] * calls_per_graph, replays)
    deciles = statistics.quantiles(times, n=10)
    return statistics.median(times), deciles[1], deciles[7]


def capture_graphs(fns: Mapping[str, Callable[[], Any]], calls_per_graph: int = 5) -> dict[str, torch.cuda.CUDAGraph]:
    """One CUDA graph of ``calls_per_graph`` calls per function (warmed up first)."""
    return {name: capture_graph([fn] * calls_per_graph) for name, fn in fns.items()}


def interleaved_replay_ms(
    graphs: Mapping[str, torch.cuda.CUDAGraph], calls_per_graph: int = 5, rounds: int = 40
) -> dict[str, list[float]]:
    """GPU ms per call of each graph's function in each of ``rounds`` rounds, the graphs replayed in
    turn within each round: clock and thermal drift then hits every function alike, and per-round
    ratios cancel it. The order rotates from round to round (:func:`rotated_order`), so no graph
    always follows the same one or holds the same place in a round (an earlier decoder bench
    replayed eager, torch.compile, then the backend's three routes in a fixed order, and the
    graph-minus-stream time grew with the place: +0.81, +1.37, +1.38, +1.99 ms)."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for round_index in range(rounds):
        for name in rotated_order(list(graphs), round_index):
            times[name].append(replay_ms(graphs[name]) / calls_per_graph)
    return times


def rotated_order(names: Sequence[str], round_index: int) -> list[str]:
    """``names`` rotated left by ``round_index``: over ``len(names)`` rounds each takes every place once."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def interleaved_graph_ms(
    fns: Mapping[str, Callable[[], Any]], calls_per_graph: int = 5, rounds: int = 40
) -> dict[str, list[float]]:
    """:func:`interleaved_replay_ms` of :func:`capture_graphs`."""
    return interleaved_replay_ms(capture_graphs(fns, calls_per_graph), calls_per_graph, rounds)


def graph_kernel_us(graph: torch.cuda.CUDAGraph, calls_per_graph: int = 5) -> dict[str, float]:
    """:func:`kernel_us` per call inside a CUDA graph's replay (the profiler sees graph kernels), to
    set beside the same function's stream-order profile."""
    return {name: us / calls_per_graph for name, us in kernel_us(graph.replay, steps=2).items()}


def rotation_count(bytes_per_set: int) -> int:
    """Copies of the inputs needed so that one sweep exceeds twice the L2 cache."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, math.ceil(2 * l2 / max(bytes_per_set, 1)))


def rotating(calls: Sequence[Callable[[], Any]]) -> Callable[[], Any]:
    state = {"i": 0}

    def run() -> Any:
        state["i"] = (state["i"] + 1) % len(calls)
        return calls[state["i"]]()

    return run


def reference_and_backend_providers(
    wrap: Callable[[Callable[..., Any]], Callable[[Inputs], Callable[[], Any]]],
    reference: Callable[..., Any],
    ours: Callable[..., Any],
) -> list[Provider]:
    """The providers of an op the backend rewrites: ``reference`` (the HF spelling) eager and under
    ``torch.compile``, ``ours`` eager and compiled, and ``reference`` under ``fastops_inductor`` with
    route ``auto`` (``fastops_backend``) and each route forced (``"auto"`` should land within a few %
    of the faster). ``wrap`` makes a provider's build function from a callable."""

    def backend(route: str) -> Callable[..., Any]:
        return torch.compile(reference, fullgraph=True, backend="fastops_inductor", options={"fastops.route": route})

    return [
        Provider("hf_eager", wrap(reference)),
        Provider("torch_compile", wrap(torch.compile(reference, fullgraph=True))),
        Provider("fastops_eager", wrap(ours)),
        Provider("fastops_compile", wrap(torch.compile(ours, fullgraph=True))),
        Provider("fastops_backend", wrap(backend("auto"))),
        *(Provider(f"fastops_backend_{route}", wrap(backend(route))) for route in ("kernel", "inductor")),
    ]


def run_matrix_op(
    op: str,
    bytes_per_element: Mapping[str, int],
    shapes: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    copy_gbps: float,
    make_inputs: Callable[[int, int, torch.dtype], Callable[[], Inputs]],
    providers: Callable[[str], list[Provider]],
) -> list[Result]:
    """Every mode of ``bytes_per_element`` at every ``(M, N)`` shape, all providers side by side.

    Minimal bytes of a mode: ``bytes_per_element[mode] * M * N * element size`` (e.g.
    RMSNorm: 2 for the forward, 5 for forward+backward). Dynamo is reset per shape.
    """
    results = []
    element_size = torch.finfo(dtype).bits // 8
    for mode, factor in bytes_per_element.items():
        for m, n in shapes:
            torch._dynamo.reset()
            results += run_providers(
                op, mode, f"{m}x{n}", dtype, make_inputs(m, n, dtype), factor * m * n * element_size,
                providers(mode), copy_gbps, baseline="torch_compile",
            )  # fmt: skip
    return results


def run_providers(
    op: str,
    mode: str,
    shape: str,
    dtype: torch.dtype,
    make_inputs: Callable[[], Inputs],
    min_bytes: int,
    providers: Sequence[Provider],
    copy_gbps: float,
    baseline: str,
) -> list[Result]:
    sets = [make_inputs() for _ in range(rotation_count(min_bytes))]
    results = []
    for p in providers:
        fn = rotating([p.build(inputs) for inputs in sets])
        ms_stream, _, _ = do_bench_median(fn)
        try:
            ms, lo, hi = bench_graph_median(fn)
        except RuntimeError as error:  # one provider that cannot be captured must not end the run
            print(f"{op} {mode} {shape} {p.name}: CUDA graph capture failed ({error}); GPU time not measured")
            ms = lo = hi = float("nan")
        gbps = min_bytes / ms / 1e6
        dt = str(dtype).removeprefix("torch.")
        results.append(Result(op, mode, shape, dt, p.name, ms, lo, hi, ms_stream, gbps, gbps / copy_gbps))
        # one line per measurement as it lands: a run cut short still shows what it measured
        print(f"{op} {mode} {shape} {p.name}: {ms:.4f} ms, {100 * gbps / copy_gbps:.1f}% of copy", flush=True)
    base = next((r.ms for r in results if r.provider == baseline), float("nan"))
    for r in results:
        r.speedup_vs_compile = base / r.ms
    return results


def write_results(results: Sequence[Result], extra: dict[str, Any], out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [dataclasses.asdict(r) for r in results]
    (out / f"{stem}.json").write_text(json.dumps({**extra, "results": rows}, indent=1))


def table(results: Sequence[Result]) -> str:
    from tabulate import tabulate

    rows = [
        (r.mode, r.shape, r.provider, f"{r.ms:.4f}", f"{r.gbps:.0f}", f"{100 * r.copy_fraction:.1f}%",
         f"{r.speedup_vs_compile:.2f}x", f"{r.ms_stream:.4f}")
        for r in results
    ]  # fmt: skip
    headers = ["mode", "shape", "provider", "ms (graph)", "GB/s", "of copy", "vs compile", "ms (stream)"]
    return tabulate(rows, headers=headers)


def plot(results: Sequence[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r.mode for r in results})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rs = [r for r in results if r.mode == mode]
        shapes = list(dict.fromkeys(r.shape for r in rs))
        providers = list(dict.fromkeys(r.provider for r in rs))
        width = 0.8 / len(providers)
        for i, prov in enumerate(providers):
            vals = [next((100 * r.copy_fraction for r in rs if r.shape == s and r.provider == prov), 0) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=prov)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=15)
        ax.set_ylabel("% of measured copy bandwidth")
        ax.set_title(f"{title}: {mode}")
        ax.axhline(100, color="grey", lw=0.5)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

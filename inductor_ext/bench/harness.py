"""Side-by-side benchmark harness: median time, GB/s over minimal bytes, fraction of copy bandwidth.

Every provider of one op runs in the same process and on the same inputs; the
copy bandwidth is measured in the same run (a 2 GiB device-to-device copy,
bytes read plus bytes written). Inputs are rotated among several copies when
one set would fit in L2.
"""

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import torch

from inductor_ext.tuning.timing import capture_graph, graph_replay_ms, replay_ms

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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64: the numerics check the benchmarks and sweeps print (a host sync)."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


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
    records of :mod:`inductor_ext.inductor.choice`): where a cold compile's time goes."""
    logger = logging.getLogger("inductor_ext.inductor.choice")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def fresh_cache_env(scratch: str, tuning_dir: str) -> dict[str, str]:
    """Environment for empty Inductor and Triton caches under ``scratch`` (nothing compiled before
    is reused) and the tuning database in ``tuning_dir``."""
    return {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=scratch), "TRITON_CACHE_DIR": tempfile.mkdtemp(dir=scratch),
            "INDUCTOR_EXT_CACHE_DIR": tuning_dir}  # fmt: skip


CHILD_RESULT = "BENCH_CHILD_RESULT "
"""Prefix of the JSON line a benchmark's child process prints as its result (:func:`print_child_result`)."""


def print_child_result(result: Mapping[str, Any]) -> None:
    print(CHILD_RESULT + json.dumps(result), flush=True)


def run_child(command: Sequence[str], env: Mapping[str, str]) -> dict[str, Any]:
    """Run a benchmark's child process (a fresh interpreter: no compiler state, process-wide
    start-up costs paid inside) with ``env`` added; the result it printed."""
    proc = subprocess.run(list(command), env={**os.environ, **env}, stdout=subprocess.PIPE, text=True, check=False)
    results = [line for line in proc.stdout.splitlines() if line.startswith(CHILD_RESULT)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}); its stdout:\n{proc.stdout[-4000:]}")
    return dict(json.loads(results[-1].removeprefix(CHILD_RESULT)))


def kernel_class(name: str) -> str:
    """``"gemm"`` (cuBLAS/cuBLASLt, CUTLASS), ``"attention"`` (SDPA's flash/cuDNN kernels), ``"optimizer"``
    (PyTorch's fused/foreach optimizer kernels) or ``"other"`` (what Inductor and our ops generate:
    pointwise, reductions, memsets) for a GPU kernel name."""
    lowered = name.lower()
    if "multi_tensor_apply" in lowered or "adam" in lowered:
        return "optimizer"
    if lowered.startswith("nvjet") or any(s in lowered for s in ("gemm", "xmma", "cutlass")):
        return "gemm"
    if any(s in lowered for s in ("sdpa", "flash", "fmha", "cudnn::fusion")):
        return "attention"
    return "other"


class ClockSampler:
    """The GPU's mean SM clock (MHz) and board power (W) while the ``with`` block runs, sampled by
    ``nvidia-smi`` every ``period_ms``; ``mean`` is None without ``nvidia-smi`` or a GPU.

    An H200 at its 700 W power limit lowers its SM clock (1980 MHz idle-to-moderate load, about
    1750 in a dense compiled training step), and compute-bound kernels (GEMMs, attention) slow
    down with it: a kernel's time in two runs compares only at the same clock.
    """

    def __init__(self, period_ms: int = 50) -> None:
        self.period_ms = period_ms
        self.mean: dict[str, float] | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        uuid = getattr(torch.cuda.get_device_properties(), "uuid", None) if torch.cuda.is_available() else None
        if uuid is not None and shutil.which("nvidia-smi"):
            command = ["nvidia-smi", "-i", f"GPU-{uuid}", "--query-gpu=clocks.sm,power.draw",
                       "--format=csv,noheader,nounits", "-lms", str(self.period_ms)]  # fmt: skip
            self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate()
            self.mean = mean_clock_and_power(out)


def mean_clock_and_power(smi_csv: str) -> dict[str, float] | None:
    """Mean of ``nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits`` lines."""
    samples = []
    for line in smi_csv.splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((float(fields[0]), float(fields[1])))
        except (IndexError, ValueError):
            continue  # a line cut by the terminate, or "[N/A]"
    if not samples:
        return None
    return {"sm_clock_mhz": statistics.fmean(s[0] for s in samples), "power_w": statistics.fmean(s[1] for s in samples)}


LAUNCH_GAP_US = 5.0
"""Longest idle gap between two kernels counted as launch latency rather than waiting for the host."""


@dataclasses.dataclass
class Timeline:
    """Per step: GPU µs and launches per kernel name, and the GPU's busy and idle µs."""

    kernel_us: dict[str, float]
    calls: dict[str, float]
    busy_us: float
    launch_gap_us: float
    host_wait_us: float


def idle_gaps(intervals: Iterable[tuple[float, float]]) -> tuple[float, float, float]:
    """(busy, short gaps, long gaps) µs of kernel ``(start, end)`` intervals on any streams: the union's
    length, and the gaps between its pieces up to :data:`LAUNCH_GAP_US` and longer."""
    busy = short = long = 0.0
    reach = None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            if reach is not None:
                gap = start - reach
                short, long = (short + gap, long) if gap <= LAUNCH_GAP_US else (short, long + gap)
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy, short, long


def gpu_timeline(step: Callable[[], Any], steps: int) -> Timeline:
    """Profile ``steps`` calls of ``step`` on the GPU only (no host-side events: the profiler adds no host
    time between launches); per call: each kernel's µs and launches, the union of the kernels' intervals
    (busy), and the idle gaps between them split at :data:`LAUNCH_GAP_US` (:func:`idle_gaps`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernel_us: dict[str, float] = {}
    calls: dict[str, float] = {}
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us[event.name] = kernel_us.get(event.name, 0.0) + event.device_time / steps
            calls[event.name] = calls.get(event.name, 0.0) + 1 / steps
            intervals.append((event.time_range.start, event.time_range.end))
    busy, short, long = idle_gaps(intervals)
    # the gaps between steps are the caller's (a sync, the next step's guards): they count here too
    return Timeline(kernel_us, calls, busy / steps, short / steps, long / steps)


def kernel_us(step: Callable[[], Any], steps: int = 5) -> dict[str, float]:
    """GPU µs per call of ``step`` in each kernel (by name), from the profiler over ``steps`` calls."""
    return gpu_timeline(step, steps).kernel_us


def kernel_us_by_class(kernels: Mapping[str, float]) -> dict[str, float]:
    """:func:`kernel_us` summed per :func:`kernel_class`."""
    classes = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for name, us in kernels.items():
        classes[kernel_class(name)] += us
    return classes


def do_bench_median(fn: Callable[[], Any], rep_ms: int = 200) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) ms with CUDA events, via ``triton.testing.do_bench``."""
    import triton.testing

    qs = triton.testing.do_bench(fn, warmup=50, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return qs[0], qs[1], qs[2]


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


def copy_bandwidth_gbps(gib: float = 2.0) -> float:
    """Measured device-to-device copy bandwidth (read + write bytes), GB/s."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms, _, _ = do_bench_median(lambda: dst.copy_(src))
    return 2 * n * 4 / ms / 1e6


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

"""What ``bench train`` and ``bench generate`` share: each provider in a child process with fresh compile
caches, the GPU's kernel timeline of a step, its SM clock and power while timed, and the copy bandwidth."""

import dataclasses
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

import torch


def package_version(package: str) -> str | None:
    """The installed version of ``package`` (a distribution name), or None where it is not installed: a
    benchmark's JSON records what it ran with."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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

    A GPU at its power limit lowers its SM clock, and compute-bound kernels (GEMMs, attention) slow
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
    """(median, 20th, 80th percentile) milliseconds with CUDA events, via ``triton.testing.do_bench``."""
    import triton.testing

    qs = triton.testing.do_bench(fn, warmup=50, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return qs[0], qs[1], qs[2]


def copy_bandwidth_gbps(gib: float = 2.0) -> float:
    """This device's device-to-device copy bandwidth, timed on the call (read + write bytes), in GB/s."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms, _, _ = do_bench_median(lambda: dst.copy_(src))
    return 2 * n * 4 / ms / 1e6

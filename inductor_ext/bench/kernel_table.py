"""Where a step's GPU time goes, kernel by kernel (``bench train --kernel-table``): each kernel's time,
the bytes its launch arguments hold and its rate against the measured copy bandwidth; and how long the
GPU sat idle between kernels.

- **Time and idle gaps**: :func:`inductor_ext.bench.harness.gpu_timeline`.
- **Bytes** (:func:`launch_bytes`): Inductor records each Triton kernel it launches (its own and ours,
  lowered into its graphs) under the kernel's name with the kernel's arguments; with ``record_shapes``
  the trace holds every tensor argument's sizes and dtype, and their sum is the bytes of every buffer
  the kernel reads or writes, each counted once: its traffic if it touches each once, so GB/s against
  the copy bandwidth (read + write bytes) is its distance from its bandwidth floor. Kernels launched
  elsewhere (cuBLAS, cuDNN, the fused optimizer, eager ops) have no bytes here.
"""

import json
import math
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from inductor_ext.bench.harness import Timeline, kernel_class

_TRACE_DTYPES: dict[str, torch.dtype] = {
    "float": torch.float32, "double": torch.float64, "c10::Half": torch.float16, "c10::BFloat16": torch.bfloat16,
    "c10::Float8_e4m3fn": torch.float8_e4m3fn, "c10::Float8_e5m2": torch.float8_e5m2, "long int": torch.int64,
    "int": torch.int32, "short int": torch.int16, "signed char": torch.int8, "unsigned char": torch.uint8,
    "bool": torch.bool,
}  # fmt: skip
"""The profiler's names of tensor dtypes in a trace's ``Input type`` (others, e.g. ``Scalar``: not tensors)."""


def bytes_from_trace(trace: Mapping[str, Any]) -> dict[str, float]:
    """Mean bytes per launch of each kernel in a Chrome trace recorded with ``record_shapes``: the sizes
    of the tensor arguments of the host-side record that carries the kernel's own name (Inductor's
    launch record), for kernels that have one."""
    launches = {}
    for event in trace.get("traceEvents", []):
        args = event.get("args", {})
        if event.get("cat") == "cpu_op" and "External id" in args and "Input Dims" in args:
            launches[args["External id"]] = event
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel":
            continue
        launch = launches.get(event.get("args", {}).get("External id"))
        if launch is None or launch["name"] != event["name"]:
            continue
        args = launch["args"]
        size = sum(
            math.prod(dims) * _TRACE_DTYPES[kind].itemsize
            for dims, kind in zip(args["Input Dims"], args.get("Input type", []))
            if kind in _TRACE_DTYPES
        )
        total[event["name"]] = total.get(event["name"], 0.0) + size
        count[event["name"]] = count.get(event["name"], 0) + 1
    return {name: total[name] / count[name] for name in total}


def launch_bytes(step: Callable[[], Any]) -> dict[str, float]:
    """Bytes per launch of each kernel Inductor launches in one call of ``step`` (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return bytes_from_trace(json.loads(path.read_text()))


def kernel_rows(timeline: Timeline, bytes_per_launch: Mapping[str, float], copy_gbps: float) -> list[dict[str, Any]]:
    """One row per kernel, the costliest first: class, launches, ms and GB a step, GB/s, % of ``copy_gbps``
    (the last three None for a kernel without bytes)."""
    rows = []
    for name, us in sorted(timeline.kernel_us.items(), key=lambda kv: -kv[1]):
        launch = bytes_per_launch.get(name)
        gb = None if launch is None else launch * timeline.calls[name] / 1e9
        rate = None if gb is None or us <= 0 else gb / (us / 1e6)
        rows.append({
            "kernel": name, "class": kernel_class(name), "launches": round(timeline.calls[name], 2),
            "ms": us / 1e3, "gb": gb, "gb_per_s": rate, "pct_of_copy": None if rate is None else 100 * rate / copy_gbps,
        })  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], top: int = 25, width: int = 60) -> str:
    """The ``top`` rows as a GitHub table (kernel names cut to ``width`` characters)."""
    from tabulate import tabulate

    def cell(value: Any, digits: int) -> Any:
        return "" if value is None else round(value, digits)

    table = [
        [r["kernel"][:width], r["class"], r["launches"], cell(r["ms"], 3), cell(r["gb"], 3), cell(r["gb_per_s"], 0),
         cell(r["pct_of_copy"], 0)]
        for r in rows[:top]
    ]  # fmt: skip
    headers = ["kernel", "class", "launches", "ms / step", "GB / step", "GB/s", "% of copy"]
    return tabulate(table, headers=headers, tablefmt="github")

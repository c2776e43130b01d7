"""``python -m benchmarks kernel_table [--model llama-3.2-1b] [--provider fastops_inductor] [--out DIR]``:
where one ``bench train`` provider's step spends its GPU time, kernel by kernel: each kernel's time,
the bytes its launch arguments hold and its rate against the measured copy bandwidth; and how long the
GPU sat idle between kernels.

- **Time and idle gaps**: :func:`benchmarks.harness.gpu_timeline`.
- **Bytes** (:func:`launch_bytes`): Inductor records each Triton kernel it launches (its own and ours,
  lowered into its graphs) under the kernel's name with the kernel's arguments; with ``record_shapes``
  the trace holds every tensor argument's sizes and dtype, and their sum is the bytes of every buffer
  the kernel reads or writes, each counted once: its traffic if it touches each once, so GB/s against
  the copy bandwidth (read + write bytes) is its distance from its bandwidth floor. A buffer Inductor
  updates in place (an ``in_out_ptr`` parameter of its generated kernel, e.g. a gradient accumulated
  into one of the summands) is read and written, and counts twice (:func:`in_out_arguments`). Kernels launched
  elsewhere (cuBLAS, cuDNN, the fused optimizer, eager ops) have no bytes here; their row names the
  host op that launched them, with its tensor arguments' shapes and dtypes (``launched_by``: e.g.
  ``aten::fill_ 128256x2048 bfloat16`` says which buffer a fill kernel zeroes).
"""

import argparse
import dataclasses
import json
import math
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Timeline, copy_bandwidth_gbps, gpu_timeline, kernel_class

_TRACE_DTYPES: dict[str, torch.dtype] = {
    "float": torch.float32, "double": torch.float64, "c10::Half": torch.float16, "c10::BFloat16": torch.bfloat16,
    "c10::Float8_e4m3fn": torch.float8_e4m3fn, "c10::Float8_e5m2": torch.float8_e5m2, "long int": torch.int64,
    "int": torch.int32, "short int": torch.int16, "signed char": torch.int8, "unsigned char": torch.uint8,
    "bool": torch.bool,
}  # fmt: skip
"""The profiler's names of tensor dtypes in a trace's ``Input type`` (others, e.g. ``Scalar``: not tensors)."""


@dataclasses.dataclass
class Launches:
    """What a profiled step's trace says about each kernel's launches."""

    bytes_per_launch: dict[str, float]
    """Kernels Inductor launched: mean bytes of their launch record's tensor arguments."""
    launched_by: dict[str, str]
    """Other kernels: the host op that launched the first of them, with its tensor arguments."""


def _tensor_arguments(args: Mapping[str, Any]) -> list[tuple[int, list[int], torch.dtype]]:
    """``(position among all the arguments, sizes, dtype)`` of a launch record's tensor arguments."""
    return [
        (position, dims, _TRACE_DTYPES[kind])
        for position, (dims, kind) in enumerate(zip(args["Input Dims"], args.get("Input type", [])))
        if kind in _TRACE_DTYPES
    ]


def in_out_arguments() -> dict[str, list[bool]]:
    """For each Triton kernel Inductor generated in this process: which of its launch arguments, the
    parameters that are not ``tl.constexpr`` in order, are ``in_out_ptr`` buffers, read and written in
    place. Read from the kernels' source files: the modules in ``PyCodeCache`` and the files of the
    ``CachingAutotuner`` objects alive (a kernel compiled in a worker process is loaded from its file)."""
    import gc

    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    paths = {
        getattr(module, "__file__", None) for module in [*PyCodeCache.modules, *PyCodeCache.modules_no_attr.values()]
    }
    # type(), not isinstance(): the latter reads __class__, which some deprecated objects warn on
    paths |= {obj.filename for obj in gc.get_objects() if issubclass(type(obj), CachingAutotuner)}
    found: dict[str, list[bool]] = {}
    for path in filter(None, paths):
        if not Path(path).is_file():
            continue
        for name, parameters in _KERNEL_SIGNATURE.findall(Path(path).read_text()):
            launched = [p.strip() for p in parameters.split(",") if p.strip() and "constexpr" not in p]
            found[name] = [p.startswith("in_out_ptr") for p in launched]
    return found


_KERNEL_SIGNATURE = re.compile(r"^def (triton_\w+)\(([^)]*)\)", re.MULTILINE)
"""The signature of an Inductor-generated Triton kernel (``def triton_poi_fused_add_0(in_out_ptr0, ...)``)."""


def launches_from_trace(trace: Mapping[str, Any], in_out: Mapping[str, list[bool]] | None = None) -> Launches:
    """Each kernel's launches in a Chrome trace recorded with ``record_shapes``, joined to the host-side
    record that launched them by the external id: bytes for those whose record carries the kernel's own
    name (Inductor's launch record; a buffer ``in_out`` marks for the kernel counted twice, when the record
    has as many arguments as the marks), the launching op for the others."""
    records = {}
    for event in trace.get("traceEvents", []):
        args = event.get("args", {})
        if event.get("cat") == "cpu_op" and "External id" in args and "Input Dims" in args:
            records[args["External id"]] = event
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    launched_by: dict[str, str] = {}
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel":
            continue
        record = records.get(event.get("args", {}).get("External id"))
        if record is None:
            continue
        name = event["name"]
        if record["name"] != name:
            if name not in launched_by:  # the first launch's op and arguments
                shapes = " ".join(
                    f"{'x'.join(map(str, dims))} {str(dtype).removeprefix('torch.')}"
                    for _, dims, dtype in _tensor_arguments(record["args"])
                )
                launched_by[name] = f"{record['name']} {shapes}".strip()
            continue
        total[name] = total.get(name, 0.0) + _launch_bytes(record["args"], (in_out or {}).get(name))
        count[name] = count.get(name, 0) + 1
    return Launches({name: total[name] / count[name] for name in total}, launched_by)


def _launch_bytes(args: Mapping[str, Any], in_out: list[bool] | None) -> float:
    twice = in_out if in_out is not None and len(in_out) == len(args.get("Input type", [])) else None
    return sum(
        math.prod(dims) * dtype.itemsize * (2 if twice is not None and twice[position] else 1)
        for position, dims, dtype in _tensor_arguments(args)
    )


def profile_launches(step: Callable[[], Any]) -> Launches:
    """:func:`launches_from_trace` of one call of ``step`` (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return launches_from_trace(json.loads(path.read_text()), in_out_arguments())


def kernel_rows(timeline: Timeline, launches: Launches, copy_gbps: float) -> list[dict[str, Any]]:
    """One row per kernel, the costliest first: class, launches, ms and GB a step, GB/s, % of ``copy_gbps``
    (the last three None for a kernel without bytes) and the host op that launched it (None for Inductor's)."""
    rows = []
    for name, us in sorted(timeline.kernel_us.items(), key=lambda kv: -kv[1]):
        launch = launches.bytes_per_launch.get(name)
        gb = None if launch is None else launch * timeline.calls[name] / 1e9
        rate = None if gb is None or us <= 0 else gb / (us / 1e6)
        rows.append({
            "kernel": name, "class": kernel_class(name), "launches": round(timeline.calls[name], 2),
            "ms": us / 1e3, "gb": gb, "gb_per_s": rate, "pct_of_copy": None if rate is None else 100 * rate / copy_gbps,
            "launched_by": launches.launched_by.get(name),
        })  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], top: int = 25, width: int = 60) -> str:
    """The ``top`` rows as a GitHub table (kernel names cut to ``width`` characters)."""
    from tabulate import tabulate

    def cell(value: Any, digits: int) -> Any:
        return "" if value is None else round(value, digits)

    table = [
        [r["kernel"][:width], r["class"], r["launches"], cell(r["ms"], 3), cell(r["gb"], 3), cell(r["gb_per_s"], 0),
         cell(r["pct_of_copy"], 0), (r.get("launched_by") or "")[:width]]
        for r in rows[:top]
    ]  # fmt: skip
    headers = ["kernel", "class", "launches", "ms / step", "GB / step", "GB/s", "% of copy", "launched by"]
    return tabulate(table, headers=headers, tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    """Train ``--provider`` (a ``bench train`` provider) for a few steps in this process, then profile two
    steps for the kernels' times and one for their bytes; print the table and write it as JSON."""
    from inductor_ext.bench.train.model import MODELS
    from inductor_ext.bench.train.providers import parse_provider
    from inductor_ext.bench.train.worker import make_step, prepare_model, training_data

    p = argparse.ArgumentParser(prog="python -m benchmarks kernel_table", description=main.__doc__)
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--provider", default="fastops_inductor", help="a bench train provider (preset or key=value)")
    p.add_argument("--top", type=int, default=25, help="rows printed")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("kernel_table needs a CUDA GPU")
    args.device, args.loss_chunk_size, args.padded_batch, args.attention_mask = "cuda", None, 8, "none"
    provider = parse_provider(args.provider)
    step = make_step(prepare_model(args, provider, "cuda"), provider, "none")
    data = iter(training_data(args, provider, 8, "cuda"))
    for _ in range(5):  # compile and warm up
        for batch in next(data):
            step(batch)
    timeline = gpu_timeline(lambda: [step(batch) for batch in next(data)], 2)
    launched = profile_launches(lambda: [step(batch) for batch in next(data)])
    rows = kernel_rows(timeline, launched, copy_bandwidth_gbps())
    print(markdown(rows, top=args.top))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernel_table_{args.model}_{args.batch}x{args.seq}.json"
    path.write_text(json.dumps({"provider": provider.to_json(), "rows": rows}, indent=1))
    return 0

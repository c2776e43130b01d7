"""``python -m benchmarks guards [--model llama-3.2-1b] [--iters 1000] [--out DIR]``: the host
cost of Dynamo's guards on an HF model's compiled training forward, per ``guard_filter_fn``.

Dynamo checks a compiled frame's guards on every call, on the CPU, before the compiled code runs:
host time that a training step pays whatever the GPU does. The model is a :data:`MODELS` entry's
structure (its layers, modules, parameters and buffers) at tiny widths, since the guards depend on
the modules and tensors and not on their sizes; it is compiled with ``backend="eager"`` (the guards do
not depend on the backend) for a forward with labels. Per filter: the guards kept, by type and on
parameters, and the check's latency, measured by Dynamo's own profiler (``profile_guard_manager``)
over ``--iters`` checks of the call's own locals, median of ``--repeats``. Filters: none (Dynamo's
default), :func:`inductor_ext.guards.skip_parameter_guards`, and torch's
``skip_guard_on_inbuilt_nn_modules_unsafe`` and ``skip_guard_on_all_nn_modules_unsafe``.
Writes ``guards_<model>.json`` to ``--out``.
"""

import argparse
import collections
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from inductor_ext.bench.train import MODELS, build_model
from inductor_ext.guards import skip_parameter_guards

FILTERS: dict[str, Any] = {
    "default": None,
    "skip_parameter_guards": skip_parameter_guards,
    "skip_guard_on_inbuilt_nn_modules_unsafe": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe,
    "skip_guard_on_all_nn_modules_unsafe": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
}
TINY_WIDTHS = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def tiny_width_model(model: str) -> torch.nn.Module:
    """``model``'s structure (layer count, module and tensor layout, tied embeddings) at tiny widths, float32, CPU."""
    return build_model(model, "cpu", torch.float32, **TINY_WIDTHS)


def measure(module: torch.nn.Module, guard_filter: Any, iters: int, repeats: int) -> dict[str, Any]:
    """Guards kept and check latency (µs) of ``module``'s compiled forward with ``guard_filter``."""
    from torch._C._dynamo.guards import profile_guard_manager
    from torch._dynamo import guards

    kept: dict[str, Any] = {}

    def recording(entries: list[Any]) -> list[bool]:
        keep = [True] * len(entries) if guard_filter is None else list(guard_filter(entries))
        chosen = [entry for entry, k in zip(entries, keep, strict=True) if k]
        kept["by_type"] = dict(collections.Counter(entry.guard_type for entry in chosen).most_common())
        kept["on_parameters"] = sum(isinstance(entry.value, torch.nn.Parameter) for entry in chosen)
        kept["total"], kept["offered"] = len(chosen), len(entries)
        return keep

    managers: list[tuple[Any, Any]] = []
    previous_hook = guards.guard_manager_testing_hook_fn
    guards.guard_manager_testing_hook_fn = lambda manager, scope, *_: managers.append((manager, scope))
    try:
        torch._dynamo.reset()
        ids = torch.randint(0, TINY_WIDTHS["vocab_size"], (1, 8))
        torch.compile(module, backend="eager", options={"guard_filter_fn": recording})(ids, labels=ids)
    finally:
        guards.guard_manager_testing_hook_fn = previous_hook
    if len(managers) != 1:
        raise RuntimeError(f"bench guards: expected one compiled frame, got {len(managers)} (a graph break?)")
    manager, scope = managers[0]
    latencies = [profile_guard_manager(manager.root, scope, iters) for _ in range(repeats)]
    return {**kept, "check_us": statistics.median(latencies), "check_us_min": min(latencies)}


def main(argv: list[str] | None = None) -> int:
    from tabulate import tabulate

    parser = argparse.ArgumentParser(prog="python -m benchmarks guards", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    parser.add_argument("--iters", type=int, default=1000, help="guard checks per latency measurement")
    parser.add_argument("--repeats", type=int, default=5, help="latency measurements (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON")
    args = parser.parse_args(argv)
    if args.iters < 1 or args.repeats < 1:
        parser.error("--iters and --repeats must be >= 1")
    module = tiny_width_model(args.model)
    results = {name: measure(module, guard_filter, args.iters, args.repeats) for name, guard_filter in FILTERS.items()}
    default_us = results["default"]["check_us"]
    table = [{"guard_filter_fn": name, "guards": r["total"], "on parameters": r["on_parameters"],
              "check us": round(r["check_us"], 1), "vs default": round(r["check_us"] / default_us, 3)}
             for name, r in results.items()]  # fmt: skip
    print(tabulate(table, headers="keys"))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "widths": TINY_WIDTHS, "iters": args.iters, "repeats": args.repeats,
            "torch": torch.__version__, "processor": _processor()}  # fmt: skip
    payload = {"meta": meta, "results": results, "summary": table}
    (args.out / f"guards_{args.model}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return 0


def _processor() -> str:
    """The host CPU's model name (guard checks run on it), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"

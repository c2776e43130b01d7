"""Where a compile's seconds go, from the compile timers PyTorch and this package keep
(``torch._dynamo.utils.compilation_time_metrics``: seconds per timer, summed over every compile).

:func:`compile_split` turns the difference of two :func:`timer_seconds` snapshots (taken around, say, a
first training step) into phases:

- ``dynamo``: Dynamo's own work (bytecode tracing, guards), the backend call excluded;
- ``aot_autograd``: AOTAutograd's tracing and partitioning, the forward's Inductor compile (which runs
  inside it) excluded; the backward's compile runs later, at the first backward;
- ``inductor``: Inductor's compiles of the forward and backward graphs, of which ``triton compile``
  (waiting for the compile workers), ``c++ compile`` and ``autotune`` (benchmarking kernel configs,
  coordinate descent included);
- ``route timing``: our kernels timed against Inductor's code (:data:`inductor_ext.tuning.routes.ROUTE_TIMER`);
- ``passes``: each of our graph passes by name, in every stage it runs
  (:data:`inductor_ext.inductor.pipeline.PASS_TIMER_PREFIX`).

Our passes and route timing run inside the phases above (the backend call, AOTAutograd's joint graph,
Inductor's post-grad passes): they are shown on their own, not subtracted.
"""

from collections.abc import Mapping
from typing import Any

from torch._dynamo.utils import compilation_time_metrics

from inductor_ext.inductor.pipeline import PASS_TIMER_PREFIX
from inductor_ext.tuning.routes import ROUTE_TIMER

INDUCTOR_PARTS = {
    "triton compile": ("async_compile.wait",),
    "c++ compile": ("compile_file",),
    "autotune": ("CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning"),
}
"""Parts of the ``inductor`` phase, by the timers that measure them."""


def timer_seconds() -> dict[str, float]:
    """Every compile timer's seconds so far."""
    return {key: sum(values) for key, values in compilation_time_metrics.items()}


def compile_split(before: Mapping[str, float], after: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The phases' seconds between two :func:`timer_seconds` snapshots (``after``: now), rounded to milliseconds."""
    after = timer_seconds() if after is None else after

    def spent(*keys: str) -> float:
        return sum(after.get(key, 0.0) - before.get(key, 0.0) for key in keys)

    phases = {
        "dynamo": spent("_compile.compile_inner") - spent("OutputGraph.call_user_compiler"),
        "aot_autograd": spent("create_aot_dispatcher_function") - spent("compile_fx.<locals>.fw_compiler_base"),
        "inductor": spent("compile_fx_inner"),
        **{part: spent(*keys) for part, keys in INDUCTOR_PARTS.items()},
        "route timing": spent(ROUTE_TIMER),
    }
    passes = {key.removeprefix(PASS_TIMER_PREFIX): spent(key) for key in after if key.startswith(PASS_TIMER_PREFIX)}
    split: dict[str, Any] = {name: round(seconds, 3) for name, seconds in phases.items()}
    split["passes"] = {name: round(seconds, 3) for name, seconds in sorted(passes.items()) if seconds > 0}
    return split

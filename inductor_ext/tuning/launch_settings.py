"""Tuning-time settings of eager kernel launches: how a first launch tunes, a forced config, a launch log.

Each setting is a :class:`contextvars.ContextVar` set by a context manager here, so it holds for the
code inside the block, in this thread (and in asyncio tasks it starts), and for nothing running
elsewhere at the same time. Work handed to another thread sees a setting only when it runs in a
copy of the caller's context (``contextvars.copy_context().run``): route timing
(:func:`inductor_ext.tuning.routes.measure_routes`) does so for its worker threads.

Read by the launches (:mod:`inductor_ext.library.launch`) and by first-launch tuning
(:mod:`inductor_ext.tuning.first_launch`); imports nothing of the package.
"""

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import triton
import triton.testing

LaunchRecord = tuple[Any, tuple[Any, ...], dict[str, Any]]
"""A launch as recorded: (kernel, args, kwargs)."""

QUICK_FIRST_LAUNCH_CONFIGS = 4
"""Configs a quick first launch times: the first of its pruned configs, i.e. of its kernel's search
space, heuristic's favourite first (:mod:`inductor_ext.tuning.search_spaces.order`). Compiling and timing
every config was most of a cold ``fastops_inductor`` compile, and the search spaces are ordered so that
the best config is nearly always among the first few. The standalone tuner (``python -m inductor_ext.tuning``)
still times every config."""


def quick_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """What a quick first launch (or Inductor's tuning of a traced launch) times of a launch's
    pruned ``configs``: the first :data:`QUICK_FIRST_LAUNCH_CONFIGS`."""
    return configs[:QUICK_FIRST_LAUNCH_CONFIGS]


AUTOTUNE_BENCH_MS = (5, 25)
"""Warm-up and timed milliseconds per config when a first launch autotunes (Triton's defaults:
25 and 100). Triton's ``do_bench`` runs a config for that long whatever its speed, flushing L2
before every run, so at the defaults the runs themselves make up most of a cold route timing.
A 25-millisecond budget still gives at least 25 runs of a 1-millisecond kernel, and hundreds of a
20 µs one, for the median."""


def quick_do_bench() -> Callable[..., Any]:
    """Triton's ``do_bench`` timing each config for :data:`AUTOTUNE_BENCH_MS` instead of Triton's
    defaults: what a quick first launch's autotuner benchmarks with. Set only on the autotuner a
    first launch builds for itself, never on a kernel's own: Inductor accepts a user kernel's
    autotuner only with the default benchmark settings."""
    warmup, rep = AUTOTUNE_BENCH_MS
    return functools.partial(triton.testing.do_bench, warmup=warmup, rep=rep)


_thorough: contextvars.ContextVar[bool] = contextvars.ContextVar("fastops_thorough_benchmarks", default=False)
_forced_config: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "fastops_forced_launch_config", default=None
)
_launch_log: contextvars.ContextVar[list[LaunchRecord] | None] = contextvars.ContextVar(
    "fastops_autotuned_launch_log", default=None
)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def quick_first_launch_enabled() -> bool:
    """Whether first launches are quick here: they time the first :data:`QUICK_FIRST_LAUNCH_CONFIGS`
    configs for :data:`AUTOTUNE_BENCH_MS` each, and so does Inductor when it tunes a traced launch
    (``library.launch.pruned_autotuner``). False within :func:`thorough_benchmarks`: every config,
    Triton's full budget."""
    return not _thorough.get()


@contextlib.contextmanager
def thorough_benchmarks() -> Iterator[None]:
    """Within: first launches time every config for Triton's full budget (25 + 100 milliseconds), not the first
    :data:`QUICK_FIRST_LAUNCH_CONFIGS` for :data:`AUTOTUNE_BENCH_MS`: the standalone tuner's
    setting, where a pick matters more than the seconds (a short budget's noise can pick a config a
    few percent off the best)."""
    with _setting(_thorough, True):
        yield


def forced_launch_config() -> dict[str, Any] | None:
    """The config set by the innermost :func:`force_launch_config` around this call, or None."""
    return _forced_config.get()


@contextlib.contextmanager
def force_launch_config(config: dict[str, Any] | None) -> Iterator[None]:
    """Make eager launches use ``config`` (a Triton config's kwargs, plus ``num_warps``) instead of tuning,
    for the kernels that take its parameters (the op's other kernels launch as usual)."""
    with _setting(_forced_config, config):
        yield


def autotuned_launch_log() -> list[LaunchRecord] | None:
    """The list the innermost :func:`record_autotuned_launches` around this call fills, or None."""
    return _launch_log.get()


@contextlib.contextmanager
def record_autotuned_launches() -> Iterator[list[LaunchRecord]]:
    """The eager launches of autotuned kernels made inside the block: (kernel, args, kwargs) each."""
    launches: list[LaunchRecord] = []
    with _setting(_launch_log, launches):
        yield launches

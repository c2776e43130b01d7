"""How the first eager launch of an autotuned kernel tunes, and the picks it made.

A direct launch (:class:`inductor_ext.library.launch.DirectLaunch`, the eager bypass) of an autotuned
kernel tunes once per autotune key: :func:`tune_first_launch` builds an autotuner for that launch
(:func:`first_launch_autotuner`: quick or thorough, :mod:`inductor_ext.tuning.launch_settings`), compiles
its configs in parallel (:func:`precompile_configs`), times them, and records the pick in a registry
that any thread may read (:func:`tuned_launch_configs`). Later launches run the picked config's JIT
function directly. Route timing (:mod:`inductor_ext.tuning.routes`) stores the picks in the tuning
database (:mod:`inductor_ext.tuning.kernel_configs`), where traced launches find them.
"""

import concurrent.futures
import contextlib
import copy
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import triton
from triton.runtime._async_compile import active_mode as async_compile_mode
from triton.runtime.autotuner import Autotuner

from inductor_ext.tuning.kernel_configs import LaunchSignature, key_signature
from inductor_ext.tuning.launch_settings import quick_configs, quick_do_bench, quick_first_launch_enabled

Grid = Callable[[dict[str, Any]], tuple[int, ...]]
"""A launch's grid: the launch's meta-parameters (its config's included) -> the number of programs per axis."""


def candidate_configs(kernel: Autotuner, args: Sequence[Any], kwargs: dict[str, Any]) -> list[triton.Config]:
    """The configs ``kernel``'s autotuner times for this launch (its pruning applied).

    Triton's pruning reads the launch's arguments from the autotuner (``nargs``): they are set on a
    shallow copy, not on ``kernel``, which another thread may be using."""
    view = copy.copy(kernel)
    view.nargs = dict(zip(kernel.arg_names, args))
    return view.prune_configs(kwargs)


TunedKey = tuple[Any, LaunchSignature]
"""What an eager first launch's pick is keyed by (:func:`launch_key`)."""

_tuned: dict[TunedKey, dict[str, Any]] = {}
"""Each eager first launch's pick (config kwargs, never changed once stored). Written and copied under
``_tuned_lock``; a launch reads its own entry with one ``dict.get``, which is atomic (taking the lock
there cost 0.19 µs per launch on a 2-core CPU host: the bypass exists to save host time)."""
_tuned_lock = threading.Lock()


def launch_key(kernel: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> TunedKey:
    """What eager first launches' picks are keyed by: the kernel and its autotuner's cache key for this launch."""
    return kernel, key_signature(kernel, args, kwargs)


def tuned_launch_configs() -> dict[TunedKey, dict[str, Any]]:
    """A copy of every pick eager first launches made in this process, ``{launch_key: config kwargs}``:
    what route timing records in the tuning database."""
    with _tuned_lock:
        return {key: dict(config) for key, config in _tuned.items()}


def tuned_launch_config(kernel: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of the config (kwargs) an eager first launch picked for this launch of ``kernel``, or None."""
    config = recorded_pick(launch_key(kernel, args, kwargs))
    return None if config is None else dict(config)


def clear_tuned_launch_configs() -> None:
    """Forget every pick: the next eager launch of each autotuned kernel tunes again."""
    with _tuned_lock:
        _tuned.clear()


def recorded_pick(key: TunedKey) -> dict[str, Any] | None:
    """The pick recorded for ``key`` (not a copy: never to be mutated), or None. What a direct launch
    reads on every call: one ``dict.get``, atomic (see ``_tuned``)."""
    return _tuned.get(key)


def _record_tuned(key: TunedKey, config: dict[str, Any]) -> None:
    """Keep ``config`` as the pick for ``key`` unless another thread's first launch stored one first."""
    with _tuned_lock:
        _tuned.setdefault(key, config)


def first_launch_autotuner(kernel: Autotuner, args: Sequence[Any], kwargs: dict[str, Any]) -> Autotuner:
    """The autotuner a first launch of ``kernel`` tunes on, built for this launch: it offers this
    launch's candidate configs (:func:`candidate_configs`), the first
    :data:`~inductor_ext.tuning.launch_settings.QUICK_FIRST_LAUNCH_CONFIGS` timed for
    :data:`~inductor_ext.tuning.launch_settings.AUTOTUNE_BENCH_MS` each while first launches are quick,
    every one for Triton's full budget within
    :func:`~inductor_ext.tuning.launch_settings.thorough_benchmarks`; ``key``, ``restore_value`` and
    ``reset_to_zero`` kept (the key matters only to Triton's on-disk autotuning cache, when enabled).

    Not ``kernel``'s own autotuner: Triton's keeps each run's arguments and pick on itself (``nargs``,
    ``best_config``) while another thread may be running it, and its configs and benchmark settings
    are what Inductor reads when it traces the kernel. Both are left as they are.
    """
    configs = candidate_configs(kernel, args, kwargs)
    quick = quick_first_launch_enabled()
    tuner = triton.autotune(
        configs=quick_configs(configs) if quick else configs,
        key=kernel.keys,
        restore_value=kernel.restore_value,
        reset_to_zero=kernel.reset_to_zero,
    )(kernel.fn)
    if quick:
        tuner.do_bench = quick_do_bench()  # type: ignore[misc]
    return tuner


def precompile_configs(kernel: Autotuner, grid: Grid, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Compile every config ``kernel``'s autotuner will time for this launch, in parallel; its
    timing then finds them compiled.

    Triton's autotuner compiles them one by one as it times them; Triton's compiler releases the GIL
    in part, so compiling them on worker threads overlaps most of that. With the timing itself
    (:func:`first_launch_autotuner`), this is what a cold route timing (``fastops_inductor``'s ``"auto"``) and the autotuner CLI wait for.
    Through Triton's own ``AsyncCompileMode``: each warm-up binds its arguments here and hands
    only the compile to a worker thread; leaving the mode installs the kernels in the cache.
    Inductor's compile-worker processes would be slower here, since each
    worker imports the package on its first job (RMSNorm's 28 configs: 17.8 s against 6.5 s on
    threads in a fresh process; 6.5 s against 5.8 s with the pool already up).
    """
    configs = candidate_configs(kernel, args, kwargs)
    workers = min(len(configs), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        # a mode the caller already opened takes the compiles instead (Triton allows one at a time)
        mode = triton.AsyncCompileMode(pool) if async_compile_mode.get() is None else contextlib.nullcontext()
        with mode:
            for config in configs:
                meta = {**kwargs, **config.all_kwargs()}
                kernel.fn.warmup(*args, grid=grid(meta), **meta)


def tune_first_launch(
    kernel: Autotuner, grid: Grid, args: Sequence[Any], kwargs: dict[str, Any], key: TunedKey
) -> None:
    """The first launch of ``kernel`` at ``key`` (:func:`launch_key`): tuned on
    :func:`first_launch_autotuner`, its configs compiled first (:func:`precompile_configs`), and the pick
    recorded for the launches after it."""
    tuner = first_launch_autotuner(kernel, args, kwargs)
    precompile_configs(tuner, grid, args, kwargs)
    tuner[grid](*args, **kwargs)
    _record_tuned(key, tuner.best_config.all_kwargs())

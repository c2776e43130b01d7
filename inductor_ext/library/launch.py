"""Kernel launches: traced inside registered ops, direct in plain eager.

An op's ``*_kernels`` function (:func:`inductor_ext.library.registration.define_op_family`) allocates its
outputs and launches Triton kernels through a :data:`Launch`:

* :class:`TraceableLaunch` goes through ``wrap_triton``, so tracing (``torch.compile``,
  ``torch.export``) records the kernel: what an op body does.
* :class:`DirectLaunch` launches straight from Python, for the eager bypass. An autotuned kernel's
  first launch per autotune key tunes on an autotuner built for that launch
  (:func:`first_launch_autotuner`); its pick is kept in a registry that any thread may read
  (:func:`tuned_launch_configs`), and later launches run the picked config's JIT function directly.

Neither class holds state. The tuning-time settings (quick or thorough first launches, a forced
config, launch logs) are context variables set by :mod:`inductor_ext.library.launch_controls`.
"""

import concurrent.futures
import contextlib
import copy
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
from torch.library import wrap_triton
from triton.runtime._async_compile import active_mode as async_compile_mode
from triton.runtime.autotuner import Autotuner

from inductor_ext.library.launch_controls import (
    autotuned_launch_log,
    dry_run_log,
    forced_launch_config,
    quick_configs,
    quick_do_bench,
    quick_first_launch_enabled,
)
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.kernel_configs import (
    LAUNCH_OPTIONS,
    LaunchSignature,
    device_name_of,
    key_signature,
    stored_config,
)

_INTERPRET = bool(triton.knobs.runtime.interpret)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` at import (as for ``@triton.jit``): kernels then run on CPU tensors."""
    return _INTERPRET


def kernels_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


Grid = Callable[[dict[str, Any]], tuple[int, ...]]


@functools.cache
def sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grid_stride_programs(device: torch.device, per_sm: int) -> int:
    """Grid size of a grid-stride launch: ``per_sm`` programs per SM; 4 under the interpreter
    (which runs programs one after another, so a few suffice to exercise the striding)."""
    if device.type == "cuda":
        return per_sm * sm_count(device.index)
    return 4


def candidate_configs(kernel: Autotuner, args: Sequence[Any], kwargs: dict[str, Any]) -> list[triton.Config]:
    """The configs ``kernel``'s autotuner times for this launch (its pruning applied).

    Triton's pruning reads the launch's arguments from the autotuner (``nargs``): they are set on a
    shallow copy, not on ``kernel``, which another thread may be using."""
    view = copy.copy(kernel)
    view.nargs = dict(zip(kernel.arg_names, args))
    return view.prune_configs(kwargs)


class TraceableLaunch:
    """Launches through ``wrap_triton``: what an op body does, so tracing records the kernel.

    A config recorded in the tuning database for this launch (:mod:`inductor_ext.tuning.kernel_configs`)
    is the only one the traced kernel offers, so Inductor emits it and benchmarks nothing.
    """

    def __call__(self, kernel: Any, grid: Grid, *args: Any, **kwargs: Any) -> None:
        device = device_name_of(args) if isinstance(kernel, Autotuner) else None
        stored = stored_config(TuningDatabase(), kernel, args, kwargs, device) if device is not None else None
        wrap_triton(pruned_autotuner(kernel, args, kwargs, stored))[grid](*args, **kwargs)


def pruned_autotuner(kernel: Any, args: Sequence[Any], kwargs: dict[str, Any], stored: Any = None) -> Any:
    """``kernel`` with its configs narrowed to ``stored`` (a ``triton.Config``) when given and valid for
    these arguments (its pruning keeps it), else with its ``early_config_prune`` already applied to
    these arguments; ``restore_value`` and ``reset_to_zero`` kept.

    torch's tracing of Triton kernels (``torch/_higher_order_ops/triton_kernel_wrap.py``,
    torch 2.11 to 2.13) applies the pruning itself and re-wraps the kernel as
    ``autotune(configs=pruned, key=[])``, dropping ``restore_value``. Inductor then
    benchmarks an in-place kernel on the real buffers without restoring them, and the
    launch after tuning reads its own output: seen on the H200 as a cross-entropy loss
    of exactly ``log(V)`` (the logits had become the gradient) and RoPE rotated several
    times. An autotuner with nothing left to prune passes through that code unchanged.
    """
    if not isinstance(kernel, Autotuner) or (kernel.early_config_prune is None and stored is None):
        return kernel
    if kernel.perf_model is not None:
        raise NotImplementedError("pruned_autotuner: kernels with a perf_model are not supported")
    configs = candidate_configs(kernel, args, kwargs)
    if stored is not None and any(c.kwargs == stored.kwargs and c.num_warps == stored.num_warps for c in configs):
        configs = [stored]
    elif quick_first_launch_enabled():  # Inductor tunes it at compile time: the quick first launch's configs
        configs = quick_configs(configs)
    return triton.autotune(
        configs=configs, key=[], restore_value=kernel.restore_value, reset_to_zero=kernel.reset_to_zero
    )(kernel.fn)


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
    config = _tuned_config(launch_key(kernel, args, kwargs))
    return None if config is None else dict(config)


def clear_tuned_launch_configs() -> None:
    """Forget every pick: the next eager launch of each autotuned kernel tunes again."""
    with _tuned_lock:
        _tuned.clear()


def _tuned_config(key: TunedKey) -> dict[str, Any] | None:
    return _tuned.get(key)  # atomic: see _tuned


def _record_tuned(key: TunedKey, config: dict[str, Any]) -> None:
    """Keep ``config`` as the pick for ``key`` unless another thread's first launch stored one first."""
    with _tuned_lock:
        _tuned.setdefault(key, config)


def first_launch_autotuner(kernel: Autotuner, args: Sequence[Any], kwargs: dict[str, Any]) -> Autotuner:
    """The autotuner a first launch of ``kernel`` tunes on, built for this launch: it offers this
    launch's candidate configs (:func:`candidate_configs`), the first
    :data:`~inductor_ext.library.launch_controls.QUICK_FIRST_LAUNCH_CONFIGS` timed for
    :data:`~inductor_ext.library.launch_controls.AUTOTUNE_BENCH_MS` each while first launches are quick,
    every one for Triton's full budget within
    :func:`~inductor_ext.library.launch_controls.thorough_benchmarks`; ``key``, ``restore_value`` and
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


class DirectLaunch:
    """Launches straight from Python, for the eager bypass.

    On CUDA the first launch per autotune key tunes on an autotuner of its own
    (:func:`first_launch_autotuner`: quick unless within ``thorough_benchmarks``) and records its
    pick (:func:`tuned_launch_configs`); later ones launch the picked config's JIT function
    directly, skipping the autotuner's per-call bookkeeping (the bypass exists to save host time).
    Under the interpreter, where the autotuner cannot benchmark, it launches the config of
    ``force_launch_config`` or else the first pruned config (the heuristic's pick).

    ``interpreter`` (default: :func:`interpreter_enabled`) set to False launches as on a GPU under
    the interpreter too: tests time a first launch on CPU that way, with a stand-in for Triton's
    ``do_bench``.
    """

    __slots__ = ("_interpreter",)

    def __init__(self, interpreter: bool | None = None) -> None:
        self._interpreter = _INTERPRET if interpreter is None else interpreter

    def __call__(self, kernel: Any, grid: Grid, *args: Any, **kwargs: Any) -> None:
        dry_run = dry_run_log()
        if dry_run is not None:
            dry_run.append((kernel, tuple(args), dict(kwargs)))
            return
        if not isinstance(kernel, Autotuner):
            kernel.run(*args, grid=grid(kwargs), warmup=False, **kwargs)
            return
        launch_log = autotuned_launch_log()
        if launch_log is not None:
            launch_log.append((kernel, tuple(args), dict(kwargs)))
        forced = _forced_config_for(kernel)
        if forced or self._interpreter:
            # under the interpreter (no timing): the heuristic's pick, the first valid config
            meta = {**kwargs, **(forced or candidate_configs(kernel, args, kwargs)[0].all_kwargs())}
            kernel.fn.run(*args, grid=grid(meta), warmup=False, **meta)
            return
        key = launch_key(kernel, args, kwargs)
        tuned = _tuned_config(key)
        if tuned is None:
            tuner = first_launch_autotuner(kernel, args, kwargs)
            precompile_configs(tuner, grid, args, kwargs)
            tuner[grid](*args, **kwargs)
            _record_tuned(key, tuner.best_config.all_kwargs())
            return
        meta = {**kwargs, **tuned}
        kernel.fn.run(*args, grid=grid(meta), warmup=False, **meta)


def _forced_config_for(kernel: Any) -> dict[str, Any] | None:
    """The forced config (``force_launch_config``) if it sets exactly the meta-parameters ``kernel``'s
    configs tune (an op's other kernels keep their own configs), else None."""
    forced = forced_launch_config()
    if forced and set(forced) - LAUNCH_OPTIONS == set(kernel.configs[0].kwargs):
        return forced
    return None


Launch = TraceableLaunch | DirectLaunch


def precompile_configs(kernel: Autotuner, grid: Grid, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Compile every config ``kernel``'s autotuner will time for this launch, in parallel; its
    timing then finds them compiled.

    Triton's autotuner compiles them one by one as it times them: the 18 RMSNorm backward configs
    take 7.6 s on one thread, 4.3 s on two (Triton's compiler releases the GIL in part; measured
    compiling for sm_90 on a 2-core CPU host). With the timing itself (:func:`first_launch_autotuner`),
    this is what a cold route timing (``fastops_inductor``'s ``"auto"``) and the autotuner CLI wait for.
    Through Triton's own ``AsyncCompileMode``: each warm-up binds its arguments here and hands
    only the compile to a worker thread; leaving the mode installs the kernels in the cache.
    Inductor's compile-worker processes were tried instead (on the H200): slower, since each
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

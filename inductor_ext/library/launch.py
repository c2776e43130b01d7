"""Kernel launches: traced inside registered ops, direct in plain eager.

An op's ``*_kernels`` function (:func:`inductor_ext.library.registration.define_op_family`) allocates its
outputs and launches Triton kernels through a :data:`Launch`:

* :class:`TraceableLaunch` goes through ``wrap_triton``, so tracing (``torch.compile``,
  ``torch.export``) records the kernel: what an op body does.
* :class:`DirectLaunch` launches straight from Python, for the eager bypass. An autotuned kernel's
  first launch per autotune key tunes (:func:`inductor_ext.tuning.first_launch.tune_first_launch`),
  and later launches run the picked config's JIT function directly.

Neither class holds state. The tuning-time settings (quick or thorough first launches, a forced
config, launch logs) are context variables set by :mod:`inductor_ext.tuning.launch_settings`.
"""

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch.library import wrap_triton
from triton.runtime.autotuner import Autotuner

from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.first_launch import Grid, candidate_configs, launch_key, recorded_pick, tune_first_launch
from inductor_ext.tuning.kernel_configs import LAUNCH_OPTIONS, device_name_of, stored_config
from inductor_ext.tuning.launch_settings import (
    autotuned_launch_log,
    forced_launch_config,
    quick_configs,
    quick_first_launch_enabled,
)

_INTERPRET = bool(triton.knobs.runtime.interpret)


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` at import (as for ``@triton.jit``): kernels then run on CPU tensors."""
    return _INTERPRET


def kernels_run_on(device: torch.device) -> bool:
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


@functools.cache
def sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grid_stride_programs(device: torch.device, per_sm: int) -> int:
    """Grid size of a grid-stride launch: ``per_sm`` programs per SM; 4 under the interpreter
    (which runs programs one after another, so a few suffice to exercise the striding)."""
    if device.type == "cuda":
        return per_sm * sm_count(device.index)
    return 4


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
    launch after tuning reads its own output: seen on CUDA as a cross-entropy loss
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


class DirectLaunch:
    """Launches straight from Python, for the eager bypass.

    On CUDA the first launch per autotune key tunes on an autotuner of its own
    (:func:`~inductor_ext.tuning.first_launch.tune_first_launch`: quick unless within
    ``thorough_benchmarks``) and records its pick; later ones launch the picked config's JIT function
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
        tuned = recorded_pick(key)
        if tuned is None:
            tune_first_launch(kernel, grid, args, kwargs, key)
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

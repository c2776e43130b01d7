"""GPU timing on random inputs built from shapes alone (no model, no real data); the inputs
themselves come from :mod:`inductor_ext.autotune.inputs`."""

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch


def size_hint(size: Any) -> int | None:
    """A concrete int for a size that may be symbolic (its hint; None when unbacked)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape (hints for symbolic sizes) and dtype: shapes without storage."""
    hints = [size_hint(s) for s in t.shape]
    if None in hints:
        raise ValueError(f"cannot tune a tensor of data-dependent shape {tuple(t.shape)}")
    return torch.empty([int(s) for s in hints if s is not None], dtype=t.dtype, device="meta")


def signature(args: Sequence[Any]) -> str:
    """A stable text key of an op call: dtypes and shapes of tensors (hints for symbolic sizes), other values."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            dims = ",".join(str(size_hint(s)) for s in a.shape)
            parts.append(f"{str(a.dtype).removeprefix('torch.')}[{dims}]")
        else:
            parts.append(repr(a))
    return "(" + ", ".join(parts) + ")"


def median_ms(run: Callable[[Sequence[Any]], Any], make_inputs: Callable[[], Sequence[Any]]) -> tuple[float, float]:
    """(median, interdecile spread) ms of ``run(inputs)`` on the current GPU.

    The inputs are rotated among enough copies that one sweep exceeds twice the L2
    cache, so every call reads from DRAM as it would inside a model; the median is
    over 30 repetitions of 10 calls.
    """
    first = make_inputs()
    nbytes = sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    sets = [first] + [make_inputs() for _ in range(min(32, 2 * l2 // max(nbytes, 1)))]
    for inputs in sets:
        run(inputs)  # compile, tune, warm up
    torch.cuda.synchronize()
    # calls back to back between two events, so the GPU time excludes host gaps
    # (inside a compiled graph the wrapper, not this loop, launches the kernels)
    calls, times = 10, []
    for rep in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in range(calls):
            run(sets[(rep * calls + call) % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    deciles = statistics.quantiles(times, n=10)
    return statistics.median(times), deciles[8] - deciles[0]

"""GPU timing on random inputs built from shapes alone (no model, no real data)."""

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


def random_like(value: Any, device: torch.device | None = None) -> Any:
    """A real tensor with ``value``'s shape (hints), dtype and device; non-tensors pass through.

    Floats are ``randn`` (unit scale, the scale of normalised activations and logits);
    integers are uniform in ``[0, 2)`` (a valid class, position or index for any op);
    never all zeros.
    """
    if not isinstance(value, torch.Tensor):
        return value
    shape = [size_hint(s) for s in value.shape]
    if any(s is None for s in shape):
        raise ValueError(f"cannot build a random input for a tensor of data-dependent shape {tuple(value.shape)}")
    device = device or value.device
    if value.dtype.is_floating_point:
        return torch.randn(shape, dtype=value.dtype, device=device)
    if value.dtype == torch.bool:
        return torch.rand(shape, device=device) < 0.5
    return torch.randint(0, 2, shape, dtype=value.dtype, device=device)


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

"""GPU timing on random inputs built from shapes alone (no model, no real data); the inputs
themselves come from :mod:`inductor_ext.tuning.inputs`."""

import functools
import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.utils._pytree as pytree

log = logging.getLogger(__name__)


def size_hint(size: Any) -> int | None:
    """A concrete int for a size that may be symbolic (its hint; None when unbacked)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size)


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, strides (hints for symbolic ones) and dtype: the layout
    without storage. Strides matter: a kernel may pick another grid for another layout (RoPE on
    HF's transposed q and k), so timing and launch-config records must see the layout the model has.
    ValueError when a size or stride is data-dependent (unbacked)."""
    shape, stride = [size_hint(s) for s in t.shape], [size_hint(s) for s in t.stride()]
    if None in shape or None in stride:
        raise ValueError(f"cannot tune a tensor of data-dependent shape {tuple(t.shape)}")
    return torch.empty_strided(cast(list[int], shape), cast(list[int], stride), dtype=t.dtype, device="meta")


def meta_templates(args: Sequence[Any]) -> list[Any]:
    """``args`` with every tensor, in lists too (``Tensor[]`` arguments), replaced by :func:`meta_like`
    (layouts and dtypes, no storage)."""
    return pytree.tree_map_only(torch.Tensor, meta_like, list(args))


def signature(args: Sequence[Any]) -> str:
    """A stable text key of an op call: dtypes and shapes of tensors (hints for symbolic sizes), other
    values. Strides are left out: a backward's arguments may be laid out differently in a compiled
    graph than in the eager run its route was timed from, and the key must still find the decision."""
    return "(" + ", ".join(_key(a) for a in args) + ")"


def _key(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        dims = ",".join(str(size_hint(s)) for s in a.shape)
        return f"{str(a.dtype).removeprefix('torch.')}[{dims}]"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_key(item) for item in a) + "]"
    return repr(a)


def capture_graph(calls: Sequence[Callable[[], Any]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph holding ``calls`` back to back, warmed up (compilation, autotuning) on a
    side stream first and replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread-local: route timing runs on a worker thread while the compiling thread waits for it
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """GPU milliseconds of one replay of ``graph``, between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_replay_ms(calls: Sequence[Callable[[], Any]], replays: int = 30) -> list[float]:
    """GPU milliseconds per call of each of ``replays`` replays of one CUDA graph holding ``calls`` in order.

    The time is the kernels' alone, as inside a compiled graph, never the host's (a Python
    launch path slower than its kernels would otherwise be timed instead of them).
    """
    graph = capture_graph(calls)
    return [replay_ms(graph) / len(calls) for _ in range(replays)]


def stream_ms(calls: Sequence[Callable[[], Any]], replays: int = 30) -> list[float]:
    """GPU milliseconds per call of ``replays`` sweeps of ``calls`` issued back to back between two events
    (host time included whenever the host is slower than the kernels)."""
    for call in calls:
        call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return times


def median_ms(run: Callable[[Sequence[Any]], Any], make_inputs: Callable[[], Sequence[Any]]) -> tuple[float, float]:
    """(median, interdecile spread) milliseconds of ``run(inputs)`` on the current GPU, kernels only.

    The inputs are rotated among enough copies that one sweep exceeds twice the L2
    cache, so every call reads from DRAM as it would inside a model; one CUDA graph holds
    a sweep (at least 10 calls) and the median is over 30 replays (:func:`graph_replay_ms`).
    If ``run`` cannot be captured, the sweeps are timed on the stream (:func:`stream_ms`),
    with a warning: host time may then be counted.
    """
    first = make_inputs()
    nbytes = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(list(first)) if isinstance(t, torch.Tensor))
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    sets = [first] + [make_inputs() for _ in range(min(32, 2 * l2 // max(nbytes, 1)))]
    calls = [functools.partial(run, sets[i % len(sets)]) for i in range(max(10, len(sets)))]
    try:
        times = graph_replay_ms(calls)
    except RuntimeError as error:  # something in `run` cannot be captured: time the stream instead
        log.warning("timing on the stream, host time included (CUDA graph capture failed: %s)", error)
        times = stream_ms(calls)
    deciles = statistics.quantiles(times, n=10)
    return statistics.median(times), deciles[8] - deciles[0]

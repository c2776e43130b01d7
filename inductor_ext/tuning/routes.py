"""Kernel or Inductor: the route of a fastops op call, decided by timing both on random inputs.

For a forward op call (its family and its arguments' shapes and dtypes), :func:`decide_routes` decides
the forward's route and its backward's on a GPU: it builds random inputs from the shapes
(:mod:`inductor_ext.tuning.inputs`; no model is run), times our kernels (eager direct launches, their
configs tuned by :mod:`inductor_ext.tuning.first_launch`) against Inductor's code compiled from the op's
aten math (with the backend's multi-kernel setting), keeps the faster, and stores the decisions and the
kernel configs the timing picked in the tuning database (:mod:`inductor_ext.tuning.database`), so a later
compile of the same shapes measures nothing. The ``fastops_inductor`` backend
(:class:`inductor_ext.inductor.route_planner.RoutePlanner`) and the standalone tuner
(:mod:`inductor_ext.tuning.cli`) both decide through here.
"""

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.utils._pytree as pytree
from torch._dynamo.utils import dynamo_timed
from torch._ops import OpOverload

from inductor_ext import _compat
from inductor_ext.inductor.options import BackendOptions
from inductor_ext.library.registration import (
    DECOMPOSITIONS,
    FAMILIES,
    IN_PLACE_TIMING,
    IN_PLACE_TIMING_MIN_BYTES,
    OpFamily,
)
from inductor_ext.tuning.agreement import agreed
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.first_launch import tuned_launch_configs
from inductor_ext.tuning.inputs import random_inputs
from inductor_ext.tuning.kernel_configs import records as kernel_records
from inductor_ext.tuning.timing import median_ms, meta_templates, signature

log = logging.getLogger(__name__)


ROUTE_TIMER = "fastops.route_timing"
"""The compile timer (``torch._dynamo.utils.compilation_time_metrics``) of the routes timed: our kernels
(their launch configs tuned) against Inductor's code, per call not in the tuning database."""


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    op: str
    signature: str
    route: str
    """``"kernel"`` or ``"inductor"``."""
    reason: str
    """``"cpu"``, ``"timed"``, ``"database"`` or ``"rank N"`` (another rank decided it:
    :func:`inductor_ext.tuning.agreement.agreed`)."""
    kernel_ms: float | None = None
    inductor_ms: float | None = None
    kernel_spread_ms: float | None = None
    inductor_spread_ms: float | None = None
    """Interdecile spreads of the timings (:func:`inductor_ext.tuning.timing.median_ms`)."""


def route_key(fwd_name: str, sig: str, device_name: str) -> str:
    """The tuning-database key of the route decisions for one forward call (and its backward):
    ``route|<fwd op>|<signature>|<device name>`` (the GPU's name, ``"cpu"`` on CPU)."""
    return f"route|{fwd_name}|{sig}|{device_name}"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def fastops_calls(gm: torch.fx.GraphModule) -> Iterator[tuple[OpFamily, tuple[Any, ...]]]:
    """Every fastops forward op call in ``gm``, with its arguments' example values."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in FAMILIES:
            # Dynamo graphs record "example_value", exported programs "val"
            args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("example_value", n.meta.get("val")))
            yield FAMILIES[node.target], tuple(args)


def decide_routes(
    family: OpFamily,
    args: Sequence[Any],
    options: BackendOptions,
    database: TuningDatabase | None,
    device: torch.device,
) -> list[RouteDecision]:
    """The route decisions of a forward call and its backward on ``device`` (a GPU): read from
    ``database`` under :func:`route_key` when it holds them (reason ``"database"``: nothing is
    timed), else timed and stored there, with the launch config the timing picked for each
    of our kernels (:mod:`inductor_ext.tuning.kernel_configs`: traced launches then offer
    Inductor that config alone). A family without kernels of
    its own has no decisions (its ops always trace their math).

    Under ``torch.distributed`` every rank takes the same decisions: the first rank to need them
    decides as above and the others read its answer (:func:`inductor_ext.tuning.agreement.agreed`;
    reason ``"rank N"``), storing it, and the configs its timing picked, in their own database.
    """
    if not family.has_kernels:
        return []  # its math is its only implementation: nothing to time or store
    key = route_key(family.fwd._name, signature(args), device_name(device))
    answer, decider = agreed(key, lambda: _decide_here(key, family, args, options, database, device))
    decisions = [RouteDecision(**entry) for entry in answer["decisions"]]
    if decider is None or decider == torch.distributed.get_rank():
        return decisions
    log.info("fastops_inductor: %s decided by rank %d", key, decider)
    if database is not None:  # the decision, and the kernel configs its timing picked, for later compiles here
        database.update({key: {"decisions": answer["decisions"]}, **answer["configs"]})
    return [dataclasses.replace(d, reason=f"rank {decider}") for d in decisions]


def _decide_here(
    key: str,
    family: OpFamily,
    args: Sequence[Any],
    options: BackendOptions,
    database: TuningDatabase | None,
    device: torch.device,
) -> dict[str, Any]:
    """This process's decisions for ``key`` (from ``database``, or timed and stored there) and
    the kernel configs a timing picked, as JSON for the other ranks
    (:func:`inductor_ext.tuning.agreement.agreed`)."""
    stored = database.get(key) if database is not None else None
    if stored is not None:
        decisions = [dataclasses.replace(RouteDecision(**entry), reason="database") for entry in stored["decisions"]]
        return {"decisions": [dataclasses.asdict(d) for d in decisions], "configs": {}}
    with dynamo_timed(ROUTE_TIMER):
        decisions = measure_routes(family, args, options, device)
    # every kernel config picked so far in this process (the timing's included)
    configs = kernel_records(tuned_launch_configs(), device_name(device))
    entries = [dataclasses.asdict(d) for d in decisions]
    if database is not None:
        database.update({key: {"decisions": entries}, **configs})
    return {"decisions": entries, "configs": configs}


def measure_routes(
    family: OpFamily, fake_args: Sequence[Any], options: BackendOptions, device: torch.device | None = None
) -> list[RouteDecision]:
    """Time the forward and the backward on both routes at these shapes; one decision each.

    ``fake_args`` give shapes and dtypes only (fake, meta or real tensors); the random
    inputs (:func:`inductor_ext.tuning.inputs.random_inputs`) are made on ``device``
    (default: the first argument's device).

    Runs on a worker thread: the caller may be inside Dynamo's compile (a tracing context,
    fake-tensor and dispatch modes, all thread-local), and the timing needs real tensors
    and an independent Inductor compile of the math. The worker, and the thread of that
    compile, run in a copy of the caller's context (``contextvars``): the launch settings of
    :mod:`inductor_ext.tuning.launch_settings` around the call (the standalone tuner's
    ``thorough_benchmarks``, a forced config, a launch log) hold there, as do torch's config
    values (context variables in torch 2.13).
    """
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        meta_args = meta_templates(fake_args)
    device = device if device is not None else fake_args[0].device
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(contextvars.copy_context().run, _measure_routes, family, meta_args, device, options).result()


def _measure_routes(
    family: OpFamily, meta_args: Sequence[Any], device: torch.device, options: BackendOptions
) -> list[RouteDecision]:
    decisions = []
    stages: dict[str, float] = {}
    compiled: dict[OpOverload, Callable[[Sequence[Any]], Any]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as inductor_thread:

        @contextlib.contextmanager
        def compile_beside(direction: Direction, inputs: Sequence[Any]) -> Iterator[None]:
            # Inductor compiles the direction's math on its own thread while ours compile and tune
            future = inductor_thread.submit(
                contextvars.copy_context().run, _compile_math_on, device, direction.math, inputs, options
            )
            yield
            compiled[direction.op] = future.result()

        with _stage(stages, "first launches beside Inductor's compiles"):
            directions = call_directions(family, meta_args, device, while_first_launch=compile_beside)
    for op, templates, direct, _ in directions:  # the math is compiled: compiled[op]
        with _stage(stages, f"{op._name} kernel timing"):
            kernel_ms, kernel_spread = time_direct(op, templates, direct, device)
        with _stage(stages, f"{op._name} inductor timing"):
            inductor_ms, inductor_spread = median_ms(
                compiled[op], functools.partial(random_inputs, op, templates, device)
            )
        route = "kernel" if kernel_ms <= inductor_ms else "inductor"
        decisions.append(RouteDecision(
            op._name, signature(templates), route, "timed", kernel_ms, inductor_ms, kernel_spread, inductor_spread
        ))  # fmt: skip
    log.info("route timing of %s, seconds: %s", family.name, ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
    return decisions


@contextlib.contextmanager
def _stage(stages: dict[str, float], name: str) -> Iterator[None]:
    """Records the block's wall time in seconds as ``stages[name]``."""
    start = time.perf_counter()
    yield
    stages[name] = time.perf_counter() - start


class Direction(NamedTuple):
    """One direction of a call, as route timing runs it."""

    op: OpOverload
    templates: list[Any]
    """Meta tensors (layouts and dtypes) and plain values: the op's arguments."""
    direct: Callable[..., Any]
    """Our kernels' direct launch."""
    math: Callable[..., Any]
    """What Inductor's route compiles: the op's aten math."""


def call_directions(
    family: OpFamily,
    meta_args: Sequence[Any],
    device: torch.device,
    while_first_launch: Callable[[Direction, Sequence[Any]], contextlib.AbstractContextManager[Any]] | None = None,
) -> list[Direction]:
    """A call's forward and backward, each launched once (its first launch: our kernels' compile and tune).

    The templates hold meta tensors; the backward's come from a forward on random inputs, freed
    on return, so that no timing holds another direction's inputs. A backward with an in-place
    timing (``library.registration.IN_PLACE_TIMING``) whose largest input takes at least
    ``IN_PLACE_TIMING_MIN_BYTES`` is timed writing its output over that input, on both routes.
    ``while_first_launch(direction, inputs)``, a context manager, is entered around each first
    launch with that launch's inputs: route timing compiles Inductor's route meanwhile, on them.
    """
    beside = while_first_launch or (lambda direction, inputs: contextlib.nullcontext())
    fwd_args = random_inputs(family.fwd, meta_args, device)
    fwd = Direction(family.fwd, meta_templates(fwd_args), family.run_fwd_direct, DECOMPOSITIONS[family.fwd])
    with beside(fwd, fwd_args):
        bwd_args = capture_backward_args(family, fwd_args, run_backward=False)  # runs the forward: its first launch
    bwd = Direction(family.bwd, meta_templates(bwd_args), family.run_bwd_direct, DECOMPOSITIONS[family.bwd])
    del fwd_args, bwd_args
    in_place = IN_PLACE_TIMING.get(family.bwd)
    largest = max((t.numel() * t.element_size() for t in bwd.templates if isinstance(t, torch.Tensor)), default=0)
    if in_place is not None and largest >= IN_PLACE_TIMING_MIN_BYTES:
        bwd = bwd._replace(direct=in_place.run_direct, math=in_place.math)
    bwd_args = random_inputs(bwd.op, bwd.templates, device)
    with beside(bwd, bwd_args):
        bwd.direct(*bwd_args)  # the backward's first launch
    return [fwd, bwd]


def time_direct(
    op: OpOverload, templates: Sequence[Any], direct: Callable[..., Any], device: torch.device
) -> tuple[float, float]:
    """:func:`median_ms` of our kernels' direct launches for ``op`` on random inputs like ``templates``."""
    return median_ms(lambda inputs: direct(*inputs), functools.partial(random_inputs, op, templates, device))


class _RecordingContext:
    """Stands in for autograd's ctx so a family's ``setup_context``/``backward`` can run outside autograd."""

    def __init__(self, num_inputs: int) -> None:
        self.needs_input_grad = (True,) * num_inputs
        self.saved_tensors: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


class _Captured(Exception):
    """Stops a family's backward once its backward op's arguments are known."""


def capture_backward_args(family: OpFamily, fwd_args: Sequence[Any], run_backward: bool = True) -> list[Any]:
    """The arguments the family's backward op receives after a forward on ``fwd_args``
    (random cotangents for the floating-point outputs). ``run_backward=False`` stops the
    backward there, before the op runs (and allocates its outputs)."""
    output = family.run_fwd_direct(*fwd_args)
    ctx = _RecordingContext(len(fwd_args))
    family.setup_context(ctx, tuple(fwd_args), output)
    outputs = output if isinstance(output, tuple) else (output,)
    grads = [torch.randn_like(o) if o.is_floating_point() else None for o in outputs]
    captured: list[Any] = []

    def bwd(*args: Any) -> Any:
        captured.extend(args)
        if not run_backward:
            raise _Captured
        return family.run_bwd_direct(*args)

    try:
        family.backward(ctx, bwd, *grads)
    except _Captured:
        pass
    return captured


def _compile_math_on(
    device: torch.device, math: Callable[..., Any], args: Sequence[Any], options: BackendOptions
) -> Callable[[Sequence[Any]], Any]:
    """:func:`compile_math` with ``device`` current (a thread's CUDA device starts as the first)."""
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return compile_math(math, args, options)


def compile_math(
    math: Callable[..., Any], args: Sequence[Any], options: BackendOptions
) -> Callable[[Sequence[Any]], Any]:
    """Inductor's code for ``math`` at these arguments (tensors, those in lists too, become graph inputs)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = pytree.tree_flatten(list(args))
    positions = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]

    def with_tensors(*tensors: torch.Tensor) -> Any:
        full = list(leaves)
        for i, t in zip(positions, tensors):
            full[i] = t
        return math(*pytree.tree_unflatten(full, spec))

    tensors = [leaves[i] for i in positions]
    # traced on fake tensors: real ones would run the math, whose fp32 intermediates (softmax,
    # one-hot, ...) took a cross-entropy backward's tuning to several times its logits' memory
    gm = make_fx(with_tensors, tracing_mode="fake")(*tensors)
    # the wrapper language does not change the kernels being timed
    patches = {**options.inductor_patches(), "cpp_wrapper": False, "triton.autotune_at_compile_time": False}
    with _compat.applied(_compat.inductor_patches()):  # the standalone tuner compiles outside the backend
        compiled = cast(Callable[..., Any], compile_fx(gm, tensors, config_patches=patches))

    def run(inputs: Sequence[Any]) -> Any:
        flat = pytree.tree_leaves(list(inputs))
        return compiled(*[flat[i] for i in positions])

    return run

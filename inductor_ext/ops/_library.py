"""The op recipe, done once: every fastops op family is built by :func:`define_op_family`.

A family is a forward and a backward ``torch.library.triton_op`` in the ``fastops``
namespace, wired with ``register_autograd``, plus an eager bypass:

* Eager (not compiling, plain tensors): the public function calls an
  ``autograd.Function`` that launches the Triton kernels directly. Host cost per
  call measured on the H200 (torch 2.11, tiny launch, no grad): raw launch 16.8 µs,
  autograd.Function 21.1 µs, custom_op 29.2 µs, triton_op 52.2 µs.
* ``torch.compile`` / ``torch.export`` / any tracing mode: the registered ops,
  whose bodies Inductor traces (so ``cpp_wrapper`` and AOTInductor compile the
  Triton kernels in).

Each op body starts with a CPU branch that computes the same math in aten ops:
``register_kernel("cpu", ...)`` is ignored under ``torch.compile`` (the body is
traced whatever the device), so the branch must live inside the body. That
branch is what makes compile, ``cpp_wrapper`` and AOTInductor work on CPU.

The same aten math is registered in :data:`DECOMPOSITIONS` for the
``fastops_inductor`` backend's Inductor route.
"""

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import triton
import triton.testing
from torch._ops import OpOverload
from torch.library import triton_op, wrap_triton
from triton.runtime._async_compile import active_mode as async_compile_mode
from triton.runtime.autotuner import Autotuner

from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.kernel_configs import (
    LAUNCH_OPTIONS,
    LaunchSignature,
    device_name_of,
    key_signature,
    stored_config,
)

NAMESPACE = "fastops"

DECOMPOSITIONS: dict[OpOverload, Callable[..., Any]] = {}
"""fastops op overload -> aten-only implementation (the math each op's body traces on the Inductor route)."""

FAMILIES: dict[OpOverload, "OpFamily"] = {}
"""Forward op overload -> its family, for the backend (which finds forward ops in graphs)."""

FAMILY_OF: dict[str, str] = {}
"""Op qualname (``fastops::rms_norm_bwd``) -> its family's name (``rms_norm``), for per-family options."""

IN_PLACE_TIMING: dict[OpOverload, "InPlaceTiming"] = {}
"""Backward op -> its in-place timing, used by route timing when its largest input takes at least
:data:`IN_PLACE_TIMING_MIN_BYTES` (``inductor.choice.call_directions``)."""

IN_PLACE_TIMING_MIN_BYTES = 256 * 2**20
"""Below this the functional op is timed: a copy of the input costs the standalone tuner's peak
less than Triton's 256 MB L2-flush buffer, which every config's benchmark allocates anyway."""

MathRoute = Callable[[str, Sequence[Any]], bool]
"""``(op qualname, args) -> True`` to trace an op's aten math instead of its Triton kernels."""

_math_route: contextvars.ContextVar[MathRoute | None] = contextvars.ContextVar("fastops_math_route", default=None)


@contextlib.contextmanager
def route_ops(choose_math: MathRoute) -> Iterator[None]:
    """While tracing under this context, each op body asks ``choose_math`` which route to trace.

    This is how the ``fastops_inductor`` backend picks, per call, our kernels or Inductor's
    code generated from the math (a decomposition table cannot: a ``triton_op`` is traced
    into its body before the table is consulted). Without the context, bodies trace the
    kernels on CUDA.
    """
    token = _math_route.set(choose_math)
    try:
        yield
    finally:
        _math_route.reset(token)


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
    """The configs ``kernel``'s autotuner times for this launch (its pruning applied)."""
    kernel.nargs = dict(zip(kernel.arg_names, args))
    try:
        return kernel.prune_configs(kwargs)
    finally:
        kernel.nargs = None


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
    elif DirectLaunch.quick_first_launch:  # Inductor tunes it at compile time: the quick first launch's configs
        configs = quick_configs(configs)
    return triton.autotune(
        configs=configs, key=[], restore_value=kernel.restore_value, reset_to_zero=kernel.reset_to_zero
    )(kernel.fn)


class DirectLaunch:
    """Launches straight from Python, for the eager bypass.

    On CUDA the first launch per autotune key runs Triton's autotuner (:func:`quick_first_launch`
    unless within :func:`thorough_benchmarks`); later ones
    launch the tuned config's JIT function directly, skipping the autotuner's
    per-call bookkeeping (the bypass exists to save host time). Under the
    interpreter, where the autotuner cannot benchmark, it launches
    :attr:`forced_config` or else the first pruned config (the heuristic's pick).
    """

    forced_config: ClassVar[dict[str, Any] | None] = None
    launch_log: ClassVar[list[tuple[Autotuner, tuple[Any, ...], dict[str, Any]]] | None] = None
    """While :func:`record_autotuned_launches` is active: every autotuned launch (kernel, args, kwargs)."""
    _tuned: ClassVar[dict[tuple[Any, LaunchSignature], dict[str, Any]]] = {}
    """Each autotuned launch's pick: what the route timing records in the tuning database."""
    quick_first_launch: ClassVar[bool] = True
    """First launches time the first :data:`QUICK_FIRST_LAUNCH_CONFIGS` configs for
    :data:`AUTOTUNE_BENCH_MS` each (:func:`quick_first_launch`), and so does Inductor when it tunes a
    traced launch (:func:`pruned_autotuner`); False within :func:`thorough_benchmarks`: every config,
    Triton's full budget."""

    def __call__(self, kernel: Any, grid: Grid, *args: Any, **kwargs: Any) -> None:
        if not isinstance(kernel, Autotuner):
            kernel.run(*args, grid=grid(kwargs), warmup=False, **kwargs)
            return
        if self.launch_log is not None:
            self.launch_log.append((kernel, tuple(args), dict(kwargs)))
        forced = self.forced_config and self._forced_config_for(kernel)  # (None unless forcing: no call)
        if forced or _INTERPRET:
            # under the interpreter (no timing): the heuristic's pick, the first valid config
            meta = {**kwargs, **(forced or candidate_configs(kernel, args, kwargs)[0].all_kwargs())}
            kernel.fn.run(*args, grid=grid(meta), warmup=False, **meta)
            return
        key = self._key(kernel, args, kwargs)
        tuned = self._tuned.get(key)
        if tuned is None:
            with quick_first_launch(kernel, args, kwargs) if self.quick_first_launch else contextlib.nullcontext():
                precompile_configs(kernel, grid, args, kwargs)
                kernel[grid](*args, **kwargs)
            self._tuned[key] = kernel.best_config.all_kwargs()
            return
        meta = {**kwargs, **tuned}
        kernel.fn.run(*args, grid=grid(meta), warmup=False, **meta)

    @staticmethod
    def _key(kernel: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, LaunchSignature]:
        """What :attr:`_tuned` is keyed by: the kernel and its autotuner's cache key for this launch."""
        return kernel, key_signature(kernel, args, kwargs)

    @classmethod
    def _forced_config_for(cls, kernel: Any) -> dict[str, Any] | None:
        """:attr:`forced_config` if it sets exactly the meta-parameters ``kernel``'s configs tune (an
        op's other kernels keep their own configs), else None."""
        forced = cls.forced_config
        if forced is None or set(forced) - LAUNCH_OPTIONS == set(kernel.configs[0].kwargs):
            return forced
        return None


Launch = TraceableLaunch | DirectLaunch


@contextlib.contextmanager
def record_autotuned_launches() -> Iterator[list[tuple[Autotuner, tuple[Any, ...], dict[str, Any]]]]:
    """The eager launches of autotuned kernels made inside the block: (kernel, args, kwargs) each."""
    previous, DirectLaunch.launch_log = DirectLaunch.launch_log, []
    try:
        yield DirectLaunch.launch_log
    finally:
        DirectLaunch.launch_log = previous


def precompile_configs(kernel: Autotuner, grid: Grid, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Compile every config ``kernel``'s autotuner will time for this launch, in parallel; its
    timing then finds them compiled.

    Triton's autotuner compiles them one by one as it times them: the 18 RMSNorm backward configs
    take 7.6 s on one thread, 4.3 s on two (Triton's compiler releases the GIL in part; measured
    compiling for sm_90 on a 2-core CPU host). With the timing itself (:func:`quick_benchmarks`),
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


QUICK_FIRST_LAUNCH_CONFIGS = 4
"""Configs a quick first launch times: the first of its pruned configs, i.e. of its kernel's search
space, heuristic's favourite first (:mod:`inductor_ext.kernels.ranking`). Compiling and timing
every config was most of a cold ``fastops_inductor`` compile (H200, 4-layer decoder: 96 configs,
13.9 s of first launches in a 31.5 s compile). In a re-timing of every config on the H200
at Llama-3-8B shapes (10 kernels), the fastest config lay past the fourth for RMSNorm's forward
(2.4% faster than the pick) and GLU (0.1-0.3%); RoPE's winners are first since its ranking changed.
The standalone tuner (``python -m inductor_ext.autotune``) still times every config."""


def quick_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """What a quick first launch (or Inductor's tuning of a traced launch) times of a launch's
    pruned ``configs``: the first :data:`QUICK_FIRST_LAUNCH_CONFIGS`."""
    return configs[:QUICK_FIRST_LAUNCH_CONFIGS]


AUTOTUNE_BENCH_MS = (5, 25)
"""Warm-up and measured milliseconds per config when a first launch autotunes (Triton's defaults:
25 and 100). Triton's ``do_bench`` runs a config for that long whatever its speed, flushing L2
before every run: at the defaults, about 0.14 s per config, which made up most of a cold route
timing's "first launches" on the H200 (≈ 0.2 s per config all told, 68 configs in a decoder).
25 ms still gives ≥ 25 runs of a 1 ms kernel and hundreds of a 20 µs one for the median."""


@contextlib.contextmanager
def quick_benchmarks(kernel: Autotuner) -> Iterator[None]:
    """Within: ``kernel``'s autotuner times each config for :data:`AUTOTUNE_BENCH_MS` instead of
    Triton's defaults. Not set on the autotuners themselves: Inductor accepts a user kernel's
    autotuner only with the default benchmark settings."""
    previous = kernel.__dict__.get("do_bench")  # Triton's cached_property, once read
    warmup, rep = AUTOTUNE_BENCH_MS
    kernel.do_bench = functools.partial(triton.testing.do_bench, warmup=warmup, rep=rep)  # type: ignore[misc]
    try:
        yield
    finally:
        if previous is None:
            del kernel.do_bench
        else:
            kernel.do_bench = previous  # type: ignore[misc]


@contextlib.contextmanager
def quick_first_launch(kernel: Autotuner, args: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[None]:
    """Within: ``kernel``'s autotuner offers this launch's first :data:`QUICK_FIRST_LAUNCH_CONFIGS`
    configs only, and times each for :data:`AUTOTUNE_BENCH_MS` (:func:`quick_benchmarks`)."""
    previous = kernel.configs
    kernel.configs = quick_configs(candidate_configs(kernel, args, kwargs))
    try:
        with quick_benchmarks(kernel):
            yield
    finally:
        kernel.configs = previous


@contextlib.contextmanager
def thorough_benchmarks() -> Iterator[None]:
    """Within: first launches time every config for Triton's full 25 + 100 ms, not the first
    :data:`QUICK_FIRST_LAUNCH_CONFIGS` for :data:`AUTOTUNE_BENCH_MS`: the standalone tuner's
    setting, where a pick matters more than the seconds (H200, Llama-3-8B shapes: the
    worst pick was 4.2% off the best re-timed config with the short budget, 2.4% with the full one)."""
    previous = DirectLaunch.quick_first_launch
    DirectLaunch.quick_first_launch = False
    try:
        yield
    finally:
        DirectLaunch.quick_first_launch = previous


@contextlib.contextmanager
def force_launch_config(config: dict[str, Any] | None) -> Iterator[None]:
    """Make eager launches use ``config`` (a Triton config's kwargs, plus ``num_warps``) instead of tuning,
    for the kernels that take its parameters (the op's other kernels launch as usual)."""
    previous = DirectLaunch.forced_config
    DirectLaunch.forced_config = config
    try:
        yield
    finally:
        DirectLaunch.forced_config = previous


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def use_eager_bypass(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Launch directly unless something is tracing: compile/export, a dispatch mode, tensor subclasses."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(t is None or type(t) in _PLAIN_TENSOR_TYPES for t in tensors)


def backward_may_overwrite_saved(bwd: Any) -> bool:
    """Whether a backward, given ``bwd`` (the registered backward op, or its direct twin in plain eager),
    may write its results over the tensors its forward saved: in plain eager only (the registered op is
    functional, and a compiler plans the memory itself), with a graph that is not retained (no second
    backward reads them)."""
    return not isinstance(bwd, OpOverload) and not torch._C._autograd._get_current_graph_task_keep_graph()


@dataclasses.dataclass(frozen=True)
class OpFamily:
    """A forward/backward pair of registered ops and the eager bypass around them."""

    name: str
    fwd: OpOverload
    bwd: OpOverload
    eager: type[torch.autograd.Function]
    """Direct launches with autograd (forward and backward)."""
    run_fwd_direct: Callable[..., Any]
    """Direct launches of the forward alone, for calls that need no gradient."""
    tensor_args: tuple[int, ...]
    """Positions of the forward's tensor arguments."""
    run_bwd_direct: Callable[..., Any]
    setup_context: Callable[[Any, tuple[Any, ...], Any], None]
    backward: Callable[..., tuple[Any, ...]]
    has_kernels: bool = True
    """False when the math is the only implementation (no route to choose between)."""

    def __call__(self, *args: Any) -> Any:
        """Run the forward with autograd, bypassing the dispatcher in plain eager.

        Tracing (compile, export, dispatch modes, tensor subclasses) sees the registered
        op; plain eager launches directly, through the autograd.Function only when a
        gradient is needed (``Function.apply`` is most of the host cost of a small call).
        """
        tensors = [args[i] for i in self.tensor_args]
        if not use_eager_bypass(tensors):
            return self.fwd(*args)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            return self.eager.apply(*args)
        return self.run_fwd_direct(*args)


def define_op_family(
    name: str,
    *,
    fwd_math: Callable[..., Any],
    fwd_kernels: Callable[..., Any] | None,
    bwd_math: Callable[..., Any],
    bwd_kernels: Callable[..., Any] | None,
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    backward: Callable[..., tuple[Any, ...]],
) -> OpFamily:
    """Register ``fastops::{name}_fwd`` and ``fastops::{name}_bwd`` and wire autograd.

    The first argument of every op is its main tensor (it picks the device and
    the path).

    * ``*_math(*args)``: aten-only implementation (CPU branch and decomposition). Its
      annotated signature is the op's schema.
    * ``*_kernels(launch, *args)``: same signature after ``launch``; allocates outputs and
      launches Triton kernels through ``launch`` (traceable inside ops, direct in eager).
      None for both: the op has no kernels of its own (e.g. only cuBLAS GEMMs through aten), so
      the math runs on every path and the backend has no route to time.
    * ``setup_context(ctx, inputs, output)``: saves what the backward needs.
    * ``backward(ctx, bwd, *grads)``: returns input grads, computing them with ``bwd``
      (the registered backward op, or its eager twin, called with ``bwd_math``'s signature).
      A grad is None for an output that received no gradient (the eager path does not
      materialise zeros).
    """
    fwd_op = _define_op(f"{name}_fwd", fwd_math, fwd_kernels)
    bwd_op = _define_op(f"{name}_bwd", bwd_math, bwd_kernels)

    def _run_fwd_direct(*args: Any) -> Any:
        return _run_direct(fwd_math, fwd_kernels, args)

    def _run_bwd_direct(*args: Any) -> Any:
        return _run_direct(bwd_math, bwd_kernels, args)

    # Old-style forward(ctx, ...): a separate setup_context staticmethod would make
    # Function.apply bind arguments through inspect.signature on every call.
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            # no zero-filled gradients for outputs the caller did not use (or that are
            # non-differentiable, like rstd): one allocation and fill kernel less per call
            ctx.set_materialize_grads(False)
            output = _run_fwd_direct(*args)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, _run_bwd_direct, *grads)

    Eager.__name__ = Eager.__qualname__ = f"{name}_eager"
    torch.library.register_autograd(
        fwd_op,
        lambda ctx, *grads: backward(ctx, bwd_op, *grads),
        setup_context=setup_context,
    )
    DECOMPOSITIONS[fwd_op] = fwd_math
    DECOMPOSITIONS[bwd_op] = bwd_math
    tensor_args = tuple(i for i, a in enumerate(fwd_op._schema.arguments) if _is_tensor_type(a.type))
    family = OpFamily(
        name,
        fwd_op,
        bwd_op,
        Eager,
        _run_fwd_direct,
        tensor_args,
        _run_bwd_direct,
        setup_context,
        backward,
        has_kernels=fwd_kernels is not None,
    )
    FAMILIES[fwd_op] = family
    FAMILY_OF.update(dict.fromkeys((fwd_op._name, bwd_op._name), name))
    return family


_DIRECT = DirectLaunch()
_TRACEABLE = TraceableLaunch()


def _run_direct(math: Callable[..., Any], kernels: Callable[..., Any] | None, args: Sequence[Any]) -> Any:
    x = args[0]
    if kernels is None or x.numel() == 0 or not kernels_run_on(x.device):
        return math(*args)
    return kernels(_DIRECT, *args)


def _is_tensor_type(schema_type: Any) -> bool:
    """``Tensor`` or ``Tensor?`` in an op schema."""
    if isinstance(schema_type, torch.OptionalType):
        schema_type = schema_type.getElementType()
    return isinstance(schema_type, torch.TensorType)


def _traces_math(qualname: str, args: Sequence[Any]) -> bool:
    choose_math = _math_route.get()
    return choose_math is not None and choose_math(qualname, args)


@dataclasses.dataclass(frozen=True)
class InPlaceTiming:
    """How route timing runs a backward op whose output is as large as one of its inputs: writing
    the output over that input, so the timing holds the input alone, not both (cross-entropy's
    backward at Llama-3's 4096 x 128256 bf16: 0.98 GiB of logits, and as much again of gradient).

    It reads and writes the bytes the functional op does. Our kernels launch the functional op's
    autotuned JIT function (so the launch config picked while timing is the one a compile looks
    up), and Inductor fuses the math and its copy into the input into one kernel."""

    kernels: Callable[..., Any]
    """``(launch, *the backward op's args) -> None``, as :func:`define_op_family`'s ``kernels``."""
    math: Callable[..., Any]
    """Aten math writing the output over the input, compiled for Inductor's route."""

    def run_direct(self, *args: Any) -> None:
        _run_direct(self.math, self.kernels, args)


@dataclasses.dataclass(frozen=True)
class MutatingOp:
    """An op that writes into some of its inputs; it has no autograd formula (PyTorch refuses
    them on mutating ops), so callers wire gradients themselves (e.g. an ``autograd.Function``)."""

    op: OpOverload
    run_direct: Callable[..., Any]
    """Direct launches (eager), bumping each mutated tensor's version counter as the dispatcher would."""
    tensor_args: tuple[int, ...]

    def __call__(self, *args: Any) -> Any:
        if use_eager_bypass([args[i] for i in self.tensor_args]):
            return self.run_direct(*args)
        return self.op(*args)


def define_mutating_op(
    name: str, *, family: str, math: Callable[..., Any], kernels: Callable[..., Any], mutates: Sequence[str]
) -> MutatingOp:
    """Register ``fastops::{name}`` writing into the arguments named in ``mutates``; ``family``
    names the op family it belongs to (its per-family options apply to it).

    ``math`` and ``kernels`` follow :func:`define_op_family`'s conventions (the annotated
    signature of ``math`` is the schema; the first argument picks the device and path).
    """
    op = _define_op(name, math, kernels, mutates_args=tuple(mutates))
    FAMILY_OF[op._name] = family
    return _mutating_op(op, functools.partial(_run_direct, math, kernels), mutates)


def define_opaque_mutating_op(name: str, fn: Callable[..., Any], *, mutates: Sequence[str]) -> MutatingOp:
    """Register ``fastops::{name}`` as a plain ``custom_op`` running ``fn`` (its annotated signature is
    the schema), writing into the arguments named in ``mutates``.

    Opaque to the compiler: unlike a ``triton_op`` its body is never traced into aten ops, so an
    in-place update stays one. AOTAutograd functionalizes each call (``auto_functionalized``) and
    Inductor's reinplacing makes it in place again when nothing else reads the old values.
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates))._opoverload
    return _mutating_op(op, lambda args: fn(*args), mutates)


def _mutating_op(op: OpOverload, run: Callable[[tuple[Any, ...]], Any], mutates: Sequence[str]) -> MutatingOp:
    """``op`` wrapped for eager calls: ``run(args)`` directly, bumping the mutated tensors' versions."""
    arguments = op._schema.arguments
    mutated = [i for i, a in enumerate(arguments) if a.name in mutates]

    def run_direct(*args: Any) -> Any:
        output = run(args)
        for i in mutated:
            torch.autograd.graph.increment_version(args[i])
        return output

    return MutatingOp(op, run_direct, tuple(i for i, a in enumerate(arguments) if _is_tensor_type(a.type)))


def _define_op(
    qualname: str, math: Callable[..., Any], kernels: Callable[..., Any] | None, mutates_args: tuple[str, ...] = ()
) -> OpOverload:
    full_name = f"{NAMESPACE}::{qualname}"

    @functools.wraps(math)
    def body(*args: Any) -> Any:
        x = args[0]
        if kernels is None or _traces_math(full_name, args) or x.device.type != "cuda" or x.numel() == 0:
            return math(*args)
        return kernels(_TRACEABLE, *args)

    triton_op(full_name, body, mutates_args=mutates_args)
    return getattr(getattr(torch.ops, NAMESPACE), qualname).default

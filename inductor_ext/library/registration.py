"""The op recipe, done once: every fastops op family is built by :func:`define_op_family`.

A family is a forward and a backward ``torch.library.triton_op`` in the ``fastops``
namespace, wired with ``register_autograd``, plus an eager bypass:

* Eager (not compiling, plain tensors): the public function calls an
  ``autograd.Function`` that launches the Triton kernels directly: its host cost per call
  is close to a raw launch's, while dispatching through the registered ``triton_op`` costs
  over twice as much.
* ``torch.compile`` / ``torch.export`` / any tracing mode: the registered ops,
  whose bodies Inductor traces (so ``cpp_wrapper`` and AOTInductor compile the
  Triton kernels in).

Each op body starts with a CPU branch that computes the same math in aten ops:
``register_kernel("cpu", ...)`` is ignored under ``torch.compile`` (the body is
traced whatever the device), so the branch must live inside the body. That
branch is what makes compile, ``cpp_wrapper`` and AOTInductor work on CPU.

The same aten math is registered in :data:`DECOMPOSITIONS` for the
``fastops_inductor`` backend's Inductor route.

This module registers ops and finds them (:data:`FAMILIES`, :data:`FAMILY_OF`); the launches an
op's kernels go through are :mod:`inductor_ext.library.launch`, and the tuning-time settings of the
eager ones :mod:`inductor_ext.tuning.launch_settings`.
"""

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch._inductor.config
from torch._ops import OpOverload
from torch.library import triton_op
from triton.runtime.autotuner import Autotuner

from inductor_ext.library.launch import DirectLaunch, TraceableLaunch, kernels_run_on

NAMESPACE = "fastops"

DECOMPOSITIONS: dict[OpOverload, Callable[..., Any]] = {}
"""fastops op overload -> aten-only implementation (the math each op's body traces on the Inductor route)."""

FAMILIES: dict[OpOverload, "OpFamily"] = {}
"""Forward op overload -> its family, for the backend (which finds forward ops in graphs)."""

FAMILY_OF: dict[str, str] = {}
"""Op qualname (``fastops::rms_norm_bwd``) -> its family's name (``rms_norm``), for per-family options."""

IN_PLACE_TIMING: dict[OpOverload, "InPlaceTiming"] = {}
"""Backward op -> its in-place timing, used by route timing when its largest input takes at least
:data:`IN_PLACE_TIMING_MIN_BYTES` (``tuning.routes.call_directions``)."""

IN_PLACE_TIMING_MIN_BYTES = 256 * 2**20
"""Below this the functional op is timed: a copy of the input costs the standalone tuner's peak
less than Triton's 256 MB L2-flush buffer, which every config's benchmark allocates anyway."""

OUTPUTS_OVER_DONATED: dict[Any, tuple["InPlaceArguments", ...]] = {}
"""Triton JIT function -> the (input, output) argument pairs a backward kernel may write over a donated
input, filled by the op modules that launch the kernels (:func:`may_write_over_input`) and read by the
backend's post-grad pass (``inductor.donated_buffers``)."""

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
      the math runs on every path and the backend has no route to time; None for one: that direction
      runs its math on every path (e.g. the embedding's forward, a gather).
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
        has_kernels=fwd_kernels is not None or bwd_kernels is not None,
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
    return choose_math is not None and qualname in FAMILY_OF and choose_math(qualname, args)


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


class InPlaceArguments(NamedTuple):
    """Argument names: the kernel may write ``output`` over ``input`` (elementwise: each program reads
    an element of ``input`` before it writes the same element of ``output``)."""

    input: str
    output: str


def may_write_over_input(kernel: Any, *pairs: tuple[str, str]) -> None:
    """Declare that ``kernel`` (a Triton JIT function, or an autotuner around one) may write each pair's
    ``output`` argument over its ``input`` argument (:data:`OUTPUTS_OVER_DONATED`). Kernels are keyed by
    their JIT function: autotuned kernels are traced through autotuners built around it
    (``library.launch.pruned_autotuner``)."""
    jit = kernel.fn if isinstance(kernel, Autotuner) else kernel
    OUTPUTS_OVER_DONATED[jit] = tuple(InPlaceArguments(*pair) for pair in pairs)


@dataclasses.dataclass(frozen=True)
class MutatingOp:
    """A registered op that writes into some of its inputs, called directly in plain eager (the
    dispatcher bypassed) and through the registered op when anything traces. It has no autograd formula
    (PyTorch refuses them on mutating ops), so callers wire gradients themselves (e.g. an
    ``autograd.Function``)."""

    op: OpOverload
    run_direct: Callable[..., Any]
    """Direct launches (eager), bumping each mutated tensor's version counter as the dispatcher would."""
    tensor_args: tuple[int, ...]
    aten_body: Callable[..., Any] | None = None
    """An opaque op's function, traced in its place when compiling for AOTInductor (whose C++ runtime
    cannot call an op registered from Python)."""

    def __call__(self, *args: Any) -> Any:
        if use_eager_bypass([args[i] for i in self.tensor_args]):
            return self.run_direct(*args)
        if self.aten_body is not None and _compiling_for_aot_inductor():
            return self.aten_body(*args)
        return self.op(*args)


def _compiling_for_aot_inductor() -> bool:
    """Inside ``aoti_compile_and_package`` (or ``aot_compile``), which sets AOTInductor's output path, as
    AOTAutograd traces op bodies (Dynamo, which records the op itself, does not read the config)."""
    return not torch.compiler.is_dynamo_compiling() and bool(torch._inductor.config.aot_inductor.output_path)


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
    Inductor's reinplacing makes it in place again when nothing else reads the old values. Compiled
    for AOTInductor, ``fn`` itself is traced instead (its aten ops, functionalised): a package must
    not call back into Python.
    """
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates))._opoverload
    return _mutating_op(op, lambda args: fn(*args), mutates, aten_body=fn)


@dataclasses.dataclass(frozen=True)
class InferenceOp:
    """A registered op with no autograd formula (inference only: a gradient through it is refused),
    called directly in plain eager and through the registered op when anything traces."""

    op: OpOverload
    run_direct: Callable[..., Any]
    tensor_args: tuple[int, ...]

    def __call__(self, *args: Any) -> Any:
        if use_eager_bypass([args[i] for i in self.tensor_args]):
            return self.run_direct(*args)
        return self.op(*args)


def define_inference_op(name: str, *, math: Callable[..., Any], kernels: Callable[..., Any]) -> InferenceOp:
    """Register ``fastops::{name}``, an op without a backward (:func:`define_op_family`'s conventions
    for ``math`` and ``kernels``). It belongs to no family: the backend has no route to choose for it,
    and its body traces the kernels on a GPU, the math elsewhere."""
    op = _define_op(name, math, kernels)
    tensor_args = tuple(i for i, a in enumerate(op._schema.arguments) if _is_tensor_type(a.type))
    return InferenceOp(op, lambda *args: _run_direct(math, kernels, args), tensor_args)


def _mutating_op(
    op: OpOverload,
    run: Callable[[tuple[Any, ...]], Any],
    mutates: Sequence[str],
    aten_body: Callable[..., Any] | None = None,
) -> MutatingOp:
    """``op`` wrapped for eager calls: ``run(args)`` directly, bumping the mutated tensors' versions."""
    arguments = op._schema.arguments
    mutated = [i for i, a in enumerate(arguments) if a.name in mutates]

    def run_direct(*args: Any) -> Any:
        output = run(args)
        for i in mutated:
            torch.autograd.graph.increment_version(args[i])
        return output

    tensor_args = tuple(i for i, a in enumerate(arguments) if _is_tensor_type(a.type))
    return MutatingOp(op, run_direct, tensor_args, aten_body)


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

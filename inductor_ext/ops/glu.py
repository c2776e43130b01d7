"""SwiGLU / GeGLU: ``torch.ops.fastops.glu_*`` and :func:`swiglu`, :func:`geglu` and their packed forms.

Schemas::

    fastops::glu_fwd(Tensor gate, Tensor up, str activation) -> Tensor y
    fastops::glu_bwd(Tensor dy, Tensor gate, Tensor up, str activation) -> (Tensor dgate, Tensor dup)
    fastops::glu_packed_fwd(Tensor gate_up, str activation) -> Tensor y
    fastops::glu_packed_bwd(Tensor dy, Tensor gate_up, str activation) -> Tensor dgate_up

``activation`` is ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``. ``gate``, ``up`` and
``dy`` are 2-D ``(M, I)`` with unit column stride and any row stride (e.g. the two
halves of one projection's output); ``gate_up`` is ``(M, 2I)``, gate first. Outputs
are contiguous, in the gate's dtype. The backward recomputes the activation from
the inputs saved for it (``gate`` and ``up``): nothing else is saved. The math is in
the docstring of :mod:`inductor_ext.kernels.glu`.
"""

from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.glu import (
    ACTIVATIONS,
    glu_bwd_inplace_kernel,
    glu_bwd_kernel,
    glu_fwd_kernel,
    glu_packed_bwd_inplace_kernel,
)
from inductor_ext.library.launch import DirectLaunch, Launch, kernels_run_on
from inductor_ext.library.registration import (
    OpFamily,
    backward_may_overwrite_saved,
    define_op_family,
    may_write_over_input,
)
from inductor_ext.library.sharding import Strategy, replicated, shard_inputs, sharding_rule
from inductor_ext.ops._layout import rows_2d, unit_last_stride

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
APPROXIMATIONS = ("none", "tanh")


def _activation_math(a: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(a)
    return torch.nn.functional.gelu(a, approximate="tanh" if activation == "gelu_tanh" else "none")


def _activation_derivative_math(a: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(act(a), act'(a)), aten only (the backend decomposes into this; no autograd inside ops)."""
    if activation == "silu":
        s = torch.sigmoid(a)
        return a * s, s * (1 + a * (1 - s))
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(a * 0.5**0.5))
        return a * cdf, cdf + a * torch.exp(-0.5 * a * a) * (2 * torch.pi) ** -0.5
    s = torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (a + 0.044715 * a.pow(3)))
    du = (2 / torch.pi) ** 0.5 * (1 + 3 * 0.044715 * a * a)
    return a * s, s + 2 * a * s * (1 - s) * du


def glu_fwd_math(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """Aten-only forward (CPU branch and the backend's decomposition), computed in fp32."""
    return (_activation_math(gate.float(), activation) * up.float()).to(gate.dtype)


def glu_bwd_math(dy: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """Aten-only backward: dgate = dy * up * act'(gate), dup = dy * act(gate)."""
    act, dact = _activation_derivative_math(gate.float(), activation)
    dyf = dy.float()
    return (dyf * up.float() * dact).to(gate.dtype), (dyf * act).to(gate.dtype)


def glu_packed_fwd_math(gate_up: Tensor, activation: str) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return glu_fwd_math(gate, up, activation)


def glu_packed_bwd_math(dy: Tensor, gate_up: Tensor, activation: str) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat(glu_bwd_math(dy, gate, up, activation), dim=-1)


def _is_flat(n_cols: int, *tensors: Tensor) -> bool:
    """True when every (M, n_cols) tensor is contiguous, so the kernels may run 1-D over M * n_cols."""
    return all(t.shape[0] <= 1 or t.stride(0) == n_cols for t in tensors)


def _grid(n_rows: int, n_cols: int, flat: bool) -> Any:
    if flat:
        return lambda meta: (triton.cdiv(n_rows * n_cols, meta["BLOCK"]),)
    return lambda meta: (n_rows * triton.cdiv(n_cols, meta["BLOCK"]),)


def _launch(
    launch: Launch, kernel: Any, shape: tuple[int, int], activation: str, *args: Any, flat: bool, packed: bool
) -> None:
    """``kernel`` on ``args`` over an ``(M, I)`` ``shape`` of outputs: the grid and constexprs of the layout."""
    launch(kernel, _grid(*shape, flat), *args, ACTIVATION=ACTIVATIONS[activation], FLAT=flat, PACKED=packed)


def glu_fwd_kernels(launch: Launch, gate: Tensor, up: Tensor, activation: str) -> Tensor:
    gate, up = unit_last_stride(gate), unit_last_stride(up)
    M, I = gate.shape
    y = gate.new_empty((M, I))
    flat = _is_flat(I, gate, up)
    _launch(launch, glu_fwd_kernel, (M, I), activation,
            gate, up, y, M, I, gate.stride(0), up.stride(0), y.stride(0), flat=flat, packed=False)  # fmt: skip
    return y


def glu_bwd_kernels(launch: Launch, dy: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    dy, gate, up = unit_last_stride(dy), unit_last_stride(gate), unit_last_stride(up)
    M, I = gate.shape
    return _glu_bwd_into(launch, dy, gate, up, activation, gate.new_empty((M, I)), gate.new_empty((M, I)))


# The backend's post-grad pass (inductor.donated_buffers) may point dgate and dup at donated gate and up
# (each element is read before its gradient is stored over it).
may_write_over_input(glu_bwd_kernel, ("GATE", "DGATE"), ("UP", "DUP"))


def _glu_bwd_into(
    launch: Launch, dy: Tensor, gate: Tensor, up: Tensor, activation: str, dgate: Tensor, dup: Tensor
) -> tuple[Tensor, Tensor]:
    """The backward kernel writing into ``dgate`` and ``dup``, which may be ``gate`` and ``up`` themselves
    (each element is read before its gradient is stored over it)."""
    M, I = gate.shape
    flat = _is_flat(I, dy, gate, up, dgate, dup)
    kernel = glu_bwd_inplace_kernel if dgate is gate else glu_bwd_kernel
    _launch(
        launch, kernel, (M, I), activation,
        dy, gate, up, dgate, dup, M, I, dy.stride(0), gate.stride(0), up.stride(0), dgate.stride(0), dup.stride(0),
        flat=flat, packed=False,
    )  # fmt: skip
    return dgate, dup


def glu_packed_fwd_kernels(launch: Launch, gate_up: Tensor, activation: str) -> Tensor:
    gate_up = unit_last_stride(gate_up)
    M, I = gate_up.shape[0], gate_up.shape[1] // 2
    y = gate_up.new_empty((M, I))
    _launch(
        launch, glu_fwd_kernel, (M, I), activation,
        gate_up, None, y, M, I, gate_up.stride(0), gate_up.stride(0), y.stride(0), flat=False, packed=True,
    )  # fmt: skip
    return y


def glu_packed_bwd_kernels(launch: Launch, dy: Tensor, gate_up: Tensor, activation: str) -> Tensor:
    dy, gate_up = unit_last_stride(dy), unit_last_stride(gate_up)
    return _glu_packed_bwd_into(launch, dy, gate_up, activation, gate_up.new_empty(gate_up.shape))


def _glu_packed_bwd_into(launch: Launch, dy: Tensor, gate_up: Tensor, activation: str, dgate_up: Tensor) -> Tensor:
    """The packed backward kernel writing into ``dgate_up``, which may be ``gate_up`` itself."""
    M, I = dy.shape
    _launch(
        launch, glu_packed_bwd_inplace_kernel if dgate_up is gate_up else glu_bwd_kernel, (M, I), activation,
        dy, gate_up, None, dgate_up, None,
        M, I, dy.stride(0), gate_up.stride(0), gate_up.stride(0), dgate_up.stride(0), dgate_up.stride(0),
        flat=False, packed=True,
    )  # fmt: skip
    return dgate_up


def _setup_context(ctx: Any, inputs: Sequence[Any], output: Tensor) -> None:
    *tensors, ctx.activation = inputs
    ctx.save_for_backward(*tensors)


def _overwrites_inputs(ctx: Any, bwd: Any, inputs: Sequence[Tensor]) -> bool:
    """Whether this backward writes the input gradients over the saved inputs: asked for by the caller
    (``overwrite_inputs_in_backward``), allowed (:func:`backward_may_overwrite_saved`), launched by our
    kernels (not for zero-size inputs, which the math handles), and the inputs are activations (never
    leaves: a parameter must not become its own gradient)."""
    return (
        getattr(ctx, "overwrite_inputs", False)
        and backward_may_overwrite_saved(bwd)
        and all(
            t.grad_fn is not None and t.numel() > 0 and t.stride(-1) == 1 and kernels_run_on(t.device) for t in inputs
        )
    )


def _backward(ctx: Any, bwd: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    gate, up = ctx.saved_tensors
    if not _overwrites_inputs(ctx, bwd, (gate, up)):
        return (*bwd(dy, gate, up, ctx.activation), None)
    _glu_bwd_into(DirectLaunch(), unit_last_stride(dy), gate, up, ctx.activation, gate, up)
    for t in (gate, up):  # anything else that saved them now fails loudly instead of reading gradients
        torch.autograd.graph.increment_version(t)
    return gate.detach(), up.detach(), None


def _packed_backward(ctx: Any, bwd: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
    (gate_up,) = ctx.saved_tensors
    if not _overwrites_inputs(ctx, bwd, (gate_up,)):
        return bwd(dy, gate_up, ctx.activation), None
    _glu_packed_bwd_into(DirectLaunch(), unit_last_stride(dy), gate_up, ctx.activation, gate_up)
    torch.autograd.graph.increment_version(gate_up)
    return gate_up.detach(), None


def _mark_overwrite(family: OpFamily, y: Tensor, overwrite_inputs_in_backward: bool) -> None:
    """Tell ``y``'s eager backward node (the autograd context) that it may overwrite the saved inputs."""
    if (
        overwrite_inputs_in_backward
        and not torch.compiler.is_compiling()
        and isinstance(y.grad_fn, family.eager._backward_cls)
    ):
        y.grad_fn.overwrite_inputs = True


glu_family = define_op_family(
    "glu",
    fwd_math=glu_fwd_math,
    fwd_kernels=glu_fwd_kernels,
    bwd_math=glu_bwd_math,
    bwd_kernels=glu_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)

glu_packed_family = define_op_family(
    "glu_packed",
    fwd_math=glu_packed_fwd_math,
    fwd_kernels=glu_packed_fwd_kernels,
    bwd_math=glu_packed_bwd_math,
    bwd_kernels=glu_packed_bwd_kernels,
    setup_context=_setup_context,
    backward=_packed_backward,
)


@sharding_rule(glu_family.fwd)
def _glu_fwd_sharding(gate: Any, up: Any, activation: str) -> list[Strategy]:
    """Elementwise: gate and up sharded alike, on the token rows (dim 0) or the intermediate dim (dim 1)."""
    from torch.distributed.tensor import Shard

    inputs = (gate, up)
    return [replicated(1, inputs)] + [([Shard(d)], shard_inputs(d, inputs, (True, True))) for d in (0, 1)]


@sharding_rule(glu_family.bwd)
def _glu_bwd_sharding(dy: Any, gate: Any, up: Any, activation: str) -> list[Strategy]:
    """Elementwise: dy, gate and up sharded alike, on the token rows or the intermediate dim."""
    from torch.distributed.tensor import Shard

    inputs = (dy, gate, up)
    return [replicated(2, inputs)] + [([Shard(d)] * 2, shard_inputs(d, inputs, (True, True, True))) for d in (0, 1)]


@sharding_rule(glu_packed_family.fwd)
def _glu_packed_fwd_sharding(gate_up: Any, activation: str) -> list[Strategy]:
    """Token rows only: gate and up are the two halves of the last dim, which a shard of it would split."""
    from torch.distributed.tensor import Shard

    return [replicated(1, (gate_up,)), ([Shard(0)], [Shard(0)])]


@sharding_rule(glu_packed_family.bwd)
def _glu_packed_bwd_sharding(dy: Any, gate_up: Any, activation: str) -> list[Strategy]:
    """Token rows only, as the forward."""
    from torch.distributed.tensor import Shard

    return [replicated(1, (dy, gate_up)), ([Shard(0)], [Shard(0), Shard(0)])]


def _check_tensor(fn: str, name: str, t: Any) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() == 0:
        raise ValueError(f"{fn}: {name} must have at least 1 dimension, got a scalar")


def _activation_name(fn: str, approximate: str) -> str:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{fn}: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    return "gelu_tanh" if approximate == "tanh" else "gelu"


def _glu(fn: str, gate: Tensor, up: Tensor, activation: str, overwrite_inputs_in_backward: bool) -> Tensor:
    _check_tensor(fn, "gate", gate)
    _check_tensor(fn, "up", up)
    if up.shape != gate.shape:
        raise ValueError(f"{fn}: up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise TypeError(f"{fn}: up must have gate's dtype {gate.dtype}, got {up.dtype}")
    if up.device != gate.device:
        raise ValueError(f"{fn}: up is on {up.device} but gate is on {gate.device}; both must be on one device")
    y = glu_family(rows_2d(gate), rows_2d(up), activation)
    _mark_overwrite(glu_family, y, overwrite_inputs_in_backward)
    return y if gate.dim() == 2 else y.view(gate.shape)


def _glu_packed(fn: str, gate_up: Tensor, activation: str, overwrite_inputs_in_backward: bool) -> Tensor:
    _check_tensor(fn, "gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{fn}: gate_up's last dimension must be even (gate and up halves), got {gate_up.shape[-1]}")
    y = glu_packed_family(rows_2d(gate_up), activation)
    _mark_overwrite(glu_packed_family, y, overwrite_inputs_in_backward)
    return y if gate_up.dim() == 2 else y.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def swiglu(gate: Tensor, up: Tensor, *, overwrite_inputs_in_backward: bool = False) -> Tensor:
    """``silu(gate) * up`` (the Llama MLP's ``act_fn(gate_proj(x)) * up_proj(x)``), fused.

    Args:
        gate, up: same shape and dtype (float32/bfloat16/float16), any leading dims.
            Rows may have any stride (e.g. halves of one projection); only a last dim
            without unit stride, or leading dims that cannot be flattened, are copied.
        overwrite_inputs_in_backward: let the eager backward write the gradients of ``gate``
            and ``up`` over ``gate`` and ``up`` (no new ``2 M I`` elements at the backward's
            peak), when they are activations nothing else reads after it, e.g. the outputs of
            the MLP's projections. Their version counters are bumped, so a backward that saved
            them too raises instead of reading gradients. Only where our kernels run, the graph
            is not retained, and in plain eager: compiled graphs plan their own buffers.

    Computes in fp32 and rounds once to the inputs' dtype (HF eager also rounds
    ``silu(gate)`` to the dtype before the product). The backward recomputes
    ``silu(gate)`` from the saved inputs.
    """
    return _glu("swiglu", gate, up, "silu", overwrite_inputs_in_backward)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none", *, overwrite_inputs_in_backward: bool = False) -> Tensor:
    """``gelu(gate, approximate=approximate) * up``, fused; ``approximate`` is ``"none"`` (erf) or ``"tanh"``.

    Same arguments and numerics as :func:`swiglu`.
    """
    return _glu("geglu", gate, up, _activation_name("geglu", approximate), overwrite_inputs_in_backward)


def swiglu_packed(gate_up: Tensor, *, overwrite_inputs_in_backward: bool = False) -> Tensor:
    """``silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)`` (Phi-3's fused ``gate_up_proj``).

    ``gate_up`` is ``(..., 2 * I)``; returns ``(..., I)``. The gradient is one
    ``(..., 2 * I)`` tensor written by one kernel (no concatenation), over ``gate_up`` itself with
    ``overwrite_inputs_in_backward`` (as :func:`swiglu`'s).
    """
    return _glu_packed("swiglu_packed", gate_up, "silu", overwrite_inputs_in_backward)


def geglu_packed(gate_up: Tensor, approximate: str = "none", *, overwrite_inputs_in_backward: bool = False) -> Tensor:
    """``gelu(gate, approximate=approximate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``."""
    activation = _activation_name("geglu_packed", approximate)
    return _glu_packed("geglu_packed", gate_up, activation, overwrite_inputs_in_backward)


def swiglu_ref(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-PyTorch SwiGLU, the HF spelling (differentiable). With float64 inputs it is the exact reference."""
    return torch.nn.functional.silu(gate) * up


def geglu_ref(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """Plain-PyTorch GeGLU, the HF spelling (differentiable)."""
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


__all__ = [
    "geglu",
    "geglu_packed",
    "geglu_ref",
    "glu_family",
    "glu_packed_family",
    "swiglu",
    "swiglu_packed",
    "swiglu_ref",
]

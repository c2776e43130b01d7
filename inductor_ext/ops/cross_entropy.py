"""Cross-entropy: ``torch.ops.fastops.cross_entropy_*`` and :func:`cross_entropy`.

Schemas::

    fastops::cross_entropy_fwd(Tensor logits, Tensor labels, int ignore_index, float label_smoothing,
                               float lse_square_scale, float softcap, str reduction)
        -> (Tensor loss, Tensor lse)
    fastops::cross_entropy_bwd(Tensor grad_output, Tensor logits, Tensor labels, Tensor lse,
                               int ignore_index, float label_smoothing, float lse_square_scale,
                               float softcap, str reduction) -> Tensor dlogits
    fastops::cross_entropy_bwd_inplace(Tensor grad_output, Tensor(a!) logits, Tensor labels, Tensor lse,
                                       int ignore_index, float label_smoothing, float lse_square_scale,
                                       float softcap, str reduction) -> ()

``logits`` is 2-D ``(N, V)`` with unit stride along V, ``labels`` is ``(N,)`` int64
or int32. ``loss`` is fp32: a 0-dim tensor for ``reduction="mean"``/``"sum"``, ``(N,)``
for ``"none"``; ``lse`` is each row's fp32 log-sum-exp. ``softcap = 0`` means no
soft-capping. The forward reads the logits once (see
:mod:`inductor_ext.kernels.cross_entropy`); the backward reads them once more and
writes the gradient of ``grad_output * loss``, scaled and rounded once: three passes
over ``N x V`` in all, whatever ``grad_output`` is.

``cross_entropy_bwd_inplace`` is the ``inplace_backward=True`` path: the gradient
replaces the logits (no second ``N x V`` buffer). PyTorch cannot register autograd on
ops that mutate inputs, so it is wired by a Python ``autograd.Function``
(:class:`_CrossEntropyInplace`), which Dynamo traces.

The mean divides by the number of labels that are not ``ignore_index``, counted on
the device. When every label is ignored that count is 0 and, as in
``torch.nn.functional.cross_entropy``, the mean is NaN; the gradient is all zeros.
"""

from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.cross_entropy import (
    SCALE_BLOCK,
    cross_entropy_bwd_inplace_kernel,
    cross_entropy_bwd_kernel,
    cross_entropy_fwd_inplace_kernel,
    cross_entropy_fwd_kernel,
    scale_rows_kernel,
)
from inductor_ext.library.launch import Launch
from inductor_ext.library.registration import (
    IN_PLACE_TIMING,
    InPlaceTiming,
    define_mutating_op,
    define_op_family,
    may_write_over_input,
)
from inductor_ext.library.sharding import Strategy, replicated, shard_inputs, sharding_rule
from inductor_ext.ops._arguments import check_real
from inductor_ext.ops._layout import unit_last_stride

REDUCTIONS = ("mean", "sum", "none")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LABEL_DTYPES = (torch.int64, torch.int32)

CeOptions = tuple[int, float, float, float]
"""(ignore_index, label_smoothing, lse_square_scale, softcap): the loss options of the kernels and their
aten math, as the ops take them (``softcap = 0``: no soft-capping)."""


# --- shared pieces (also used by fused linear cross-entropy) -------------------------------------


def loss_options(
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float | None
) -> CeOptions:
    """A public function's loss arguments as the ops take them: Python int and floats, ``softcap=None`` as 0."""
    return int(ignore_index), float(label_smoothing), float(lse_square_scale), float(softcap or 0.0)


def count_non_ignored(labels: Tensor, ignore_index: int) -> Tensor:
    """Number of labels other than ``ignore_index``: a 0-dim int64 device tensor (no host sync)."""
    return (labels != ignore_index).sum()


def mean_grad_scale(count: Tensor) -> Tensor:
    """``1 / max(count, 1)`` as a 0-dim fp32 tensor: the gradient factor of ``reduction="mean"``."""
    return count.clamp_min(1).to(torch.float32).reciprocal()


def count_and_grad_scale(labels: Tensor, ignore_index: int, reduction: str) -> tuple[Tensor, Tensor | None]:
    """The non-ignored label count, and the gradient factor it gives ``reduction="mean"`` (None otherwise)."""
    count = count_non_ignored(labels, ignore_index)
    return count, mean_grad_scale(count) if reduction == "mean" else None


def reduce_loss(row_loss: Tensor, count: Tensor, reduction: str) -> Tensor:
    """Sum, mean over non-ignored rows (``0 / 0 = NaN`` when all are ignored, like PyTorch), or rows."""
    if reduction == "none":
        return row_loss
    total = row_loss.sum()
    return total if reduction == "sum" else total / count


def capped_logits(logits: Tensor, softcap: float) -> tuple[Tensor, Tensor | None]:
    """(z, t): fp32 logits after soft-capping, and ``t = tanh(x / softcap)`` (None without softcap)."""
    x = logits.float()
    if softcap > 0:
        t = torch.tanh(x / softcap)
        return softcap * t, t
    return x, None


def row_loss_and_lse_math(logits: Tensor, labels: Tensor, options: CeOptions) -> tuple[Tensor, Tensor]:
    """Aten-only loss per row and log-sum-exp per row (both fp32): the forward kernel's math."""
    ignore_index, label_smoothing, lse_square_scale, softcap = options
    v = logits.shape[-1]
    z, _t = capped_logits(logits, softcap)
    lse = torch.logsumexp(z, dim=-1)
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < v)
    z_y = z.gather(1, torch.where(in_range, labels, 0).long().unsqueeze(1)).squeeze(1)
    loss = lse - (1.0 - label_smoothing) * z_y + lse_square_scale * lse * lse
    if label_smoothing > 0:
        loss = loss - label_smoothing / v * z.sum(-1)
    loss = torch.where(ignored, 0.0, torch.where(in_range, loss, float("nan")))
    return loss, torch.where(ignored, 0.0, lse)


def grad_from_lse_math(
    logits: Tensor, labels: Tensor, lse: Tensor, options: CeOptions, grad_scale: Tensor | None
) -> Tensor:
    """Aten-only gradient (logits' dtype, times ``grad_scale``: None, 0-dim or per row): the backward kernel's math."""
    ignore_index, label_smoothing, lse_square_scale, softcap = options
    v = logits.shape[-1]
    z, t = capped_logits(logits, softcap)
    in_range = (labels >= 0) & (labels < v)
    safe_labels = torch.where(in_range, labels, 0).long()
    g = torch.exp(z - lse.unsqueeze(1)) * (1.0 + 2.0 * lse_square_scale * lse).unsqueeze(1) - label_smoothing / v
    is_target = (torch.arange(v, device=logits.device) == safe_labels.unsqueeze(1)) & in_range.unsqueeze(1)
    g = g - torch.where(is_target, 1.0 - label_smoothing, 0.0)
    if t is not None:
        g = g * (1.0 - t * t)
    if grad_scale is not None:
        g = g * (grad_scale.float().unsqueeze(-1) if grad_scale.dim() else grad_scale.float())
    g = torch.where((labels == ignore_index).unsqueeze(1), 0.0, g)
    return g.to(logits.dtype)


def row_loss_and_grad_math(
    logits: Tensor, labels: Tensor, options: CeOptions, grad_scale: Tensor | None, compute_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Loss per row (fp32) and, if asked, the gradient times ``grad_scale``: one chunk of fused linear cross-entropy."""
    loss, lse = row_loss_and_lse_math(logits, labels, options)
    return loss, grad_from_lse_math(logits, labels, lse, options, grad_scale) if compute_grad else None


def launch_cross_entropy(
    launch: Launch,
    logits: Tensor,
    dlogits: Tensor | None,
    row_loss: Tensor,
    labels: Tensor,
    options: CeOptions,
    grad_scale: Tensor | None,
    lse: Tensor | None = None,
) -> None:
    """Row losses into ``row_loss``, the gradient into ``dlogits`` (``dlogits is logits``: in place;
    None: no gradient) and, if given, row log-sum-exps into ``lse``. ``grad_scale``: None, 0-dim,
    or one value per row."""
    _ignore_index, label_smoothing, _lse_square_scale, softcap = options
    n, v = logits.shape
    scale_stride = grad_scale.stride(0) if grad_scale is not None and grad_scale.dim() else 0
    common = {
        "HAS_GRAD_SCALE": grad_scale is not None,
        "HAS_SMOOTHING": label_smoothing > 0,
        "HAS_SOFTCAP": softcap > 0,
    }
    scalars = (v, *options)
    kernel = cross_entropy_fwd_inplace_kernel if dlogits is logits else cross_entropy_fwd_kernel
    launch(
        kernel, lambda meta: (n,),
        logits, dlogits, row_loss, lse, labels, grad_scale,
        logits.stride(0), 0 if dlogits is None else dlogits.stride(0), scale_stride, *scalars,
        COMPUTE_GRAD=dlogits is not None, STORE_LSE=lse is not None, **common,
    )  # fmt: skip


def launch_scale_rows(launch: Launch, x: Tensor, out: Tensor, scale: Tensor) -> None:
    """``out = x * scale`` in fp32: ``scale`` 0-dim, or one value per row of the 2-D ``x`` (unit column stride).

    A scalar scale over contiguous tensors treats them as one long row (no per-row waste
    on narrow rows).
    """
    if x.numel() == 0:
        return
    scale_stride = scale.stride(0) if scale.dim() else 0
    if scale.dim() == 0 and x.is_contiguous() and out.is_contiguous():
        x, out = x.view(1, -1), out.view(1, -1)
    rows, cols = x.shape
    launch(
        scale_rows_kernel, lambda meta: (rows * triton.cdiv(cols, SCALE_BLOCK),),
        x, out, scale, x.stride(0), out.stride(0), scale_stride, cols,
        BLOCK_V=SCALE_BLOCK, num_warps=4,
    )  # fmt: skip


# The backend's post-grad pass (inductor.donated_buffers) may point these outputs at donated inputs:
# each program reads an element of the input before it writes the same element of the output.
may_write_over_input(cross_entropy_bwd_kernel, ("LOGITS", "DLOGITS"))
may_write_over_input(scale_rows_kernel, ("X", "OUT"))  # fused linear cross-entropy's gradient scaling


# --- ops ------------------------------------------------------------------------------------------


def backward_grad_scale(grad_output: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """What multiplies each row's gradient: ``grad_output`` (0-dim, or per row for ``"none"``), over
    the non-ignored count for ``"mean"``; fp32."""
    _count, mean_scale = count_and_grad_scale(labels, ignore_index, reduction)
    scale = grad_output.float()
    return scale * mean_scale if mean_scale is not None else scale


def cross_entropy_fwd_math(
    logits: Tensor,
    labels: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
) -> tuple[Tensor, Tensor]:
    """Aten-only forward (CPU branch and the backend's decomposition), computed in fp32."""
    count = count_non_ignored(labels, ignore_index)
    row_loss, lse = row_loss_and_lse_math(logits, labels, (ignore_index, label_smoothing, lse_square_scale, softcap))
    return reduce_loss(row_loss, count, reduction), lse


def cross_entropy_fwd_kernels(launch: Launch, logits: Tensor, labels: Tensor, *options: Any) -> tuple[Tensor, Tensor]:
    """:func:`cross_entropy_fwd_math`'s arguments after ``launch``; row losses and log-sum-exps by the forward kernel."""
    *ce_options, reduction = options
    logits, labels = unit_last_stride(logits), labels.contiguous()
    count = count_non_ignored(labels, ce_options[0])
    row_loss = logits.new_empty(labels.shape, dtype=torch.float32)
    lse = logits.new_empty(labels.shape, dtype=torch.float32)
    launch_cross_entropy(launch, logits, None, row_loss, labels, tuple(ce_options), None, lse)
    return reduce_loss(row_loss, count, reduction), lse


def cross_entropy_bwd_math(
    grad_output: Tensor,
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
) -> Tensor:
    """Aten-only backward: the gradient of ``grad_output * loss`` from the logits and their row log-sum-exps."""
    scale = backward_grad_scale(grad_output, labels, ignore_index, reduction)
    return grad_from_lse_math(logits, labels, lse, (ignore_index, label_smoothing, lse_square_scale, softcap), scale)


def launch_cross_entropy_bwd(
    launch: Launch,
    grad_output: Tensor,
    logits: Tensor,
    dlogits: Tensor,
    labels: Tensor,
    lse: Tensor,
    options: tuple[int, float, float, float, str],
    restore_logits: bool = True,
) -> None:
    """The backward kernel writing into ``dlogits`` (``dlogits is logits``: in place). In place, its
    autotuner saves the logits before timing configs and restores them after; ``restore_logits=False``
    launches the functional op's autotuner instead, which does not (route timing, on random logits)."""
    ignore_index, label_smoothing, lse_square_scale, softcap, reduction = options
    n, v = logits.shape
    if n == 0:
        return
    scale = backward_grad_scale(grad_output, labels, ignore_index, reduction)
    kernel = cross_entropy_bwd_inplace_kernel if dlogits is logits and restore_logits else cross_entropy_bwd_kernel
    launch(
        kernel, lambda meta: (n, triton.cdiv(v, meta["BLOCK_V"])),
        logits, dlogits, lse, labels, scale,
        logits.stride(0), dlogits.stride(0), scale.stride(0) if scale.dim() else 0, v,
        ignore_index, label_smoothing, lse_square_scale, softcap,
        HAS_SMOOTHING=label_smoothing > 0, HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip


def cross_entropy_bwd_kernels(
    launch: Launch, grad_output: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, *options: Any
) -> Tensor:
    logits, labels = unit_last_stride(logits), labels.contiguous()
    dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    launch_cross_entropy_bwd(launch, grad_output, logits, dlogits, labels, lse, options)
    return dlogits


def _setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor]) -> None:
    logits, labels, *options = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, bwd: Any, dloss: Tensor | None, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    logits, labels, lse = ctx.saved_tensors
    grad = None if dloss is None else bwd(dloss, logits, labels, lse, *ctx.options)
    return grad, None, None, None, None, None, None


cross_entropy_family = define_op_family(
    "cross_entropy",
    fwd_math=cross_entropy_fwd_math,
    fwd_kernels=cross_entropy_fwd_kernels,
    bwd_math=cross_entropy_bwd_math,
    bwd_kernels=cross_entropy_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)


def loss_placement(reduction: str) -> Any:
    """The loss over token shards: per-row shards (``"none"``) or a partial sum (``"sum"``)."""
    from torch.distributed.tensor import Partial, Shard

    return Shard(0) if reduction == "none" else Partial()


@sharding_rule(cross_entropy_family.fwd)
def _cross_entropy_fwd_sharding(
    logits: Any, labels: Any, ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float,
    reduction: str,
) -> list[Strategy]:  # fmt: skip
    """Token rows sharded for ``reduction="none"`` and ``"sum"`` (the summed loss a partial sum).

    ``"mean"`` divides by the number of non-ignored labels of all ranks, which a local op cannot
    know: its only rule is all-replicated. No rule shards the vocabulary: a vocab-sharded softmax
    needs a cross-shard max and sum, which one op strategy cannot express; vocab-sharded logits are
    redistributed to a listed placement, and :mod:`inductor_ext.ops.vocab_parallel` computes the
    loss on them where they are, with explicit collectives (as ``loss_parallel`` does).
    """
    from torch.distributed.tensor import Shard

    inputs = (logits, labels)
    strategies = [replicated(2, inputs)]
    if reduction != "mean":
        strategies.append(([loss_placement(reduction), Shard(0)], shard_inputs(0, inputs, (True, True))))
    return strategies


@sharding_rule(cross_entropy_family.bwd)
def _cross_entropy_bwd_sharding(
    grad_output: Any, logits: Any, labels: Any, lse: Any, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float, reduction: str,
) -> list[Strategy]:  # fmt: skip
    """As the forward's: token rows sharded for ``"none"`` (a gradient per row) and ``"sum"`` (one
    replicated scale), ``"mean"`` all-replicated."""
    from torch.distributed.tensor import Shard

    inputs = (grad_output, logits, labels, lse)
    strategies = [replicated(1, inputs)]
    if reduction != "mean":
        strategies.append(([Shard(0)], shard_inputs(0, inputs, (reduction == "none", True, True, True))))
    return strategies


# --- in-place backward (inplace_backward=True) --------------------------------------------------


def cross_entropy_bwd_inplace_math(
    grad_output: Tensor,
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
) -> None:
    """Aten-only in-place backward: the gradient copied over ``logits``."""
    options = (ignore_index, label_smoothing, lse_square_scale, softcap, reduction)
    logits.copy_(cross_entropy_bwd_math(grad_output, logits, labels, lse, *options))


def cross_entropy_bwd_inplace_kernels(
    launch: Launch, grad_output: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, *options: Any
) -> None:
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy_bwd_inplace: logits must have unit stride along the classes")
    launch_cross_entropy_bwd(launch, grad_output, logits, logits, labels.contiguous(), lse, options)


_bwd_inplace = define_mutating_op(
    "cross_entropy_bwd_inplace", family="cross_entropy", math=cross_entropy_bwd_inplace_math,
    kernels=cross_entropy_bwd_inplace_kernels, mutates=("logits",),
)  # fmt: skip


def _timed_bwd_inplace_kernels(
    launch: Launch, grad_output: Tensor, logits: Tensor, labels: Tensor, lse: Tensor, *options: Any
) -> None:
    launch_cross_entropy_bwd(
        launch, grad_output, logits, logits, labels.contiguous(), lse, options, restore_logits=False
    )


IN_PLACE_TIMING[cross_entropy_family.bwd] = InPlaceTiming(_timed_bwd_inplace_kernels, cross_entropy_bwd_inplace_math)


class _CrossEntropyInplace(torch.autograd.Function):
    """Forward as the functional op; backward writes the gradient over the saved logits and returns them.

    A second backward through the same graph (``retain_graph=True``) raises autograd's
    "modified by an inplace operation" error instead of reading a gradient as logits.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, *options: Any) -> Tensor:
        loss, lse = cross_entropy_family(logits, labels, *options)
        ctx.save_for_backward(logits, labels, lse)
        ctx.options = options
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: Tensor) -> tuple[Tensor | None, ...]:
        logits, labels, lse = ctx.saved_tensors
        _bwd_inplace(dloss, logits, labels, lse, *ctx.options)
        return logits, None, None, None, None, None, None


# --- public API ----------------------------------------------------------------------------------


def check_loss_options(
    op: str, ignore_index: int, reduction: str, label_smoothing: float, lse_square_scale: float, softcap: float | None
) -> None:
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    check_real(op, "label_smoothing", label_smoothing)
    check_real(op, "lse_square_scale", lse_square_scale)
    if softcap is not None:
        check_real(op, "softcap", softcap)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not 0.0 <= lse_square_scale < float("inf"):
        raise ValueError(f"{op}: lse_square_scale must be finite and >= 0, got {lse_square_scale}")
    if softcap is not None and not 0.0 < softcap < float("inf"):
        raise ValueError(f"{op}: softcap must be None or a finite number > 0, got {softcap}")


def check_labels(op: str, labels: Any, expected_shape: torch.Size, device: torch.device, what: str) -> None:
    if not isinstance(labels, Tensor):
        raise TypeError(f"{op}: labels must be a Tensor, got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"{op}: labels must be int64 or int32, got {labels.dtype}")
    if labels.shape != expected_shape:
        raise ValueError(f"{op}: labels must have shape {tuple(expected_shape)} ({what}), got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(
            f"{op}: labels are on {labels.device} but the inputs are on {device}; both must be on one device"
        )


def check_labels_in_range(op: str, labels: Tensor, num_classes: int, ignore_index: int) -> None:
    """Labels outside ``[0, V)`` other than ignore_index raise ``ValueError``; checked in CPU eager only (the
    host reads the labels: on CUDA that would sync, and under tracing it would depend on data)."""
    if labels.device.type != "cpu" or torch.compiler.is_compiling():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= num_classes))
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{op}: labels must be in [0, {num_classes}) or equal ignore_index ({ignore_index}); "
            f"got {int(labels[position])} at position {position}"
        )


def _check_inputs(logits: Any, labels: Any, inplace_backward: bool) -> None:
    if not isinstance(logits, Tensor):
        raise TypeError(f"cross_entropy: logits must be a Tensor, got {type(logits).__name__}")
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"cross_entropy: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() == 0:
        raise ValueError("cross_entropy: logits must have at least 1 dimension (the classes), got a scalar")
    if logits.shape[-1] == 0:
        raise ValueError("cross_entropy: logits must have at least one class (last dimension), got 0")
    check_labels("cross_entropy", labels, logits.shape[:-1], logits.device, "logits' shape without the classes")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"cross_entropy: inplace_backward must be a bool, got {type(inplace_backward).__name__}")


def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    inplace_backward: bool = False,
) -> Tensor:
    """Cross-entropy over the last dimension of ``logits``, ``F.cross_entropy``'s semantics plus extras.

    Args:
        logits: ``(..., V)`` float32/bfloat16/float16 (classes last, as HF models
            produce them; copied if the last dim is not unit-stride).
        labels: ``(...)`` int64/int32 class indices, ``ignore_index`` to skip a row.
            On CPU (eager) a label outside ``[0, V)`` raises ``ValueError``; on CUDA
            it is not checked (that would sync): the row's loss is NaN.
        reduction: ``"mean"`` (over non-ignored rows; NaN if all are ignored, like
            PyTorch, with zero gradients), ``"sum"`` or ``"none"`` (shape of ``labels``).
        label_smoothing: as ``F.cross_entropy(label_smoothing=...)``.
        lse_square_scale: z-loss, adds ``lse_square_scale * logsumexp(z)**2`` per non-ignored row.
        softcap: ``z = softcap * tanh(logits / softcap)`` before the softmax (Gemma 2), or None.
        inplace_backward: let the backward write the gradient over ``logits`` (saves one
            logits-sized buffer; ``logits`` hold the gradient after ``backward()``). Ignored when
            ``logits`` is a leaf (an ``nn.Parameter``, a user's tensor with ``requires_grad``): its
            values must survive, as PyTorch refuses in-place writes to such leaves.

    Returns:
        The loss in float32 (whatever the logits' dtype), 0-dim unless ``reduction="none"``.
    """
    _check_inputs(logits, labels, inplace_backward)
    check_loss_options("cross_entropy", ignore_index, reduction, label_smoothing, lse_square_scale, softcap)
    num_classes = logits.shape[-1]
    logits2d = logits if logits.dim() == 2 else logits.reshape(-1, num_classes)
    labels1d = labels if labels.dim() == 1 else labels.reshape(-1)
    logits2d = unit_last_stride(logits2d)
    check_labels_in_range("cross_entropy", labels1d, num_classes, ignore_index)
    options = (*loss_options(ignore_index, label_smoothing, lse_square_scale, softcap), reduction)
    if inplace_backward and torch.is_grad_enabled() and logits.requires_grad and not logits.is_leaf:
        loss = _CrossEntropyInplace.apply(logits2d, labels1d, *options)
    else:
        loss, _lse = cross_entropy_family(logits2d, labels1d, *options)
    return loss.view(labels.shape) if reduction == "none" else loss


def cross_entropy_ref(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
) -> Tensor:
    """Plain PyTorch, HF's spelling (upcast to fp32, ``F.cross_entropy``); float64 inputs give the exact reference."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(compute)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    y = labels.reshape(-1)
    loss = torch.nn.functional.cross_entropy(
        z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = y != ignore_index
    if lse_square_scale:
        loss = loss + lse_square_scale * torch.where(valid, torch.logsumexp(z, dim=-1) ** 2, 0.0)
    if reduction == "none":
        return loss.view(labels.shape)
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


__all__ = ["cross_entropy", "cross_entropy_family", "cross_entropy_ref"]

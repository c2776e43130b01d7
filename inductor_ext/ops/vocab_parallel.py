"""Vocab-parallel losses: :func:`vocab_parallel_cross_entropy`, for logits sharded on the vocabulary
over a 1-D device mesh (what ``torch.distributed.tensor.parallel.loss_parallel`` does for
``F.cross_entropy``), and :func:`vocab_parallel_fused_linear_cross_entropy`, for an LM head whose
weight rows are sharded so, on the cross-entropy kernels.

Rank ``r`` holds the columns ``[o_r, o_r + V_r)`` of every row (DTensor's ``Shard`` layout: the
vocabulary split as ``torch.chunk`` splits it). Forward, for a row with label ``y``::

    lse_r = logsumexp(z[o_r : o_r + V_r])          the forward kernel on the local shard
    m     = max_r lse_r                             all-reduce (max) of N floats
    lse   = m + log(sum_r exp(lse_r - m))          all-reduce (sum) of 2 N floats, with
    z_y   = z[y] from the rank that holds y         (the other ranks add 0)
    loss  = lse - z_y + s * lse**2                  s = lse_square_scale (z-loss); 0 for ignored rows

``z = softcap * tanh(x / softcap)`` with a soft cap, ``x`` otherwise; it is elementwise, so each rank
caps its own columns. The backward makes no collective: each rank writes its columns of::

    dlogits = g * ((1 + 2 s lse) * exp(z - lse) - onehot(y))   (times 1 - tanh(x / softcap)**2 with a cap)

with the backward kernel, given the global ``lse`` and the label in local columns (a label another
rank holds matches no local column), ``g`` the row's loss gradient. Each rank reads its logits
twice and writes its gradient once, as the unsharded op does; the collectives carry ``3 N`` floats.

The fused linear version runs the chunk loop of :mod:`inductor_ext.ops.fused_linear_cross_entropy`
on the rank's weight rows ``W_r`` (``V_r x H``) with the loss above per chunk of rows, the gradient
written over the chunk's logits; ``dweight_r`` accumulates locally (no collective), and
``dhidden = sum_r dlogits_r @ W_r`` takes one all-reduce of ``N x H`` fp32 after the loop. Its
``(N, V)`` logits exist neither whole nor on one rank: each rank holds one chunk of its columns.
"""

from typing import Any, NamedTuple

import torch
from torch import Tensor

from inductor_ext.ops._layout import unit_last_stride
from inductor_ext.ops.cross_entropy import (
    SUPPORTED_DTYPES,
    CeOptions,
    capped_logits,
    check_labels,
    check_labels_in_range,
    check_loss_options,
    count_and_grad_scale,
    count_non_ignored,
    loss_options,
    reduce_loss,
)
from inductor_ext.ops.fused_linear_cross_entropy import (
    WEIGHT_GRAD_ACCUMULATIONS,
    ChunkLoss,
    chunked_loss_and_grads,
    resolve_chunk_size,
)

LOCAL_IGNORE_INDEX = -1
"""The local labels' ignore index: outside every rank's columns ``[0, V_r)``, so the caller's
``ignore_index`` (which may be a valid local column) cannot be mistaken for a class."""


class VocabShard(NamedTuple):
    """This rank's columns of the vocabulary: ``[offset, offset + V_r)`` of ``num_classes``."""

    offset: int
    num_classes: int
    mesh: Any
    """The 1-D device mesh the vocabulary is sharded over."""


def _global_row_loss(
    logits: Tensor, labels: Tensor, shard: VocabShard, options: CeOptions
) -> tuple[Tensor, Tensor, Tensor]:
    """(local labels, global lse, row losses) of one rank's ``(N, V_r)`` logits: the module's forward
    (``options``' label smoothing is 0)."""
    from torch.distributed import _functional_collectives as funcol

    ignore_index, _smoothing, lse_square_scale, softcap = options
    local_classes = logits.shape[1]
    ignored = labels == ignore_index
    held = (labels >= shard.offset) & (labels < shard.offset + local_classes) & ~ignored
    # a class another rank holds: local column V_r, which matches no column
    local_labels = torch.where(held, labels - shard.offset, local_classes)
    local_labels = torch.where(ignored, LOCAL_IGNORE_INDEX, local_labels)
    _, lse_local = torch.ops.fastops.cross_entropy_fwd(
        logits, local_labels, LOCAL_IGNORE_INDEX, 0.0, 0.0, softcap, "none"
    )
    z_y, _ = capped_logits(logits.gather(1, torch.where(held, local_labels, 0).long().unsqueeze(1)).squeeze(1), softcap)
    z_y = torch.where(held, z_y, 0.0)
    row_max = funcol.all_reduce(lse_local, "max", shard.mesh)
    sums = funcol.all_reduce(torch.stack([torch.exp(lse_local - row_max), z_y]), "sum", shard.mesh)
    lse = row_max + torch.log(sums[0])
    row_loss = lse - sums[1] + lse_square_scale * lse * lse
    in_range = (labels >= 0) & (labels < shard.num_classes)
    row_loss = torch.where(ignored, 0.0, torch.where(in_range, row_loss, float("nan")))
    return local_labels, lse, row_loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """On one rank's ``(N, V_r)`` logits and the ``(N,)`` labels of all ranks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        shard: VocabShard,
        options: CeOptions,
        reduction: str,
    ) -> Tensor:
        local_labels, lse, row_loss = _global_row_loss(logits, labels, shard, options)
        ctx.save_for_backward(logits, local_labels, lse)
        ctx.options = (options, reduction)
        return reduce_loss(row_loss, count_non_ignored(labels, options[0]), reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, local_labels, lse = ctx.saved_tensors
        (_ignore_index, _smoothing, lse_square_scale, softcap), reduction = ctx.options
        dlogits = torch.ops.fastops.cross_entropy_bwd(
            grad_output, logits, local_labels, lse, LOCAL_IGNORE_INDEX, 0.0, lse_square_scale, softcap, reduction
        )
        return dlogits, None, None, None, None


def _chunk_loss(shard: VocabShard) -> ChunkLoss:
    """The fused linear loop's per-chunk loss on one rank's columns: global row losses, and the
    gradient of the rank's columns written over the chunk's logits."""

    def chunk_loss(
        logits: Tensor, labels: Tensor, options: CeOptions, grad_scale: Tensor | None, compute_grad: bool
    ) -> tuple[Tensor, Tensor | None]:
        local_labels, lse, row_loss = _global_row_loss(logits, labels, shard, options)
        if not compute_grad:
            return row_loss, None
        # grad_scale: None ("sum") or the mean's 0-dim 1 / count; "sum" multiplies every row by it
        scale = logits.new_ones((), dtype=torch.float32) if grad_scale is None else grad_scale
        _ignore_index, _smoothing, lse_square_scale, softcap = options
        torch.ops.fastops.cross_entropy_bwd_inplace(
            scale, logits, local_labels, lse, LOCAL_IGNORE_INDEX, 0.0, lse_square_scale, softcap, "sum"
        )
        return row_loss, logits

    return chunk_loss


class _VocabParallelFusedLinearCrossEntropy(torch.autograd.Function):
    """On the ``(N, H)`` hidden states (the same on every rank), one rank's ``(V_r, H)`` weight rows
    and the ``(N,)`` labels; ``"mean"`` or ``"sum"``: the forward computes the gradients, the
    backward scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        shard: VocabShard,
        options: CeOptions,
        reduction: str,
        chunk_size: int,
        weight_grad_accumulation: str,
    ) -> Tensor:
        from torch.distributed import _functional_collectives as funcol

        count, grad_scale = count_and_grad_scale(labels, options[0], reduction)
        grads = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], False)
        row_loss, dhidden, dweight, _ = chunked_loss_and_grads(
            _chunk_loss(shard), hidden, weight, labels, None, options, chunk_size, weight_grad_accumulation,
            grad_scale, grads,
        )  # fmt: skip
        if grads[0]:  # each rank's columns' share, summed in fp32 and rounded once more
            dhidden = funcol.all_reduce(dhidden.float(), "sum", shard.mesh).to(hidden.dtype)
        ctx.save_for_backward(dhidden, dweight)
        return reduce_loss(row_loss, count, reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dhidden, dweight = ctx.saved_tensors
        scale = grad_output.float()
        dh = (dhidden * scale).to(dhidden.dtype) if ctx.needs_input_grad[0] else None
        dw = (dweight * scale).to(dweight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None, None, None


def _vocab_mesh(op: str, tensor: Any, dim: int, what: str) -> Any:
    """The 1-D mesh ``tensor`` (a DTensor) is sharded over on ``dim``; raises otherwise."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        raise TypeError(f"{op}: {what} must be a DTensor sharded on the vocabulary, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {what} must be float32, bfloat16 or float16, got {tensor.dtype}")
    if tensor.dim() < 2:
        raise ValueError(f"{op}: {what} must have at least 2 dims, got shape {tuple(tensor.shape)}")
    mesh, dim = tensor.device_mesh, dim % tensor.dim()
    if mesh.ndim != 1 or tensor.placements[0] not in (Shard(dim), Shard(dim - tensor.dim())):
        raise ValueError(
            f"{op}: {what} must be sharded on dim {dim} (the vocabulary) over a 1-D mesh (placements "
            f"(Shard({dim}),)), got a {mesh.ndim}-D mesh with placements {tensor.placements}"
        )
    return mesh


def _replicated_local(op: str, tensor: Any, mesh: Any, what: str) -> Any:
    """A Tensor as it is; a DTensor replicated on ``mesh`` as its local tensor; raises otherwise."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh or any(p != Replicate() for p in tensor.placements):
            raise ValueError(f"{op}: {what} must be a Tensor or a DTensor replicated on the vocabulary's mesh, "
                             f"got {tensor.placements}")  # fmt: skip
        return tensor.to_local()
    return tensor


def _vocab_shard(op: str, num_classes: int, mesh: Any, local_classes: int) -> VocabShard:
    """This rank's columns: DTensor's ``Shard`` splits the vocabulary as ``torch.chunk`` does."""
    ranks, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-num_classes // ranks)
    offset = min(rank * chunk, num_classes)
    if local_classes != min(chunk, num_classes - offset):
        raise ValueError(
            f"{op}: rank {rank} holds {local_classes} of {num_classes} classes; expected "
            f"{min(chunk, num_classes - offset)} (DTensor's even Shard split)"
        )
    return VocabShard(offset, num_classes, mesh)


def vocab_parallel_cross_entropy(
    logits: Any,
    labels: Any,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
) -> Any:
    """Cross-entropy of logits sharded on the vocabulary (tensor-parallel LM heads), without
    gathering them: ``F.cross_entropy``'s semantics, as :func:`inductor_ext.ops.cross_entropy`.

    Args:
        logits: a ``DTensor`` of shape ``(..., V)`` placed ``Shard(-1)`` on a 1-D device mesh
            (e.g. the output of a ``ColwiseParallel`` LM head with ``use_local_output=False``).
        labels: ``(...)`` int64/int32 class indices (a Tensor, the same on every rank, or a DTensor
            replicated on the mesh); ``ignore_index`` skips a row. On CPU (eager) a label outside
            ``[0, V)`` raises ``ValueError``; on CUDA it is not checked (that would sync): the row's loss is NaN.
        reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"``.
        lse_square_scale: z-loss, ``lse_square_scale * logsumexp(z)**2`` per non-ignored row.
        softcap: ``z = softcap * tanh(logits / softcap)`` before the softmax, or None.

    Label smoothing is not supported: its term needs each row's sum over every rank's columns.

    Returns:
        The float32 loss as a DTensor replicated on the mesh (0-dim, or ``labels``' shape for
        ``"none"``); its backward gives ``logits`` a gradient sharded as they are.
    """
    from torch.distributed.tensor import DTensor, Replicate

    op = "vocab_parallel_cross_entropy"
    mesh = _vocab_mesh(op, logits, -1, "logits")
    labels = _replicated_local(op, labels, mesh, "labels")
    local = logits.to_local()
    check_labels(op, labels, logits.shape[:-1], local.device, "logits' shape without the classes")
    check_loss_options(op, ignore_index, reduction, 0.0, lse_square_scale, softcap)
    num_classes = logits.shape[-1]
    shard = _vocab_shard(op, num_classes, mesh, local.shape[-1])
    check_labels_in_range(op, labels, num_classes, int(ignore_index))
    options = loss_options(ignore_index, 0.0, lse_square_scale, softcap)
    local2d = unit_last_stride(local.reshape(-1, local.shape[-1]))
    loss = _VocabParallelCrossEntropy.apply(local2d, labels.reshape(-1), shard, options, reduction)
    if reduction == "none":
        loss = loss.view(labels.shape)
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


def vocab_parallel_fused_linear_cross_entropy(
    hidden: Any,
    weight: Any,
    labels: Any,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    weight_grad_accumulation: str = "fp32",
) -> Any:
    """``cross_entropy(hidden @ weight.T, labels)`` for an LM head whose weight rows (the
    vocabulary) are sharded over a 1-D mesh, as :func:`inductor_ext.ops.fused_linear_cross_entropy`
    computes it: chunks of rows at a time, no rank ever holding more than one chunk of its columns.

    Args:
        hidden: ``(..., H)``, the same on every rank (a Tensor, or a DTensor replicated on the mesh).
        weight: a ``DTensor`` of shape ``(V, H)`` placed ``Shard(0)`` on a 1-D mesh (a
            ``ColwiseParallel`` LM head's weight), ``hidden``'s dtype.
        labels: ``(...)`` int64/int32 (a Tensor, or a DTensor replicated on the mesh).
        ignore_index, lse_square_scale, softcap: as :func:`vocab_parallel_cross_entropy`.
        reduction: ``"mean"`` or ``"sum"`` (``"none"`` would recompute every chunk in the backward,
            with its collectives: not supported).
        chunk_size: rows per chunk (default: as ``fused_linear_cross_entropy`` picks for the
            rank's ``V_r`` columns).
        weight_grad_accumulation: ``"fp32"`` or ``"weight_dtype"``, as ``fused_linear_cross_entropy``.

    Returns:
        The float32 loss as a DTensor replicated on the mesh; its backward gives ``weight`` a
        gradient sharded as it is and ``hidden`` the full gradient on every rank.
    """
    from torch.distributed.tensor import DTensor, Replicate

    op = "vocab_parallel_fused_linear_cross_entropy"
    mesh = _vocab_mesh(op, weight, 0, "weight")
    hidden = _replicated_local(op, hidden, mesh, "hidden")
    labels = _replicated_local(op, labels, mesh, "labels")
    local_weight = weight.to_local()
    if not isinstance(hidden, Tensor) or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden must be a (..., {weight.shape[1]}) Tensor to match weight's hidden size, "
                         f"got {getattr(hidden, 'shape', type(hidden).__name__)}")  # fmt: skip
    if hidden.dtype != weight.dtype or hidden.device != local_weight.device:
        raise TypeError(f"{op}: hidden must have weight's dtype and device ({weight.dtype}, {local_weight.device}), "
                        f"got {hidden.dtype}, {hidden.device}")  # fmt: skip
    check_labels(op, labels, hidden.shape[:-1], hidden.device, "hidden's shape without the hidden size")
    check_loss_options(op, ignore_index, reduction, 0.0, lse_square_scale, softcap)
    if reduction == "none":
        raise ValueError(f"{op}: reduction must be 'mean' or 'sum' ('none' is not supported), got 'none'")
    if weight_grad_accumulation not in WEIGHT_GRAD_ACCUMULATIONS:
        raise ValueError(f"{op}: weight_grad_accumulation must be one of {WEIGHT_GRAD_ACCUMULATIONS}, "
                         f"got {weight_grad_accumulation!r}")  # fmt: skip
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(f"{op}: chunk_size must be None or a positive int, got {chunk_size!r}")
    num_classes, hidden_size = weight.shape
    shard = _vocab_shard(op, num_classes, mesh, local_weight.shape[0])
    check_labels_in_range(op, labels, num_classes, int(ignore_index))
    chunk = resolve_chunk_size(
        local_weight.shape[0], hidden_size, hidden.element_size(), chunk_size, None, weight_grad_accumulation
    )
    options = loss_options(ignore_index, 0.0, lse_square_scale, softcap)
    loss = _VocabParallelFusedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden_size), local_weight, labels.reshape(-1), shard, options, reduction, chunk,
        weight_grad_accumulation,
    )  # fmt: skip
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_fused_linear_cross_entropy"]

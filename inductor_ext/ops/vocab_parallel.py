"""Vocab-parallel cross-entropy: :func:`vocab_parallel_cross_entropy`, for logits sharded on the
vocabulary over a 1-D device mesh (what ``torch.distributed.tensor.parallel.loss_parallel`` does
for ``F.cross_entropy``), on the cross-entropy kernels.

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
"""

from typing import Any

import torch
from torch import Tensor

from inductor_ext.ops.cross_entropy import (
    LABEL_DTYPES,
    SUPPORTED_DTYPES,
    check_labels_in_range,
    check_loss_options,
    reduce_loss,
)

LOCAL_IGNORE_INDEX = -1
"""The local labels' ignore index: outside every rank's columns ``[0, V_r)``, so the caller's
``ignore_index`` (which may be a valid local column) cannot be mistaken for a class."""


def _capped_fp32(x: Tensor, softcap: float) -> Tensor:
    x = x.float()
    return softcap * torch.tanh(x / softcap) if softcap > 0 else x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """On one rank's ``(N, V_r)`` logits (columns from ``offset``) and the ``(N,)`` labels of all ranks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        offset: int,
        num_classes: int,
        mesh: Any,
        ignore_index: int,
        reduction: str,
        lse_square_scale: float,
        softcap: float,
    ) -> Tensor:
        from torch.distributed import _functional_collectives as funcol

        local_classes = logits.shape[1]
        ignored = labels == ignore_index
        held = (labels >= offset) & (labels < offset + local_classes) & ~ignored
        # a class another rank holds: local column V_r, which matches no column
        local_labels = torch.where(held, labels - offset, local_classes)
        local_labels = torch.where(ignored, LOCAL_IGNORE_INDEX, local_labels)
        _, lse_local = torch.ops.fastops.cross_entropy_fwd(
            logits, local_labels, LOCAL_IGNORE_INDEX, 0.0, 0.0, softcap, "none"
        )
        z_y = _capped_fp32(logits.gather(1, torch.where(held, local_labels, 0).long().unsqueeze(1)).squeeze(1), softcap)
        z_y = torch.where(held, z_y, 0.0)
        row_max = funcol.all_reduce(lse_local, "max", mesh)
        sums = funcol.all_reduce(torch.stack([torch.exp(lse_local - row_max), z_y]), "sum", mesh)
        lse = row_max + torch.log(sums[0])
        row_loss = lse - sums[1] + lse_square_scale * lse * lse
        in_range = (labels >= 0) & (labels < num_classes)
        row_loss = torch.where(ignored, 0.0, torch.where(in_range, row_loss, float("nan")))
        ctx.save_for_backward(logits, local_labels, lse)
        ctx.options = (lse_square_scale, softcap, reduction)
        return reduce_loss(row_loss, (~ignored).sum(), reduction)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, local_labels, lse = ctx.saved_tensors
        lse_square_scale, softcap, reduction = ctx.options
        dlogits = torch.ops.fastops.cross_entropy_bwd(
            grad_output, logits, local_labels, lse, LOCAL_IGNORE_INDEX, 0.0, lse_square_scale, softcap, reduction
        )
        return dlogits, None, None, None, None, None, None, None, None


def _check_inputs(logits: Any, labels: Any) -> tuple[Any, Tensor]:
    """The mesh and the local labels; raises on what the vocab-parallel loss does not take."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    op = "vocab_parallel_cross_entropy"
    if not isinstance(logits, DTensor):
        raise TypeError(
            f"{op}: logits must be a DTensor sharded on its last (vocabulary) dim, got {type(logits).__name__}"
        )
    if logits.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"{op}: logits must be (..., V) with at least one row dim, got shape {tuple(logits.shape)}")
    mesh = logits.device_mesh
    if mesh.ndim != 1 or logits.placements[0] not in (Shard(logits.dim() - 1), Shard(-1)):
        raise ValueError(
            f"{op}: logits must be sharded on their last dim over a 1-D mesh (placements (Shard({logits.dim() - 1}),)), "
            f"got a {mesh.ndim}-D mesh with placements {logits.placements}"
        )
    if isinstance(labels, DTensor):
        if labels.device_mesh != mesh or any(p != Replicate() for p in labels.placements):
            raise ValueError(
                f"{op}: labels must be a Tensor or a DTensor replicated on logits' mesh, got {labels.placements}"
            )
        labels = labels.to_local()
    if not isinstance(labels, Tensor):
        raise TypeError(f"{op}: labels must be a Tensor, got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"{op}: labels must be int64 or int32, got {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"{op}: labels must have logits' shape without the classes {tuple(logits.shape[:-1])}, "
                         f"got {tuple(labels.shape)}")  # fmt: skip
    if labels.device != logits.to_local().device:
        raise ValueError(f"{op}: labels must be on logits' device {logits.to_local().device}, got {labels.device}")
    return mesh, labels


def _column_offset(num_classes: int, mesh: Any, local_classes: int) -> int:
    """This rank's first column: DTensor's ``Shard`` splits the vocabulary as ``torch.chunk`` does."""
    ranks, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-num_classes // ranks)
    offset = min(rank * chunk, num_classes)
    if local_classes != min(chunk, num_classes - offset):
        raise ValueError(
            f"vocab_parallel_cross_entropy: rank {rank} holds {local_classes} of {num_classes} classes; expected "
            f"{min(chunk, num_classes - offset)} (DTensor's even Shard split)"
        )
    return offset


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

    mesh, labels = _check_inputs(logits, labels)
    check_loss_options("vocab_parallel_cross_entropy", ignore_index, reduction, 0.0, lse_square_scale, softcap)
    num_classes = logits.shape[-1]
    local = logits.to_local()
    offset = _column_offset(num_classes, mesh, local.shape[-1])
    if local.device.type == "cpu" and not torch.compiler.is_compiling():
        check_labels_in_range("vocab_parallel_cross_entropy", labels, num_classes, int(ignore_index))
    local2d = local.reshape(-1, local.shape[-1])
    if local2d.stride(-1) != 1:
        local2d = local2d.contiguous()
    loss = _VocabParallelCrossEntropy.apply(
        local2d, labels.reshape(-1), offset, num_classes, mesh, int(ignore_index), reduction,
        float(lse_square_scale), float(softcap or 0.0),
    )  # fmt: skip
    if reduction == "none":
        loss = loss.view(labels.shape)
    return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)


__all__ = ["vocab_parallel_cross_entropy"]

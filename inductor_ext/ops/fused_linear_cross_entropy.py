"""Fused linear cross-entropy: ``torch.ops.fastops.fused_linear_cross_entropy_*`` and
:func:`fused_linear_cross_entropy`.

Schemas::

    fastops::fused_linear_cross_entropy_fwd(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias,
        int ignore_index, float label_smoothing, float lse_square_scale, float softcap, str reduction,
        int chunk_size, str weight_grad_accumulation, bool grad_hidden, bool grad_weight, bool grad_bias)
        -> (Tensor loss, Tensor dhidden, Tensor dweight, Tensor dbias)
    fastops::fused_linear_cross_entropy_bwd(Tensor grad_output, Tensor hidden, Tensor weight, Tensor labels,
        Tensor? bias, Tensor dhidden, Tensor dweight, Tensor dbias, int ignore_index, float label_smoothing,
        float lse_square_scale, float softcap, str reduction, int chunk_size, str weight_grad_accumulation,
        bool grad_hidden, bool grad_weight, bool grad_bias) -> (Tensor dhidden, Tensor dweight, Tensor dbias)
    fastops::accumulate_matmul_(Tensor(a!) acc, Tensor a, Tensor b) -> ()

``loss = cross_entropy(hidden @ weight.T + bias, labels)`` without ever holding the
``(N, V)`` logits: the rows are taken ``chunk_size`` at a time. For each chunk::

    logits = hidden_c @ weight.T (+ bias)        cuBLAS, in the inputs' dtype  (C, V)
    loss_c, logits <- dlogits                   the cross-entropy kernel, gradient written in place
    dhidden_c = dlogits @ weight                 one reduction over V in fp32, rounded once
    dweight  += dlogits.T @ hidden_c             in place (accumulate_matmul_), as weight_grad_accumulation says
    dbias    += dlogits.sum(0)                   fp32, rounded to the bias' dtype after the last chunk

``weight_grad_accumulation`` picks where ``dweight`` accumulates (:data:`WEIGHT_GRAD_ACCUMULATIONS`):

* ``"fp32"`` (the default, exact): in an fp32 ``(V, H)`` buffer, rounded to the weight's dtype
  once, after the last chunk: no chunk's contribution is rounded to 16 bits on its own (with a
  single chunk, the one matmul is rounded once).
* ``"weight_dtype"`` (lower memory): in a buffer of the weight's dtype, which is the gradient
  returned. Each chunk computes ``dweight + dlogits.T @ hidden_c`` in fp32 and rounds it once
  (``addmm_``, the sum added in the GEMM's epilogue), so the running sum is rounded once per
  chunk and the error grows like ``sqrt(num_chunks) * eps * |dweight|``: Liger-Kernel's numerics
  (it ``addmm``'s each chunk into a 16-bit ``grad_weight``). For float32 weights both modes are one.

The mean's token count stays on the device.

Memory beside the inputs, eager and compiled, for ``C`` rows per chunk and 16-bit inputs
(``dhidden`` is ``N H`` elements, the input gradient itself, in both):

* ``"fp32"``: the fp32 accumulator (``4 V H`` bytes) plus the larger of one chunk of logits
  (``C V`` elements, during the loop) and the rounded ``dweight`` (``V H``, after it: the last
  chunk's logits are freed first), plus ``dhidden``. The default chunk (``C = H``) makes the two
  equal: ``6 V H`` bytes, 2.9 GiB at ``V = 128256, H = 4096``.
* ``"weight_dtype"``: ``dweight`` (``V H`` elements, the weight's gradient itself) plus
  ``dhidden`` plus the larger of one chunk of logits (``C V``, during the loop) and ``dhidden``'s
  chunks (``N H``, while they are concatenated): ``V H + N H + max(C V, N H)``. The default chunk
  is ``C = H / 4`` rows (rounded down to a multiple of :data:`MATMUL_ROW_ALIGN`), so the logits
  take at most a quarter of ``dweight``: ``2.5 V H`` bytes plus ``dhidden``, 1.22 GiB at
  ``V = 128256, H = 4096`` (+ 0.06 GiB of ``dhidden`` at N = 8192), of which ``2 V H``
  (0.98 GiB) is the gradient a training step holds anyway.

The backward (``"mean"``/``"sum"``) scales the saved gradients by ``grad_output``. Plain eager
with a graph that is not retained scales them in place (adding nothing to the above). Retained
graphs write new tensors beside them (one more ``V H + N H``); so do traced (compiled, exported)
ones, unless the compiled backward owns its saved inputs (AOTAutograd donates them): under
``fastops_inductor`` the scaling then writes over them, Inductor's own kernel on the math route and
ours by the backend's donated-buffer pass (``inductor/donated_buffers.py``) on the kernel route.

For ``reduction="mean"``/``"sum"`` the forward computes the gradients (of the loss,
for ``grad_output = 1``) and the backward scales them by ``grad_output``. With
``reduction="none"`` each row has its own ``grad_output``, so ``dweight`` is not a
multiple of anything the forward could precompute: the forward computes the
losses only, and the backward recomputes the logits chunk by chunk (one more
matmul) with each row's gradient scaled by its ``grad_output``. Unused gradients
(``grad_* = False``) are not computed and come back as ``(0,)`` tensors.

Under ``torch.compile`` the chunk loop is traced (unrolled); with a dynamic token
count the graph is specialised on the number of chunks only (one graph serves every
count from ``(k - 1) * chunk_size + 1`` to ``k * chunk_size``). The accumulation stays a
call of ``accumulate_matmul_``, which Inductor reinplaces: a traced ``acc + dlogits.T @
hidden_c`` would write each chunk's sum into a second fp32 ``(V, H)`` buffer.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from inductor_ext.library.launch import DirectLaunch, Launch, kernels_run_on
from inductor_ext.library.registration import backward_may_overwrite_saved, define_op_family, define_opaque_mutating_op
from inductor_ext.library.sharding import Placements, Strategy, replicated, shard_inputs, sharding_rule
from inductor_ext.ops.cross_entropy import (
    SUPPORTED_DTYPES,
    CeOptions,
    check_labels,
    check_labels_in_range,
    check_loss_options,
    count_and_grad_scale,
    cross_entropy_ref,
    launch_cross_entropy,
    launch_scale_rows,
    loss_options,
    loss_placement,
    reduce_loss,
    row_loss_and_grad_math,
)

ChunkLoss = Callable[[Tensor, Tensor, CeOptions, Tensor | None, bool], tuple[Tensor, Tensor | None]]
"""(chunk logits, chunk labels, options, grad scale, compute_grad) -> (row losses fp32, dlogits or None).
May overwrite the chunk logits (a buffer of its own) with the gradient."""

MATMUL_ROW_ALIGN = 128
"""Automatic chunk sizes are rounded down to a multiple of this (whole GEMM tiles)."""

WeightGradAccumulation = Literal["fp32", "weight_dtype"]
WEIGHT_GRAD_ACCUMULATIONS: tuple[str, ...] = get_args(WeightGradAccumulation)
"""Values of ``weight_grad_accumulation``: ``"fp32"`` (exact: an fp32 accumulator, rounded once) and
``"weight_dtype"`` (lower memory: accumulates in the gradient itself, rounded once per chunk)."""

LOW_MEMORY_CHUNK_FRACTION = 4
"""``"weight_dtype"``'s default chunk logits take at most ``1 / LOW_MEMORY_CHUNK_FRACTION`` of the
weight's bytes (``C = H / 4`` rows), so ``dweight`` (the gradient, kept anyway) dominates the
memory the op adds; ``"fp32"``'s default is the weight's size (``C = H``), which its fp32
accumulator (twice the weight) dwarfs anyway."""


def _kernel_chunk_loss(launch: Launch) -> ChunkLoss:
    def chunk_loss(
        logits: Tensor, labels: Tensor, options: CeOptions, grad_scale: Tensor | None, compute_grad: bool
    ) -> tuple[Tensor, Tensor | None]:
        row_loss = logits.new_empty(labels.shape, dtype=torch.float32)
        dlogits = logits if compute_grad else None
        launch_cross_entropy(launch, logits, dlogits, row_loss, labels, options, grad_scale)
        return row_loss, dlogits

    return chunk_loss


def _input_grad(dlogits: Tensor, weight: Tensor) -> Tensor:
    """``dlogits @ weight`` rounded once: 16-bit CUDA inputs get an fp32 cuBLAS output, so no partial
    sum over V is rounded to 16 bits (torch lets cuBLAS reduce split-K partials in fp16/bf16 by
    default, and a chunk of few rows over a long V is where it splits K)."""
    if dlogits.is_cuda and dlogits.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(dlogits, weight, out_dtype=torch.float32).to(dlogits.dtype)
    return dlogits @ weight


def _gemm_with_fp32_output(a: Tensor) -> bool:
    """Whether ``a @ b`` runs on cuBLAS in 16 bits with an fp32 output; else the GEMM takes fp32 operands
    (CPU has no 16-bit GEMM with an fp32 output; fp32 inputs need none)."""
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)


_addmm_fp32_out_works: bool | None = None
"""Whether ``addmm(fp32 acc, bf16, bf16, out_dtype=fp32, out=acc)`` is accepted: torch 2.8-2.9 required
``acc`` in the inputs' dtype (relaxed by pytorch/pytorch#167931); known after the first call."""


def _accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b``, the product in fp32 and the sum rounded once to ``acc``'s dtype.

    ``acc`` in ``a``'s dtype (``"weight_dtype"``): ``acc.addmm_(a, b)``, which cuBLAS (and CPU
    aten) computes in fp32 with ``acc`` added in the epilogue, rounding the new sum once.
    ``acc`` in fp32 (``"fp32"``), the product never rounded to 16 bits: for 16-bit CUDA inputs
    cuBLAS adds into ``acc`` in the GEMM epilogue (``beta=1``); where torch refuses an fp32 ``out``
    for 16-bit inputs (see :data:`_addmm_fp32_out_works`), a separate fp32 product is added (one
    more ``acc``-sized buffer). Otherwise fp32 products.
    """
    global _addmm_fp32_out_works
    if acc.dtype not in (torch.float32, a.dtype):
        raise TypeError(f"fastops::accumulate_matmul_: acc must be float32 or a's dtype ({a.dtype}), got {acc.dtype}")
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    if not _gemm_with_fp32_output(a):
        acc.addmm_(a.float(), b.float())
        return
    if _addmm_fp32_out_works is not False:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _addmm_fp32_out_works = True
            return
        except RuntimeError as error:  # older torch: "self and mat2 must have the same dtype"
            if "dtype" not in str(error):
                raise
            _addmm_fp32_out_works = False
    acc.add_(torch.mm(a, b, out_dtype=torch.float32))


accumulate_matmul_ = define_opaque_mutating_op("accumulate_matmul_", _accumulate_matmul, mutates=("acc",))
"""``fastops::accumulate_matmul_(Tensor(a!) acc, Tensor a, Tensor b) -> ()``: :func:`_accumulate_matmul`.

Opaque to the compiler (a traced ``acc + a @ b`` writes a new fp32 buffer beside ``acc``); Inductor
reinplaces it in the chunk loop, where nothing else reads the old ``acc``: one ``(V, H)`` fp32 buffer
for all chunks. Plain eager calls the function directly (no dispatcher)."""


def _accumulate_weight_grad(acc: Tensor | None, dlogits: Tensor, hidden: Tensor, in_fp32: bool) -> Tensor:
    """``acc + dlogits.T @ hidden``, in fp32 (``in_fp32``) or else in the inputs' dtype: the first
    chunk's product (``acc`` None) is the accumulator, later chunks add into it in place."""
    a, b = dlogits.t(), hidden
    if acc is None:
        if not in_fp32:
            return a @ b  # the GEMM accumulates in fp32 and rounds once
        return torch.mm(a, b, out_dtype=torch.float32) if _gemm_with_fp32_output(a) else a.float() @ b.float()
    accumulate_matmul_(acc, a, b)
    return acc


def chunked_loss_and_grads(
    chunk_loss: ChunkLoss,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    options: CeOptions,
    chunk_size: int,
    weight_grad_accumulation: str,
    grad_scale: Tensor | None,
    grads: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row losses (fp32) and the requested gradients ((0,) tensors for the others), ``chunk_size`` rows at a time,
    ``dweight`` accumulated as ``weight_grad_accumulation`` says.

    ``grad_scale`` multiplies each row's gradient: None, 0-dim, or ``(N,)``.
    """
    if weight_grad_accumulation not in WEIGHT_GRAD_ACCUMULATIONS:  # direct op calls
        raise ValueError(
            f"fastops::fused_linear_cross_entropy: weight_grad_accumulation must be one of "
            f"{WEIGHT_GRAD_ACCUMULATIONS}, got {weight_grad_accumulation!r}"
        )
    dw_in_fp32 = weight_grad_accumulation == "fp32"
    n = hidden.shape[0]
    need_dx, need_dw, need_db = grads
    labels = labels.contiguous()
    row_losses: list[Tensor] = []
    dx_chunks: list[Tensor] = []
    dw_acc: Tensor | None = None
    db_acc: Tensor | None = None

    def chunk_step(h_c: Tensor, labels_c: Tensor, scale_c: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One chunk's row losses and ``dhidden`` rows (None unless requested), its ``dweight`` and
        ``dbias`` added to the accumulators. A function of its own so that the chunk's ``(C, V)``
        logits are freed on return: the last chunk's are never alive beside the accumulator and the
        rounded ``dweight``."""
        nonlocal dw_acc, db_acc
        logits = h_c @ weight.t() if bias is None else torch.addmm(bias, h_c, weight.t())
        loss, dlogits = chunk_loss(logits, labels_c, options, scale_c, any(grads))
        if dlogits is None:
            return loss, None
        dx_c = _input_grad(dlogits, weight) if need_dx else None
        if need_dw:
            dw_acc = _accumulate_weight_grad(dw_acc, dlogits, h_c, dw_in_fp32)
        if need_db:
            db_c = dlogits.sum(0, dtype=torch.float32)
            db_acc = db_c if db_acc is None else db_acc + db_c
        return loss, dx_c

    # int() of a symbolic row count guards only the number of chunks (a range of counts), and
    # the last chunk ends at n whatever n is within that range
    num_chunks = int((n + chunk_size - 1) // chunk_size)
    for k in range(num_chunks):
        start = k * chunk_size
        end = n if k == num_chunks - 1 else start + chunk_size
        scale_c = grad_scale if grad_scale is None or grad_scale.dim() == 0 else grad_scale[start:end]
        loss_c, dx_c = chunk_step(hidden[start:end], labels[start:end], scale_c)
        row_losses.append(loss_c)
        if dx_c is not None:
            dx_chunks.append(dx_c)
    if not row_losses:  # no rows
        row_losses.append(hidden.new_empty((0,), dtype=torch.float32))
        dx_chunks.append(hidden.new_empty(hidden.shape))
    row_loss = row_losses[0] if len(row_losses) == 1 else torch.cat(row_losses)
    # distinct tensors for the gradients not computed: op outputs must not alias each other
    dw = weight.new_empty((0,))
    if need_dw:
        dw = weight.new_zeros(weight.shape) if dw_acc is None else dw_acc.to(weight.dtype)  # "weight_dtype": itself
    # eager: frees the fp32 accumulator before dhidden's concatenation allocates (rebound, not
    # deleted: Dynamo, tracing the vocab-parallel loss's loop, has no `del` of a closure cell)
    dw_acc = None
    dx = hidden.new_empty((0,))
    if need_dx:
        dx = dx_chunks[0] if len(dx_chunks) == 1 else torch.cat(dx_chunks)
    db = hidden.new_empty((0,))
    if need_db and bias is not None:
        db = bias.new_zeros(bias.shape) if db_acc is None else db_acc.to(bias.dtype)
    return row_loss, dx, dw, db


def _split_options(rest: Sequence[Any]) -> tuple[CeOptions, str, int, str, tuple[bool, bool, bool]]:
    """The op arguments after the tensors, ``(ignore_index, label_smoothing, lse_square_scale, softcap,
    reduction, chunk_size, weight_grad_accumulation, grad_hidden, grad_weight, grad_bias)``, as
    (options, reduction, chunk_size, weight_grad_accumulation, grads)."""
    ignore_index, label_smoothing, lse_square_scale, softcap, reduction, chunk_size, accumulation, *grads = rest
    options = (ignore_index, label_smoothing, lse_square_scale, softcap)
    grad_h, grad_w, grad_b = grads
    return options, reduction, chunk_size, accumulation, (grad_h, grad_w, grad_b)


def _forward(chunk_loss: ChunkLoss, args: tuple[Any, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward on ``fused_linear_cross_entropy_fwd``'s arguments, each chunk's cross-entropy by ``chunk_loss``."""
    hidden, weight, labels, bias, *rest = args
    options, reduction, chunk_size, accumulation, grads = _split_options(rest)
    count, grad_scale = count_and_grad_scale(labels, options[0], reduction)
    if reduction == "none":  # gradients come from the backward, which knows each row's grad_output
        grads = (False, False, False)
    row_loss, dx, dw, db = chunked_loss_and_grads(
        chunk_loss, hidden, weight, labels, bias, options, chunk_size, accumulation, grad_scale, grads
    )
    return reduce_loss(row_loss, count, reduction), dx, dw, db


def fused_linear_cross_entropy_fwd_math(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    chunk_size: int,
    weight_grad_accumulation: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Aten-only forward (CPU branch and decomposition): the same chunk loop, cross-entropy in aten ops."""
    args = (hidden, weight, labels, bias, ignore_index, label_smoothing, lse_square_scale, softcap, reduction,
            chunk_size, weight_grad_accumulation, grad_hidden, grad_weight, grad_bias)  # fmt: skip
    return _forward(row_loss_and_grad_math, args)


def fused_linear_cross_entropy_fwd_kernels(launch: Launch, *args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`fused_linear_cross_entropy_fwd_math`'s arguments after ``launch``; cross-entropy in the kernels."""
    return _forward(_kernel_chunk_loss(launch), args)


def _backward_impl(
    scale: Callable[[Tensor, Tensor], Tensor], chunk_loss: ChunkLoss, args: tuple[Any, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward on ``fused_linear_cross_entropy_bwd``'s arguments: the forward's gradients times
    ``grad_output`` by ``scale``, or (``"none"``) recomputed with each chunk's cross-entropy by ``chunk_loss``."""
    grad_output, hidden, weight, labels, bias, dhidden, dweight, dbias, *rest = args
    options, reduction, chunk_size, accumulation, grads = _split_options(rest)
    if reduction == "none":
        _loss, dx, dw, db = chunked_loss_and_grads(
            chunk_loss, hidden, weight, labels, bias, options, chunk_size, accumulation, grad_output, grads
        )
        return dx, dw, db
    return scale(dhidden, grad_output), scale(dweight, grad_output), scale(dbias, grad_output)


def _scale_math(t: Tensor, grad_output: Tensor) -> Tensor:
    return (t.float() * grad_output.float()).to(t.dtype)


def fused_linear_cross_entropy_bwd_math(
    grad_output: Tensor,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    dhidden: Tensor,
    dweight: Tensor,
    dbias: Tensor,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float,
    reduction: str,
    chunk_size: int,
    weight_grad_accumulation: str,
    grad_hidden: bool,
    grad_weight: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Aten-only backward: scale the forward's gradients by ``grad_output``, or recompute them (``"none"``)."""
    args = (grad_output, hidden, weight, labels, bias, dhidden, dweight, dbias, ignore_index, label_smoothing,
            lse_square_scale, softcap, reduction, chunk_size, weight_grad_accumulation, grad_hidden, grad_weight,
            grad_bias)  # fmt: skip
    return _backward_impl(_scale_math, row_loss_and_grad_math, args)


def fused_linear_cross_entropy_bwd_kernels(launch: Launch, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`fused_linear_cross_entropy_bwd_math`'s arguments after ``launch``; scaling and recomputation in the
    kernels."""

    def scale(t: Tensor, g: Tensor) -> Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        launch_scale_rows(launch, t.reshape(1, -1), out.view(1, -1), g)
        return out

    return _backward_impl(scale, _kernel_chunk_loss(launch), args)


def _setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    hidden, weight, labels, bias, *options = inputs
    reduction = options[4]
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, labels, bias)
    else:
        ctx.save_for_backward(*output[1:])
    ctx.options = tuple(options)
    ctx.mark_non_differentiable(*output[1:])


def _scale_in_place(t: Tensor, grad_output: Tensor) -> Tensor:
    """``t *= grad_output`` (0-dim) in fp32, rounded once, as the backward op's scaling; returns ``t``."""
    if t.numel() == 0:
        return t
    if kernels_run_on(t.device):
        launch_scale_rows(DirectLaunch(), t.view(1, -1), t.view(1, -1), grad_output)
    else:
        t.mul_(grad_output)  # a 0-dim fp32 factor: computed in fp32 (no rounding of grad_output to 16 bits)
    return t


def _backward(ctx: Any, bwd: Any, dloss: Tensor | None, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    """Input gradients from the forward's (scaled by ``dloss``) or recomputed (``"none"``).

    Plain eager (``bwd`` is the direct twin of the backward op) with a graph that is not retained
    scales the saved gradients in place and returns them: they are freed after this backward
    anyway, and a scaled copy would hold a second ``dweight`` (``V H``) and ``dhidden`` beside
    them, which is the peak of ``weight_grad_accumulation="weight_dtype"``. Traced (the registered
    op, functional) or retained graphs get the copy.
    """
    no_grads: tuple[Tensor | None, ...] = (None,) * 14
    if dloss is None:
        return no_grads
    options = ctx.options
    reduction, grads = options[4], options[7:]
    empty = dloss.new_empty((0,))
    if reduction == "none":
        hidden, weight, labels, bias = ctx.saved_tensors
        dx, dw, db = bwd(dloss, hidden, weight, labels, bias, empty, empty, empty, *options)
    elif backward_may_overwrite_saved(bwd):
        dx, dw, db = (_scale_in_place(t, dloss) for t in ctx.saved_tensors)
    else:
        dx, dw, db = bwd(dloss, empty, empty, empty, None, *ctx.saved_tensors, *options)
    picked = [g if needed else None for g, needed in zip((dx, dw, db), grads)]
    return (picked[0], picked[1], None, picked[2], *no_grads[4:])


fused_linear_cross_entropy_family = define_op_family(
    "fused_linear_cross_entropy",
    fwd_math=fused_linear_cross_entropy_fwd_math,
    fwd_kernels=fused_linear_cross_entropy_fwd_kernels,
    bwd_math=fused_linear_cross_entropy_bwd_math,
    bwd_kernels=fused_linear_cross_entropy_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)


def _grad_placements(bias: Any, grads: Sequence[bool]) -> Placements:
    """(dhidden, dweight, dbias) over token shards: dhidden sharded, dweight and dbias partial sums;
    the ``(0,)`` tensors of gradients not computed replicated."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    grad_h, grad_w, grad_b = grads
    return [
        Shard(0) if grad_h else Replicate(),
        Partial() if grad_w else Replicate(),
        Partial() if grad_b and bias is not None else Replicate(),
    ]


@sharding_rule(fused_linear_cross_entropy_family.fwd)
def _fused_linear_cross_entropy_fwd_sharding(
    hidden: Any, weight: Any, labels: Any, bias: Any, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float, reduction: str, chunk_size: int, weight_grad_accumulation: str,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> list[Strategy]:  # fmt: skip
    """Token rows of hidden and labels sharded, weight and bias replicated, for ``reduction="none"``
    and ``"sum"`` (the summed loss a partial sum). The forward computes the gradients for ``"sum"``
    (scaled in the backward; weight and bias gradients partial sums), nothing for ``"none"``.

    ``"mean"`` is all-replicated only, and no rule shards the vocabulary (the weight's rows), for the
    reasons cross-entropy's rule gives; :mod:`inductor_ext.ops.vocab_parallel` computes the loss on a
    vocab-sharded weight with explicit collectives.
    """
    from torch.distributed.tensor import Replicate

    inputs = (hidden, weight, labels, bias)
    strategies = [replicated(4, inputs)]
    if reduction != "mean":
        grads = (grad_hidden, grad_weight, grad_bias)
        grad_placements = _grad_placements(bias, grads) if reduction == "sum" else [Replicate()] * 3
        outputs = [loss_placement(reduction), *grad_placements]
        strategies.append((outputs, shard_inputs(0, inputs, (True, False, True, False))))
    return strategies


@sharding_rule(fused_linear_cross_entropy_family.bwd)
def _fused_linear_cross_entropy_bwd_sharding(
    grad_output: Any, hidden: Any, weight: Any, labels: Any, bias: Any, dhidden: Any, dweight: Any, dbias: Any,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str,
    chunk_size: int, weight_grad_accumulation: str, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> list[Strategy]:  # fmt: skip
    """As the forward's. ``"none"`` recomputes from (grad_output, hidden, weight, labels, bias), the saved
    gradients being ``(0,)``; ``"sum"`` scales the saved gradients by grad_output, the other tensors
    being ``(0,)``."""
    from torch.distributed.tensor import Replicate

    inputs = (grad_output, hidden, weight, labels, bias, dhidden, dweight, dbias)
    strategies = [replicated(3, inputs)]
    if reduction != "mean":
        grads = _grad_placements(bias, (grad_hidden, grad_weight, grad_bias))
        if reduction == "none":
            sharded = shard_inputs(0, inputs, (True, True, False, True, False, False, False, False))
        else:
            sharded = [None if t is None else Replicate() for t in inputs[:5]] + grads  # (0,) but the gradients
        strategies.append((grads, sharded))
    return strategies


def resolve_chunk_size(
    num_classes: int,
    hidden_size: int,
    itemsize: int,
    chunk_size: int | None,
    memory_budget_bytes: int | None,
    weight_grad_accumulation: str = "fp32",
) -> int:
    """Rows per chunk: ``chunk_size`` if given; else as many rows as ``memory_budget_bytes`` of chunk logits
    hold, rounded down to a multiple of ``MATMUL_ROW_ALIGN`` when at least that many fit. Default budget:
    the weight's size for ``"fp32"`` (``H`` rows), a :data:`LOW_MEMORY_CHUNK_FRACTION` of it for
    ``"weight_dtype"`` (``H / 4`` rows)."""
    if chunk_size is not None:
        return chunk_size
    row_bytes = num_classes * itemsize
    if memory_budget_bytes is None:
        fraction = LOW_MEMORY_CHUNK_FRACTION if weight_grad_accumulation == "weight_dtype" else 1
        rows = max(hidden_size // fraction, 1)
    else:
        rows = memory_budget_bytes // row_bytes
    if rows < 1:
        raise ValueError(
            f"fused_linear_cross_entropy: memory_budget_bytes={memory_budget_bytes} is smaller than one row of "
            f"logits ({row_bytes} bytes for V={num_classes})"
        )
    return rows - rows % MATMUL_ROW_ALIGN if rows >= MATMUL_ROW_ALIGN else rows


def _check_inputs(
    hidden: Any, weight: Any, labels: Any, bias: Any, chunk_size: Any, memory_budget_bytes: Any, accumulation: Any
) -> None:
    op = "fused_linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if hidden.dim() == 0:
        raise ValueError(f"{op}: hidden must have at least 1 dimension (the hidden size), got a scalar")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{op}: weight must have shape (V, {hidden.shape[-1]}) to match hidden's last dimension, "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: weight must have at least one row (class), got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: weight must have hidden's dtype ({hidden.dtype}), got {weight.dtype}")
    if weight.device != hidden.device:
        raise ValueError(
            f"{op}: weight is on {weight.device} but hidden is on {hidden.device}; both must be on one device"
        )
    check_labels(op, labels, hidden.shape[:-1], hidden.device, "hidden's shape without the hidden size")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"{op}: bias must be a Tensor or None, got {type(bias).__name__}")
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"{op}: bias must have hidden's dtype ({hidden.dtype}), got {bias.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"{op}: bias is on {bias.device} but hidden is on {hidden.device}")
    for name, value in (("chunk_size", chunk_size), ("memory_budget_bytes", memory_budget_bytes)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{op}: {name} must be None or a positive int, got {value!r}")
    if chunk_size is not None and memory_budget_bytes is not None:
        raise ValueError(f"{op}: give chunk_size or memory_budget_bytes, not both")
    if not isinstance(accumulation, str) or accumulation not in WEIGHT_GRAD_ACCUMULATIONS:
        raise ValueError(
            f"{op}: weight_grad_accumulation must be one of {WEIGHT_GRAD_ACCUMULATIONS}, got {accumulation!r}"
        )


def fused_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    memory_budget_bytes: int | None = None,
    weight_grad_accumulation: WeightGradAccumulation = "fp32",
) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, labels)`` without materialising the ``(N, V)`` logits.

    Args:
        hidden: ``(..., H)`` float32/bfloat16/float16 (the LM head's input).
        weight: ``(V, H)``, same dtype (the LM head's weight).
        labels: ``(...)`` int64/int32 class indices; ``ignore_index`` skips a row. CPU eager
            raises ``ValueError`` on labels outside ``[0, V)``; CUDA gives NaN loss rows.
        bias: ``(V,)`` or None.
        ignore_index, reduction, label_smoothing, lse_square_scale, softcap: as :func:`cross_entropy`
            (the mean is NaN when every label is ignored, with zero gradients).
        chunk_size: rows of logits computed at a time.
        memory_budget_bytes: instead of ``chunk_size``, the bytes one chunk of logits may take
            (default: the weight's size, i.e. ``H`` rows per chunk; a quarter of it, ``H / 4`` rows,
            with ``weight_grad_accumulation="weight_dtype"``).
        weight_grad_accumulation: where the weight's gradient accumulates over the chunks.
            ``"fp32"`` (default): an fp32 ``(V, H)`` buffer rounded once at the end (exact, ``4 V H``
            bytes more). ``"weight_dtype"``: the gradient itself, in the weight's dtype, each chunk's
            sum rounded once (Liger-Kernel's numerics: relative error about ``sqrt(chunks) * eps``
            of the dtype). The module docstring gives each mode's memory.

    Returns:
        The loss in float32, 0-dim unless ``reduction="none"`` (then ``labels``' shape).
    """
    _check_inputs(hidden, weight, labels, bias, chunk_size, memory_budget_bytes, weight_grad_accumulation)
    check_loss_options(
        "fused_linear_cross_entropy", ignore_index, reduction, label_smoothing, lse_square_scale, softcap
    )
    num_classes, hidden_size = weight.shape
    chunk = resolve_chunk_size(
        num_classes, hidden_size, hidden.element_size(), chunk_size, memory_budget_bytes, weight_grad_accumulation
    )
    hidden2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden_size)
    labels1d = labels if labels.dim() == 1 else labels.reshape(-1)
    check_labels_in_range("fused_linear_cross_entropy", labels1d, num_classes, ignore_index)
    grad_enabled = torch.is_grad_enabled()
    grads = (
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    options = loss_options(ignore_index, label_smoothing, lse_square_scale, softcap)
    loss, *_grads = fused_linear_cross_entropy_family(
        hidden2d, weight, labels1d, bias, *options, reduction, chunk, weight_grad_accumulation, *grads
    )
    return loss.view(labels.shape) if reduction == "none" else loss


def fused_linear_cross_entropy_ref(
    hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, **loss_kwargs: Any
) -> Tensor:
    """Plain PyTorch, HF's spelling: ``F.linear`` in the inputs' dtype, then :func:`cross_entropy_ref` with
    ``loss_kwargs`` (its keywords: ``ignore_index``, ``reduction``, ``label_smoothing``, ``lse_square_scale``,
    ``softcap``)."""
    return cross_entropy_ref(torch.nn.functional.linear(hidden, weight, bias), labels, **loss_kwargs)


__all__ = ["fused_linear_cross_entropy", "fused_linear_cross_entropy_family", "fused_linear_cross_entropy_ref"]

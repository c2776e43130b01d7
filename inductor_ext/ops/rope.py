"""RoPE: ``torch.ops.fastops.rope_*`` and :func:`apply_rotary_pos_emb`, :func:`apply_rotary_pos_emb_`.

Schemas::

    fastops::rope_fwd(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids, int unsqueeze_dim)
        -> (Tensor q_embed, Tensor k_embed)
    fastops::rope_bwd(Tensor dq_embed, Tensor dk_embed, Tensor cos, Tensor sin, Tensor? position_ids,
                      int unsqueeze_dim) -> (Tensor dq, Tensor dk)
    fastops::rope_inplace(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, Tensor? position_ids,
                          int unsqueeze_dim) -> ()

``q``/``k`` are 4-D, ``(B, H, S, D)`` for ``unsqueeze_dim=1`` (HF's layout after the
head transpose) or ``(B, S, H, D)`` for ``unsqueeze_dim=2``, with their own head
counts (GQA) and any strides with a unit last one. ``cos``/``sin`` are ``(S, R)`` or
``(B or 1, S, R)``, or with ``position_ids`` (``(S,)``, ``(1, S)`` or ``(B, S)``,
integer) a ``(P, R)`` table whose row ``position_ids[b, s]`` serves token ``(b, s)``.
``R <= D`` is even; channels ``[R, D)`` pass through (partial rotary). Outputs keep
q's and k's layout (``empty_like``). The backward applies the transposed rotation
(``-sin`` for HF's tables); ``cos``/``sin`` get no gradient. The in-place op rotates
``q`` and ``k`` where they are and has no autograd. The math is in the docstring of
:mod:`inductor_ext.kernels.rope`.
"""

from collections.abc import Sequence
from typing import Any

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.rope import MAX_HEAD_DIM, rope_inplace_kernel, rope_kernel
from inductor_ext.library.launch import Launch
from inductor_ext.library.registration import define_mutating_op, define_op_family
from inductor_ext.library.sharding import Strategy, replicated, sharding_rule
from inductor_ext.ops._layout import unit_last_stride

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POSITION_DTYPES = (torch.int32, torch.int64)


def _tables_math(cos: Tensor, sin: Tensor, position_ids: Tensor | None, unsqueeze_dim: int) -> tuple[Tensor, Tensor]:
    """cos/sin per token in fp32, shaped to broadcast against q: (B or 1, 1, S, R) or (B or 1, S, 1, R).

    With position_ids, rows are gathered from the (P, R) tables; a position outside
    [0, P) gives NaN rows, as in the kernel.
    """
    cos, sin = cos.float(), sin.float()
    if position_ids is not None:
        positions = position_ids.reshape(-1, position_ids.shape[-1])
        valid = ((positions >= 0) & (positions < cos.shape[0])).unsqueeze(-1)
        rows = positions.clamp(0, cos.shape[0] - 1)
        cos = torch.where(valid, cos[rows], float("nan"))
        sin = torch.where(valid, sin[rows], float("nan"))
    elif cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)


def _rotate_math(x: Tensor, cos: Tensor, sin: Tensor, transpose: bool, dtype: torch.dtype) -> Tensor:
    rot = cos.shape[-1]
    half = rot // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rot]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if transpose:
        y = torch.cat([x1 * c1 + x2 * s2, x2 * c2 - x1 * s1], dim=-1)
    else:
        y = torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1)
    if rot < x.shape[-1]:
        y = torch.cat([y, xf[..., rot:]], dim=-1)
    return y.to(dtype)


def _out_dtype(x: Tensor, cos: Tensor) -> torch.dtype:
    """HF's ``q * cos + rotate_half(q) * sin`` promotes q's dtype with the tables'."""
    return torch.promote_types(x.dtype, cos.dtype)


def rope_fwd_math(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None, unsqueeze_dim: int
) -> tuple[Tensor, Tensor]:
    """Aten-only forward (CPU branch and the backend's decomposition), computed in fp32."""
    c, s = _tables_math(cos, sin, position_ids, unsqueeze_dim)
    dtype = _out_dtype(q, cos)
    return _rotate_math(q, c, s, False, dtype), _rotate_math(k, c, s, False, dtype)


def rope_bwd_math(
    dq_embed: Tensor, dk_embed: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None, unsqueeze_dim: int
) -> tuple[Tensor, Tensor]:
    """Aten-only backward: the transposed rotation, in the incoming gradients' dtype."""
    c, s = _tables_math(cos, sin, position_ids, unsqueeze_dim)
    return _rotate_math(dq_embed, c, s, True, dq_embed.dtype), _rotate_math(dk_embed, c, s, True, dk_embed.dtype)


def _bsh_strides(x: Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, H, S, D) [unsqueeze_dim=1] or (B, S, H, D) [2] tensor."""
    if unsqueeze_dim == 1:
        return x.stride(0), x.stride(2), x.stride(1)
    return x.stride(0), x.stride(1), x.stride(2)


def _launch(
    launch: Launch,
    kernel: Any,
    q: Tensor,
    k: Tensor,
    q_out: Tensor | None,
    k_out: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None,
    unsqueeze_dim: int,
    backward: bool,
) -> None:
    """One launch for q and k; ``q_out``/``k_out`` None rotates q and k in place."""
    seq_dim, head_dim = (2, 1) if unsqueeze_dim == 1 else (1, 2)
    batch, seq_len, n_q_heads, n_k_heads = q.shape[0], q.shape[seq_dim], q.shape[head_dim], k.shape[head_dim]
    rot, width = cos.shape[-1], q.shape[-1]
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    if position_ids is not None:
        positions = position_ids.reshape(-1, seq_len)
        n_positions, cos_b, cos_s = cos.shape[0], 0, cos.stride(0)
        pos_b, pos_s = (positions.stride(0) if positions.shape[0] > 1 else 0), positions.stride(1)
    else:
        positions = None
        n_positions, pos_b, pos_s = 0, 0, 0
        if cos.dim() == 2:
            cos_b, cos_s = 0, cos.stride(0)
        else:
            cos_b, cos_s = (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)
    in_place = q_out is None
    q_out_strides = _bsh_strides(q if q_out is None else q_out, unsqueeze_dim)
    k_out_strides = _bsh_strides(k if k_out is None else k_out, unsqueeze_dim)
    launch(
        kernel,
        lambda meta: (
            triton.cdiv(batch * seq_len, meta["BLOCK_T"])
            * (triton.cdiv(n_q_heads, meta["BLOCK_H"]) + triton.cdiv(n_k_heads, meta["BLOCK_H"])),
        ),
        q, k, q_out, k_out, cos, sin, positions,
        batch * seq_len, seq_len, n_q_heads, n_k_heads, n_positions,
        *_bsh_strides(q, unsqueeze_dim), *_bsh_strides(k, unsqueeze_dim), *q_out_strides, *k_out_strides,
        cos_b, cos_s, pos_b, pos_s,
        HALF=rot // 2, HALF_PAD=triton.next_power_of_2(rot // 2),
        PASS=width - rot, PASS_PAD=triton.next_power_of_2(max(1, width - rot)),
        HAS_POS=positions is not None, BACKWARD=backward, IN_PLACE=in_place,
        HEADS_FASTEST=q.stride(head_dim) < q.stride(seq_dim),
    )  # fmt: skip


def rope_fwd_kernels(
    launch: Launch, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None, unsqueeze_dim: int
) -> tuple[Tensor, Tensor]:
    q, k = unit_last_stride(q), unit_last_stride(k)
    dtype = _out_dtype(q, cos)
    q_embed, k_embed = torch.empty_like(q, dtype=dtype), torch.empty_like(k, dtype=dtype)
    _launch(launch, rope_kernel, q, k, q_embed, k_embed, cos, sin, position_ids, unsqueeze_dim, backward=False)
    return q_embed, k_embed


def rope_bwd_kernels(
    launch: Launch,
    dq_embed: Tensor,
    dk_embed: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None,
    unsqueeze_dim: int,
) -> tuple[Tensor, Tensor]:
    dq_embed, dk_embed = unit_last_stride(dq_embed), unit_last_stride(dk_embed)
    dq, dk = torch.empty_like(dq_embed), torch.empty_like(dk_embed)
    _launch(launch, rope_kernel, dq_embed, dk_embed, dq, dk, cos, sin, position_ids, unsqueeze_dim, backward=True)
    return dq, dk


def _setup_context(ctx: Any, inputs: Sequence[Any], output: tuple[Tensor, Tensor]) -> None:
    q, k, cos, sin, position_ids, ctx.unsqueeze_dim = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.q_meta = (q.shape, q.dtype)
    ctx.k_meta = (k.shape, k.dtype)


def _backward(ctx: Any, bwd: Any, dq_embed: Tensor | None, dk_embed: Tensor | None) -> tuple[Tensor | None, ...]:
    cos, sin, position_ids = ctx.saved_tensors
    # the eager path passes None for an output that got no gradient: rotate zeros for it
    other = dq_embed if dq_embed is not None else dk_embed
    assert other is not None  # autograd calls backward only when some output has a gradient
    if dq_embed is None:
        dq_embed = other.new_zeros(ctx.q_meta[0])
    if dk_embed is None:
        dk_embed = other.new_zeros(ctx.k_meta[0])
    dq, dk = bwd(dq_embed, dk_embed, cos, sin, position_ids, ctx.unsqueeze_dim)
    return dq.to(ctx.q_meta[1]), dk.to(ctx.k_meta[1]), None, None, None, None


rope_family = define_op_family(
    "rope",
    fwd_math=rope_fwd_math,
    fwd_kernels=rope_fwd_kernels,
    bwd_math=rope_bwd_math,
    bwd_kernels=rope_bwd_kernels,
    setup_context=_setup_context,
    backward=_backward,
)


@sharding_rule(rope_family.fwd, rope_family.bwd)
def _rope_sharding(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, unsqueeze_dim: int) -> list[Strategy]:
    """rope_fwd and rope_bwd (same arguments: the gradients of the embeddings in place of q and k).

    q and k sharded alike on batch (cos/sin sharded along with them when they carry a batch dim
    larger than 1, replicated otherwise; per-batch position ids sharded along), on the sequence
    (cos/sin rows or position ids sharded along it; a position-id table replicated) or on heads
    (tables replicated).

    q, k: ``(B, H, S, D)`` (``unsqueeze_dim=1``) or ``(B, S, H, D)`` (``unsqueeze_dim=2``).
    Tables: ``(S, R)`` or ``(B or 1, S, R)``; with position ids (``(S,)``, ``(1, S)``, ``(B, S)``)
    a ``(P, R)`` table indexed by them.
    """
    from torch.distributed.tensor import Replicate, Shard

    tables = (cos, sin, position_ids)
    head_dim, seq_dim = (1, 2) if unsqueeze_dim == 1 else (2, 1)

    def strategy(qk_dim: int, table_placements: Sequence[Any]) -> Strategy:
        return [Shard(qk_dim)] * 2, [Shard(qk_dim), Shard(qk_dim), *table_placements]

    replicated_tables = [None if t is None else Replicate() for t in tables]
    if position_ids is None:
        per_batch = cos.ndim == 3 and cos.shape[0] > 1
        batch_tables: list[Any] = [Shard(0) if per_batch else Replicate()] * 2 + [None]
        seq_tables: list[Any] = [Shard(cos.ndim - 2)] * 2 + [None]
    else:
        per_batch = position_ids.ndim == 2 and position_ids.shape[0] > 1
        batch_tables = [Replicate(), Replicate(), Shard(0) if per_batch else Replicate()]
        seq_tables = [Replicate(), Replicate(), Shard(position_ids.ndim - 1)]
    return [
        replicated(2, (q, k, *tables)),
        strategy(0, batch_tables),
        strategy(seq_dim, seq_tables),
        strategy(head_dim, replicated_tables),
    ]


# The in-place form mutates q and k, which define_op_family (functional ops with
# autograd) does not cover: it is registered here with mutates_args, without autograd.


def _rope_inplace_math(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None, unsqueeze_dim: int
) -> None:
    q_embed, k_embed = rope_fwd_math(q, k, cos, sin, position_ids, unsqueeze_dim)
    q.copy_(q_embed)
    k.copy_(k_embed)


def _rope_inplace_kernels(
    launch: Launch, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor | None, unsqueeze_dim: int
) -> None:
    """Rotate in place; a q or k without a unit last stride is rotated in a contiguous copy, copied back."""
    q_unit, k_unit = unit_last_stride(q), unit_last_stride(k)
    _launch(launch, rope_inplace_kernel, q_unit, k_unit, None, None, cos, sin, position_ids, unsqueeze_dim, False)
    for target, rotated in ((q, q_unit), (k, k_unit)):
        if rotated is not target:
            target.copy_(rotated)


rope_inplace = define_mutating_op(
    "rope_inplace", family="rope", math=_rope_inplace_math, kernels=_rope_inplace_kernels, mutates=("q", "k")
)


def _check_inputs(
    fn: str, q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, unsqueeze_dim: Any
) -> tuple[int, Tensor | None]:
    """Validate; return the normalised unsqueeze_dim (1 or 2) and the position_ids the op uses."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: {name} must be a Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}; all must be on one device")
    if unsqueeze_dim not in (1, 2, -3, -2):
        raise ValueError(
            f"{fn}: unsqueeze_dim must be 1 (q is (B, H, S, D)) or 2 (q is (B, S, H, D)), got {unsqueeze_dim}"
        )
    dim = 1 if unsqueeze_dim in (1, -3) else 2
    layout = "(B, H, S, D)" if dim == 1 else "(B, S, H, D)"
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"{fn}: k must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{fn}: k must have q's dtype {q.dtype}, got {k.dtype}")
    seq_dim = 3 - dim
    batch, seq_len, width = q.shape[0], q.shape[seq_dim], q.shape[3]
    if width > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: q's head dim must be at most {MAX_HEAD_DIM} (the kernel's tiles), got {width}")
    if (k.shape[0], k.shape[seq_dim], k.shape[3]) != (batch, seq_len, width):
        raise ValueError(
            f"{fn}: k must match q's batch, sequence and head dims ({batch}, {seq_len}, {width}) in layout {layout}, "
            f"got shape {tuple(k.shape)}"
        )
    if sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(
            f"{fn}: sin must have cos's shape {tuple(cos.shape)} and dtype {cos.dtype}, "
            f"got {tuple(sin.shape)} {sin.dtype}"
        )
    if cos.dim() not in (2, 3):
        raise ValueError(
            f"{fn}: cos must be (S, R), (B, S, R) or, with position_ids, (P, R); got shape {tuple(cos.shape)}"
        )
    rot = cos.shape[-1]
    if rot % 2 or not 2 <= rot <= width:
        raise ValueError(f"{fn}: cos's last dimension (rotary dim) must be even and in [2, {width}], got {rot}")
    if cos.dim() == 3:
        if cos.shape[1] != seq_len or cos.shape[0] not in (1, batch):
            raise ValueError(f"{fn}: cos must be (1 or {batch}, {seq_len}, R) to match q, got {tuple(cos.shape)}")
        return dim, None  # already indexed by position: position_ids is unused, as in HF
    if position_ids is None:
        if cos.shape[0] != seq_len:
            raise ValueError(f"{fn}: cos must be ({seq_len}, R) to match q's sequence, got {tuple(cos.shape)}")
        return dim, None
    if not isinstance(position_ids, Tensor):
        raise TypeError(f"{fn}: position_ids must be a Tensor or None, got {type(position_ids).__name__}")
    if position_ids.dtype not in POSITION_DTYPES:
        raise TypeError(f"{fn}: position_ids must be int32 or int64, got {position_ids.dtype}")
    if position_ids.device != q.device:
        raise ValueError(f"{fn}: position_ids is on {position_ids.device} but q is on {q.device}")
    if position_ids.shape not in ((seq_len,), (1, seq_len), (batch, seq_len)):
        raise ValueError(
            f"{fn}: position_ids must be ({seq_len},), (1, {seq_len}) or ({batch}, {seq_len}), "
            f"got {tuple(position_ids.shape)}"
        )
    if position_ids.device.type == "cpu" and not torch.compiler.is_compiling() and position_ids.numel():
        # a host check only where it costs no device sync; the GPU kernel writes NaN rows instead
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= cos.shape[0]:
            raise ValueError(
                f"{fn}: position_ids must be in [0, {cos.shape[0]}) (rows of cos), got values in [{low}, {high}]"
            )
    return dim, position_ids


def apply_rotary_pos_emb(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[Tensor, Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, like HF's ``apply_rotary_pos_emb``.

    Args:
        q: ``(B, Hq, S, D)`` with ``unsqueeze_dim=1`` (HF's layout) or ``(B, S, Hq, D)``
            with ``unsqueeze_dim=2``; any strides (HF's transposed projection runs
            without a copy) with a unit last stride (else copied).
        k: same layout, its own head count ``Hk`` (GQA), q's dtype.
        cos, sin: ``(B or 1, S, R)`` (HF's rotary embedding output; ``position_ids`` is
            then unused, as in HF), ``(S, R)`` shared by the batch, or with
            ``position_ids`` a ``(P, R)`` table (transformers <= 4.37:
            ``cos[position_ids]``). ``R < D`` rotates the first ``R`` channels and
            passes the rest through (partial rotary). Treated as constants: no gradient.
        position_ids: ``(S,)``, ``(1, S)`` or ``(B, S)`` int32/int64 rows of the tables.
            Out of ``[0, P)``: ``ValueError`` on CPU; on the GPU (no host sync) those
            tokens' outputs are NaN.
        unsqueeze_dim: 1 or 2 (or -3, -2), as in HF.

    Outputs have q's and k's layout and the promoted dtype of q and cos; the math is fp32.
    """
    dim, position_ids = _check_inputs("apply_rotary_pos_emb", q, k, cos, sin, position_ids, unsqueeze_dim)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("apply_rotary_pos_emb: cos and sin must not require grad (they get no gradient); detach them")
    return rope_family(q, k, cos, sin, position_ids, dim)


def apply_rotary_pos_emb_(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[Tensor, Tensor]:
    """In-place :func:`apply_rotary_pos_emb`: rotates ``q`` and ``k`` where they are and returns them.

    Registered as ``fastops::rope_inplace`` with ``mutates_args={"q", "k"}``. No
    autograd (a custom op that mutates its inputs cannot have one): for inference,
    e.g. before writing k to a KV cache. The tables' dtype must not promote q's.
    """
    dim, position_ids = _check_inputs("apply_rotary_pos_emb_", q, k, cos, sin, position_ids, unsqueeze_dim)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError(
            "apply_rotary_pos_emb_: q and k must not require grad (the in-place form has no autograd); "
            "use apply_rotary_pos_emb, or call it under torch.no_grad()"
        )
    for name, t in (("q", q), ("k", k)):
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            raise ValueError(
                f"apply_rotary_pos_emb_: {name} has elements sharing memory (a zero stride, e.g. expand()); "
                "in place it cannot"
            )
    if _out_dtype(q, cos) != q.dtype:
        raise TypeError(
            f"apply_rotary_pos_emb_: cos's dtype {cos.dtype} would promote q's {q.dtype}; in place it cannot"
        )
    rope_inplace(q, k, cos, sin, position_ids, dim)
    return q, k


def rotate_half(x: Tensor) -> Tensor:
    """HF's ``rotate_half``: ``cat(-x2, x1)`` of the two halves of the last dim."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_ref(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    position_ids: Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch RoPE, HF's spelling (differentiable), with its partial-rotary form
    (GPT-NeoX, Phi) and transformers <= 4.37's ``cos[position_ids]`` for 2-D tables.
    With float64 inputs it is the exact reference."""
    if cos.dim() == 2 and position_ids is not None:
        rows = position_ids.reshape(-1, position_ids.shape[-1])
        cos, sin = cos[rows], sin[rows]
    elif cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    q_rot, q_pass = q[..., :rot], q[..., rot:]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
    if rot == q.shape[-1]:
        return q_embed, k_embed
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_", "apply_rotary_pos_emb_ref", "rope_family", "rotate_half"]

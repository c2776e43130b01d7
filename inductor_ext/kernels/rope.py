"""Rotary position embedding Triton kernel, HF ``rotate_half`` convention (device code and launch configs only).

For every token ``(b, s)`` and head, with ``R = 2 * HALF`` rotated channels out of
``D`` (``R < D``: partial rotary, channels ``[R, D)`` pass through), ``x1 = x[:HALF]``,
``x2 = x[HALF:R]`` and ``cos``/``sin`` rows of ``R`` values split the same way
(``c1, c2``, ``s1, s2``); all math in fp32::

    forward   (y = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x2, x1)):
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    backward  (the transpose: dx = dy * cos + rotate_half^T(dy * sin)):
        dx1 = dy1 * c1 + dy2 * s2
        dx2 = dy2 * c2 - dy1 * s1

With HF's tables (``cos = cat(c, c)``, ``sin = cat(s, s)``) the backward is the same
rotation with ``-sin``. The ``cos``/``sin`` row of a token is ``(b, s)`` of a
``(B or 1, S, R)`` table, or row ``position_ids[b, s]`` of a ``(P, R)`` table
(``HAS_POS``); a position outside ``[0, P)`` reads ``cos = sin = NaN``, so its output
row is NaN (documented behaviour for bad ``position_ids`` on the GPU).

One launch rotates q and k (any head counts, GQA): axis 0 of the grid walks blocks
of ``BLOCK_T`` tokens, axis 1 blocks of ``BLOCK_H`` heads, first q's then k's. Each
program handles a ``[BLOCK_T, BLOCK_H, HALF_PAD]`` tile and loads each token's
``cos``/``sin`` once for all its heads. Every tensor is addressed through its
``(batch, seq, head)`` strides with a unit channel stride, so ``(B, H, S, D)``,
``(B, S, H, D)`` and transposed views run without copies. Token offsets are int64.
"""

import dataclasses
from typing import Any

import triton
import triton.language as tl

from inductor_ext.tuning.search_spaces.order import in_search_order

TILE_ELEMENTS = (2048, 4096, 8192)
"""Target elements of one program's tile (all channels it touches, all its heads and tokens)."""

MAX_BLOCK_T = 256
"""Most tokens per program (reached with few heads and a small rotary dim)."""

MAX_HEAD_DIM = 1024
"""Largest head dim D the configs are sized for (the public function refuses larger ones)."""


@dataclasses.dataclass(frozen=True)
class RoPEConfig:
    """One launch configuration: ``block_t`` tokens times ``block_h`` heads per program."""

    block_t: int
    block_h: int
    num_warps: int

    def to_triton(self) -> triton.Config:
        return triton.Config({"BLOCK_T": self.block_t, "BLOCK_H": self.block_h}, num_warps=self.num_warps)

    @classmethod
    def from_triton(cls, config: triton.Config) -> "RoPEConfig":
        return cls(config.kwargs["BLOCK_T"], config.kwargs["BLOCK_H"], config.num_warps)


def _head_block(n_q_heads: int, n_k_heads: int) -> int:
    """Largest useful head block: the smaller head count (so k's blocks are full too), at most 16."""
    return min(16, triton.next_power_of_2(max(1, min(n_q_heads, n_k_heads))))


def _tile_width(half_pad: int, pass_pad: int) -> int:
    """Channels a program touches per token and head: both rotated halves and the pass-through ones."""
    return 2 * half_pad + pass_pad


def search_space(n_q_heads: int, n_k_heads: int, half_pad: int, pass_pad: int = 0) -> list[RoPEConfig]:
    """Every config for these head counts and padded widths, the heuristic's favourite first.

    ``half_pad``: the rotated half ``R / 2`` rounded up to a power of two; ``pass_pad``:
    the pass-through channels ``D - R`` rounded up likewise (0 without partial rotary).
    Head blocks of the heuristic's size and half of it; the most tokens (up to 256) that
    keep the tile within 2048, 4096 or 8192 elements; 8 or 16 elements per thread in the
    widest load, a rotated half or the pass-through part (one or two 16-byte vectors in
    bf16). If no tile fits (very wide heads), one config: a single token and the full
    head block.
    """
    top = _head_block(n_q_heads, n_k_heads)
    width = _tile_width(half_pad, pass_pad)
    widest = max(half_pad, pass_pad)
    configs: dict[RoPEConfig, None] = {}
    for block_h in dict.fromkeys((top, max(1, top // 2))):
        for elements in TILE_ELEMENTS:
            rows = elements // (block_h * width)
            if rows < 1:
                continue
            block_t = min(MAX_BLOCK_T, 1 << (rows.bit_length() - 1))
            for num_warps in (1, 2, 4, 8, 16):
                if block_t * block_h * widest // (32 * num_warps) in (8, 16):
                    configs[RoPEConfig(block_t, block_h, num_warps)] = None
    if not configs:
        configs[RoPEConfig(1, top, min(16, max(1, top * widest // 256)))] = None
    return sorted(configs, key=lambda c: _heuristic_rank(c, top, width, widest))


def _heuristic_rank(config: RoPEConfig, top: int, width: int, widest: int) -> tuple[bool, int, bool, bool]:
    """Prefer 16 elements per thread in the widest load, then tiles nearest 4096 elements (the
    smaller of two equally near), then the full head block. A full timing picks 16 elements per thread, in
    tiles of 2048 or 4096 elements, at the benchmark shapes."""
    elements = config.block_t * config.block_h * width
    per_thread = config.block_t * config.block_h * widest // (32 * config.num_warps)
    return (per_thread != 16, abs(elements.bit_length() - 13), elements > 4096, config.block_h != top)


def heuristic(n_q_heads: int, n_k_heads: int, half_pad: int, pass_pad: int = 0) -> RoPEConfig:
    return search_space(n_q_heads, n_k_heads, half_pad, pass_pad)[0]


def _all_configs() -> list[triton.Config]:
    seen: dict[RoPEConfig, None] = {}
    max_log2 = MAX_HEAD_DIM.bit_length() - 1
    for heads in (1, 2, 4, 8, 16):
        for half_log2 in range(max_log2):
            for pass_pad in (0, *(2**p for p in range(max_log2 + 1))):
                seen.update(dict.fromkeys(search_space(heads, heads, 2**half_log2, pass_pad)))
    return [c.to_triton() for c in seen]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    args: dict[str, Any] = {**named_args, **kwargs}
    pass_pad = args["PASS_PAD"] if args["PASS"] > 0 else 0
    space = search_space(args["n_q_heads"], args["n_k_heads"], args["HALF_PAD"], pass_pad)
    return in_search_order(configs, space, RoPEConfig.from_triton)


_AUTOTUNE: dict[str, Any] = {
    "configs": _all_configs(),
    "key": ["n_q_heads", "n_k_heads", "HALF_PAD", "PASS", "BACKWARD", "HEADS_FASTEST"],
    "prune_configs_by": {"early_config_prune": _prune},
}


@triton.jit
def _rotate_tile(
    X, Y, COS, SIN, POS, t0, h0,
    n_tokens, seq_len, n_heads, n_positions,
    stride_xb, stride_xs, stride_xh, stride_yb, stride_ys, stride_yh,
    stride_cb, stride_cs, stride_pb, stride_ps,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS: tl.constexpr, PASS_PAD: tl.constexpr,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, COPY_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Rotate tokens [t0, t0 + BLOCK_T) x heads [h0, h0 + BLOCK_H) of X into Y (see the module docstring)."""
    t = t0 + tl.arange(0, BLOCK_T)
    h = h0 + tl.arange(0, BLOCK_H)
    t_mask = t < n_tokens
    b = t // seq_len
    s = t - b * seq_len
    b64 = b.to(tl.int64)
    s64 = s.to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < HALF

    h64 = h.to(tl.int64)
    x_row = (b64 * stride_xb + s64 * stride_xs)[:, None, None] + (h64 * stride_xh)[None, :, None]
    y_row = (b64 * stride_yb + s64 * stride_ys)[:, None, None] + (h64 * stride_yh)[None, :, None]
    row_mask = t_mask[:, None, None] & (h < n_heads)[None, :, None]
    mask = row_mask & j_mask[None, None, :]
    x_offs = x_row + j[None, None, :]
    y_offs = y_row + j[None, None, :]

    # cos/sin of each token, loaded for every head in x's [BLOCK_T, BLOCK_H, HALF_PAD] layout:
    # the repeats hit L1, and no layout conversion (shared memory and barriers) is needed
    if HAS_POS:
        pos = tl.load(POS + b64 * stride_pb + s64 * stride_ps, mask=t_mask, other=0).to(tl.int64)
        c_row = pos * stride_cs
        c_valid = (pos >= 0) & (pos < n_positions)
    else:
        c_row = b64 * stride_cb + s64 * stride_cs
        c_valid = t_mask
    same_for_all_heads = tl.zeros([BLOCK_H], dtype=tl.int64)
    c_offs = c_row[:, None, None] + same_for_all_heads[None, :, None] + j[None, None, :]
    c_mask = mask & c_valid[:, None, None]
    c1 = tl.load(COS + c_offs, mask=c_mask, other=float("nan")).to(tl.float32)
    c2 = tl.load(COS + c_offs + HALF, mask=c_mask, other=float("nan")).to(tl.float32)
    s1 = tl.load(SIN + c_offs, mask=c_mask, other=float("nan")).to(tl.float32)
    s2 = tl.load(SIN + c_offs + HALF, mask=c_mask, other=float("nan")).to(tl.float32)

    x1 = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + x_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + y_offs, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + y_offs + HALF, y2.to(Y.dtype.element_ty), mask=mask)

    if PASS > 0 and COPY_PASS:  # partial rotary: channels [2 * HALF, D) unchanged
        p = tl.arange(0, PASS_PAD)
        p_mask = row_mask & (p < PASS)[None, None, :]
        x_pass = tl.load(X + x_row + 2 * HALF + p[None, None, :], mask=p_mask, other=0.0)
        tl.store(Y + y_row + 2 * HALF + p[None, None, :], x_pass.to(Y.dtype.element_ty), mask=p_mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, POS,
    n_tokens, seq_len, n_q_heads, n_k_heads, n_positions,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_qob, stride_qos, stride_qoh, stride_kob, stride_kos, stride_koh,
    stride_cb, stride_cs, stride_pb, stride_ps,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PASS: tl.constexpr, PASS_PAD: tl.constexpr,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, IN_PLACE: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """QO = rope(Q), KO = rope(K) (or their transposes, BACKWARD) in one launch.

    Program (i, j) takes tokens [i * BLOCK_T, (i + 1) * BLOCK_T) and head block j of q
    when j < cdiv(n_q_heads, BLOCK_H), else head block j - cdiv(n_q_heads, BLOCK_H) of k.
    The grid is 1-D and follows the memory order: with HEADS_FASTEST (a token's heads lie
    next to each other, as in HF's ``(B, S, H, D)`` projections seen through a transpose)
    consecutive programs take the head blocks of one token block, else the token blocks of
    one head block, so the programs in flight sweep memory in order.
    IN_PLACE: QO and KO are unused; Q and K are overwritten (rotated channels only).
    COS and SIN share the strides (stride_cb, stride_cs) and have a unit channel stride.
    """
    q_blocks = tl.cdiv(n_q_heads, BLOCK_H)
    head_blocks = q_blocks + tl.cdiv(n_k_heads, BLOCK_H)
    pid = tl.program_id(0)
    if HEADS_FASTEST:
        token_block = pid // head_blocks
        head_block = pid % head_blocks
    else:
        token_blocks = tl.cdiv(n_tokens, BLOCK_T)
        token_block = pid % token_blocks
        head_block = pid // token_blocks
    t0 = token_block * BLOCK_T
    if head_block < q_blocks:
        h0 = head_block * BLOCK_H
        if IN_PLACE:
            _rotate_tile(
                Q, Q, COS, SIN, POS, t0, h0, n_tokens, seq_len, n_q_heads, n_positions,
                stride_qb, stride_qs, stride_qh, stride_qb, stride_qs, stride_qh,
                stride_cb, stride_cs, stride_pb, stride_ps,
                HALF, HALF_PAD, PASS, PASS_PAD, HAS_POS, BACKWARD, False, BLOCK_T, BLOCK_H,
            )  # fmt: skip
        else:
            _rotate_tile(
                Q, QO, COS, SIN, POS, t0, h0, n_tokens, seq_len, n_q_heads, n_positions,
                stride_qb, stride_qs, stride_qh, stride_qob, stride_qos, stride_qoh,
                stride_cb, stride_cs, stride_pb, stride_ps,
                HALF, HALF_PAD, PASS, PASS_PAD, HAS_POS, BACKWARD, True, BLOCK_T, BLOCK_H,
            )  # fmt: skip
    else:
        h0 = (head_block - q_blocks) * BLOCK_H
        if IN_PLACE:
            _rotate_tile(
                K, K, COS, SIN, POS, t0, h0, n_tokens, seq_len, n_k_heads, n_positions,
                stride_kb, stride_ks, stride_kh, stride_kb, stride_ks, stride_kh,
                stride_cb, stride_cs, stride_pb, stride_ps,
                HALF, HALF_PAD, PASS, PASS_PAD, HAS_POS, BACKWARD, False, BLOCK_T, BLOCK_H,
            )  # fmt: skip
        else:
            _rotate_tile(
                K, KO, COS, SIN, POS, t0, h0, n_tokens, seq_len, n_k_heads, n_positions,
                stride_kb, stride_ks, stride_kh, stride_kob, stride_kos, stride_koh,
                stride_cb, stride_cs, stride_pb, stride_ps,
                HALF, HALF_PAD, PASS, PASS_PAD, HAS_POS, BACKWARD, True, BLOCK_T, BLOCK_H,
            )  # fmt: skip


rope_kernel = triton.autotune(**_AUTOTUNE)(_rope_kernel)
"""Functional form: writes QO and KO."""

rope_inplace_kernel = triton.autotune(**_AUTOTUNE, restore_value=["Q", "K"])(_rope_kernel)
"""In-place form (IN_PLACE=True): the autotuner restores Q and K after each timed run."""

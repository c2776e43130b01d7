"""Attention of new tokens against a KV cache, split over the cache (flash-decoding), grouped-query aware
(device code and launch configs only).

For query head ``h`` of token ``i`` of row ``b``, its key/value head ``c = h // G`` (``G = heads /
kv_heads``) and the cache slots ``j`` with ``mask[b, i, j]``::

    s_j = scale * q[b, h, i] . k[b, c, j]
    out[b, h, i] = sum_j exp(s_j - max s) v[b, c, j] / sum_j exp(s_j - max s)

and zeros for a token with no visible slot. The ``S`` slots are cut into ``n_splits`` ranges of
``keys_per_split`` slots (a multiple of :data:`KEYS_PER_SPLIT`, chosen by the op: many splits for one
token, one for a prompt). Program ``(b, c, token block, split)`` of
:func:`decode_attention_partial_kernel` serves ``BLOCK_T`` tokens times the ``G`` query heads of key/value
head ``c`` as the rows of one tile (each key and value is read once for all of them, not ``G`` times as
after transformers' ``repeat_kv``) and keeps, per row, over its slots::

    m = max_j s_j        l = sum_j exp(s_j - m)        acc = sum_j exp(s_j - m) v_j

with an online softmax over tiles of ``BLOCK_N`` slots (``m`` rescales ``l`` and ``acc`` by
``exp(m_old - m_new)`` as it grows; exponentials in base 2 on ``s * log2(e)``). A tile with no slot
visible to any of its tokens is skipped without reading its keys or values, so the unfilled tail of a
static cache, a row's left padding and the causal upper triangle of a prompt cost only their mask
bytes; a row that sees nothing keeps ``m = -inf, l = 0``. :func:`decode_attention_combine_kernel` merges
the splits of each ``(b, h, i)``: with ``M`` the largest ``m``,
``out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s``.

``q . k`` and ``p . v`` are ``tl.dot`` products (bf16/fp16 in, fp32 accumulated) when ``USE_DOT``,
else fp32 broadcast-multiply-sums: float32 inputs (``tl.dot`` would round them to tf32) and the
interpreter, whose bf16 ``tl.dot`` is not exact. Softmax state and the partial results are float32.
Batch and slot offsets are int64.
"""

import triton
import triton.language as tl

KEYS_PER_SPLIT = 128
"""Cache slots per split for a single token: at batch 1 a 2048-slot cache with 8 key/value heads makes
128 programs, about one per SM of a 132-SM GPU. ``t`` tokens get ``1 / t`` as many splits (at least one),
so the partial results never outgrow ``b * heads * S / KEYS_PER_SPLIT`` rows."""

DOT_ROWS = 64
"""Rows (tokens x padded group) of a ``tl.dot`` tile; the broadcast-sum path takes one token a program."""

MAX_HEAD_DIM = 256
"""Largest head dim the kernels are sized for (the public function refuses larger ones)."""


def partial_configs(use_dot: bool) -> list[triton.Config]:
    """Tile sizes (slots per iteration) and warps the partial kernel is tuned over; every ``BLOCK_N``
    divides :data:`KEYS_PER_SPLIT` (and so ``keys_per_split``)."""
    if use_dot:
        return [triton.Config({"BLOCK_N": n}, num_warps=w) for n in (32, 64, 128) for w in (4, 8)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n in (16, 32) for w in (2, 4)]


@triton.jit
def _decode_attention_partial(
    q_ptr, k_ptr, v_ptr, mask_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    scale, n_slots, tokens, kv_heads, group, n_splits, keys_per_split,
    q_sb, q_sh, q_st, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, mask_sb, mask_st, mask_ss,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr,
):  # fmt: skip
    token_blocks = tl.cdiv(tokens, BLOCK_T)
    program = tl.program_id(0)  # (b, c, token block), token blocks fastest
    split = tl.program_id(1)
    kv = (program // token_blocks) % kv_heads
    batch = (program // (token_blocks * kv_heads)).to(tl.int64)
    # BLOCK_T tokens x GROUP_PAD query heads of the group, token-major
    r = tl.arange(0, BLOCK_T * GROUP_PAD)
    g = r % GROUP_PAD
    token = (program % token_blocks) * BLOCK_T + r // GROUP_PAD
    row_ok = (g < group) & (token < tokens)
    heads = kv * group + g
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + batch * q_sb + heads[:, None] * q_sh + token[:, None] * q_st + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    qk_scale = tl.cast(scale, tl.float32) * 1.4426950408889634  # log2(e): base-2 exponentials (Inductor may pass fp64)
    if not USE_DOT:
        q = q.to(tl.float32) * qk_scale
    k_base = k_ptr + batch * k_sb + kv * k_sh
    v_base = v_ptr + batch * v_sb + kv * v_sh
    mask_rows = mask_ptr + batch * mask_sb + token.to(tl.int64) * mask_st
    m_i = tl.full([BLOCK_T * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_T * GROUP_PAD, D_PAD], tl.float32)
    for offset in range(0, keys_per_split, BLOCK_N):
        slots = split * keys_per_split + offset + tl.arange(0, BLOCK_N)
        visible = tl.load(
            mask_rows[:, None] + slots[None, :].to(tl.int64) * mask_ss,
            mask=(token < tokens)[:, None] & (slots < n_slots)[None, :],
            other=0,
        ) != 0  # fmt: skip
        if tl.max(tl.max(visible.to(tl.int32), 1), 0) > 0:
            slot_visible = tl.max(visible.to(tl.int32), 0) > 0  # to some token of the block
            rows = slots.to(tl.int64)
            kv_mask = slot_visible[:, None] & dim_ok[None, :]
            keys = tl.load(k_base + rows[:, None] * k_ss + dims[None, :], mask=kv_mask, other=0.0)
            if USE_DOT:
                scores = tl.dot(q, tl.trans(keys)) * qk_scale
            else:
                scores = tl.sum(q[:, None, :] * keys.to(tl.float32)[None, :, :], 2)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # a row that has seen no visible slot yet keeps m = -inf: shift it by 0, its exponentials are 0
            shift = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - shift)
            p = tl.exp2(scores - shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            values = tl.load(v_base + rows[:, None] * v_ss + dims[None, :], mask=kv_mask, other=0.0)
            if USE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values.to(tl.float32)[None, :, :], 1)
            m_i = m_new
    # partial results (b, heads, tokens, n_splits[, HEAD_DIM]), contiguous
    part = ((batch * kv_heads * group + heads) * tokens + token) * n_splits + split
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


_TUNING_KEY = ["HEAD_DIM", "GROUP_PAD"]

decode_attention_partial_kernel = triton.autotune(configs=partial_configs(True), key=_TUNING_KEY)(
    _decode_attention_partial
)
"""The partial kernel with ``tl.dot`` products (``USE_DOT=True``: bf16 and fp16 on a GPU)."""

decode_attention_partial_sum_kernel = triton.autotune(configs=partial_configs(False), key=_TUNING_KEY)(
    _decode_attention_partial
)
"""The partial kernel with broadcast-sum products (``USE_DOT=False``: float32, and the interpreter)."""


@triton.jit
def decode_attention_combine_kernel(
    part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr,
    n_splits, heads, tokens, out_sb, out_sh, out_st,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (b, h, i), i fastest
    token = row % tokens
    head = (row // tokens) % heads
    batch = row // (tokens * heads)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
    largest = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for first in range(0, n_splits, BLOCK_S):
        splits = first + tl.arange(0, BLOCK_S)
        m = tl.load(part_max_ptr + row * n_splits + splits, mask=splits < n_splits, other=float("-inf"))
        largest = tl.maximum(largest, m)
    top = tl.max(largest, 0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no visible slot at all: every weight exp2(-inf) = 0
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, D_PAD], tl.float32)
    for first in range(0, n_splits, BLOCK_S):
        splits = first + tl.arange(0, BLOCK_S)
        ok = splits < n_splits
        m = tl.load(part_max_ptr + row * n_splits + splits, mask=ok, other=float("-inf"))
        weight = tl.exp2(m - top)
        total += weight * tl.load(part_sum_ptr + row * n_splits + splits, mask=ok, other=0.0)
        part = (row * n_splits + splits)[:, None] * HEAD_DIM + dims[None, :]
        acc += weight[:, None] * tl.load(part_acc_ptr + part, mask=ok[:, None] & dim_ok[None, :], other=0.0)
    denominator = tl.sum(total, 0)
    out = tl.sum(acc, 0) / tl.where(denominator > 0, denominator, 1.0)
    out_ptr += batch * out_sb + head * out_sh + token * out_st
    tl.store(out_ptr + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

"""Embedding backward: the dense weight gradient, every row written once, from token rows sorted by id.

    dW[v] = sum_{i : ids[i] = v} dy[i]   (an fp32 sum, rounded once; 0 for v = padding_idx)

``ORDER`` lists the token rows sorted by id, ``BOUNDS[v] .. BOUNDS[v + 1]`` is id ``v``'s run in that order
(``V + 1`` entries, from a binary search of each id in the sorted ids). A program owns ``BLOCK_V`` rows by
``BLOCK_H`` columns of ``dW``: it writes them as zeros, then, if any of its ids occurs, overwrites those
rows with their sums, gathering a run's gradient rows :data:`BLOCK_T` at a time (a long run, such as a
padding token repeated over half the batch, is read as wide tiles, not row by row). No atomics and no
fp32 copy of ``dW``: ``dW`` is written once and ``dy`` read once; for a given launch config the sums'
order, and so their result, is the same on every run.
"""

import triton
import triton.language as tl

BLOCK_T = 16
"""Gradient rows gathered per step of a run (fixed: the configs differ in the blocks of ``dW`` only)."""


@triton.jit
def embedding_bwd_kernel(
    DY, ORDER, BOUNDS, DW, V, H, stride_dy, padding_idx,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    first_row = tl.program_id(0) * BLOCK_V
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    offsets = tl.arange(0, BLOCK_V)
    rows = first_row + offsets
    in_range = rows < V
    tl.store(DW + rows[:, None].to(tl.int64) * H + cols[None, :],
             tl.zeros([BLOCK_V, BLOCK_H], dtype=DW.dtype.element_ty), mask=in_range[:, None] & col_mask[None, :])  # fmt: skip
    starts = tl.load(BOUNDS + rows, mask=in_range, other=0)
    ends = tl.load(BOUNDS + rows + 1, mask=in_range, other=0)
    ends = tl.where(rows == padding_idx, starts, ends)  # the padding row's run counts as empty
    if tl.sum(ends - starts) > 0:
        for r in range(BLOCK_V):
            start = tl.sum(tl.where(offsets == r, starts, 0))
            end = tl.sum(tl.where(offsets == r, ends, 0))
            if start < end:
                acc = tl.zeros([BLOCK_H], dtype=tl.float32)
                for chunk in range(start, end, BLOCK_T):
                    positions = chunk + tl.arange(0, BLOCK_T)
                    valid = positions < end
                    tokens = tl.load(ORDER + positions, mask=valid, other=0)
                    tile = tl.load(DY + tokens[:, None] * stride_dy + cols[None, :],
                                   mask=valid[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
                    acc += tl.sum(tile.to(tl.float32), axis=0)
                tl.store(DW + (first_row + r).to(tl.int64) * H + cols, acc.to(DW.dtype.element_ty), mask=col_mask)


EMBEDDING_BWD_CONFIGS = [
    triton.Config({"BLOCK_V": block_v, "BLOCK_H": block_h, "BLOCK_T": BLOCK_T}, num_warps=warps)
    for block_v, block_h, warps in ((32, 256, 8), (64, 256, 8), (32, 512, 8), (64, 128, 4), (128, 256, 8))
]

embedding_bwd_tuned_kernel = triton.autotune(configs=EMBEDDING_BWD_CONFIGS, key=["V", "H"])(embedding_bwd_kernel)

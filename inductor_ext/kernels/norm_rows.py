"""Row addressing shared by the norm kernels (:mod:`~inductor_ext.kernels.rms_norm`,
:mod:`~inductor_ext.kernels.layer_norm`); device code only.

Both read row-major ``(M, N)`` tensors with a row stride: a block of ``BLOCK_M`` rows with
the whole row in registers (persistent), or one row in ``BLOCK_N``-wide chunks (looped).
Masked-out rows and columns load as zeros.
"""

import triton
import triton.language as tl


@triton.jit
def row_block_mask(rows, col_mask, M):
    """(row_mask, mask, rows64) of a block of row indices: ``row_mask = rows < M``,
    ``mask = row_mask[:, None] & col_mask[None, :]`` and ``rows64``, the rows as an int64 column for offsets."""
    row_mask = rows < M
    return row_mask, row_mask[:, None] & col_mask[None, :], rows[:, None].to(tl.int64)


@triton.jit
def load_bwd_row_block(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M):
    """x, dy (storage dtype) and rstd of a block of rows; rows past M and columns off ``col_mask`` read as zeros."""
    row_mask, mask, rows64 = row_block_mask(rows, col_mask, M)
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return x, dy, rstd


@triton.jit
def load_bwd_row_chunk(
    X, DY, W, row64, stride_x, stride_dy, start, N,
    BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, EVICTION_POLICY: tl.constexpr,
):  # fmt: skip
    """(cols, col_mask, x, dy, w) of columns ``cols = start + [0, BLOCK_N)`` of one row, ``col_mask = cols < N``:
    x and dy loaded with ``EVICTION_POLICY``, and the weight kept in L2 (``evict_last``, it serves every
    row), all converted to fp32; ``w = 1.0`` without ``HAS_WEIGHT``. Masked columns read as zeros."""
    cols = start + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    x = tl.load(X + row64 * stride_x + cols, mask=col_mask, other=0.0, eviction_policy=EVICTION_POLICY)
    dy = tl.load(DY + row64 * stride_dy + cols, mask=col_mask, other=0.0, eviction_policy=EVICTION_POLICY)
    w = 1.0
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    return cols, col_mask, x.to(tl.float32), dy.to(tl.float32), w

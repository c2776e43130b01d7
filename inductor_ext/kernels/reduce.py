"""Column sums of fp32 partials, written in the output's dtype (dW/dB from per-program partial rows)."""

import triton
import triton.language as tl


@triton.jit
def sum_rows_kernel(P, OUT, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[j] = sum_i P[i, j] over the R rows of a contiguous fp32 (R, N) buffer; fixed order, deterministic."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & col_mask[None, :]
        acc += tl.load(P + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


SUM_ROWS_BLOCK_R = 16
SUM_ROWS_BLOCK_N = 128

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


SUM_ROWS_CONFIGS = [
    triton.Config({"BLOCK_R": block_r, "BLOCK_N": block_n}, num_warps=warps)
    for block_r, block_n, warps in ((16, 128, 4), (32, 64, 4), (64, 32, 4), (32, 32, 2), (64, 64, 8))
]
"""Narrow column blocks give more programs: the partials have a few hundred rows (one per backward program)
and a model's width of columns, so 128-column blocks leave most SMs idle at 2048 columns (16 programs)."""

sum_rows_tuned_kernel = triton.autotune(configs=SUM_ROWS_CONFIGS, key=["R", "N"])(sum_rows_kernel)

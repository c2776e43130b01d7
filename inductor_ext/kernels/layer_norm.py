"""LayerNorm Triton kernels (device code only; launch configs from :mod:`inductor_ext.tuning.search_spaces.norm`).

Forward, for each row ``x`` of an ``(M, N)`` input, all in fp32::

    mean = sum(x) / N                          (written to MEAN)
    var  = sum((x - mean)**2) / N              (biased, as torch.nn.functional.layer_norm)
    rstd = 1 / sqrt(var + eps)                 (written to RSTD)
    xhat = (x - mean) * rstd
    y    = xhat * w + b                        (w, b optional; y rounded once to Y's dtype)

Backward, with ``g = dy * w`` (``g = dy`` without weight)::

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)
    db = sum_rows(dy)

``dw`` and ``db`` are reduced deterministically: each program accumulates the
rows it owns in fp32 and writes one partial row to ``DW_PARTIAL[pid, :]`` and
``DB_PARTIAL[pid, :]``; the caller sums the ``(num_programs, N)`` partials. No atomics.
For long rows (``ops.layer_norm.TWO_PASS_BACKWARD_MIN_N``), where a whole row of dw
and db accumulators per program spills, :func:`layer_norm_bwd_kernel` writes dx
only (``PARAM_GRADS=False``) and :func:`layer_norm_bwd_param_grads_kernel` reduces
dw and db over the rows in column tiles, reading x and dy a second time.

Two strategies per kernel, chosen by autotuning among :func:`inductor_ext.tuning.search_spaces.norm.search_space`:

* persistent: the whole row in registers, ``BLOCK_M`` rows per step; the
  statistics are the exact two-pass ones (mean, then centred squares), x is read once.
* looped: the row is walked in ``BLOCK_N`` chunks twice, one row per step. The
  forward's first walk keeps a running mean and sum of squared deviations per
  lane (Welford: lane ``j`` sees ``x[j], x[j + BLOCK_N], ...``), merged across
  lanes with Chan's formula ``M2 = sum(M2_j) + sum(n_j * (mean_j - mean)**2)``;
  unlike ``E[x**2] - mean**2`` this does not cancel when ``|mean| >> std``.
  The second walk writes y. The backward's first walk sums ``g`` and
  ``g * xhat``, the second writes dx and adds into the program's partials.

The forward runs one program per block of rows (per row, looped). The backward
runs a fixed number of programs (``search_spaces.norm.programs_per_sm`` per SM) that
stride over the rows, so each program's partial rows are written once, not once
per row; its persistent variant may prefetch the next row block (``PREFETCH``).
The looped kernels hint that the first walk's loads stay in L2 for the second.
"""

import triton
import triton.language as tl

from inductor_ext.kernels.norm_rows import load_bwd_row_block, load_bwd_row_chunk, row_block_mask
from inductor_ext.tuning.search_spaces.norm import autotune_kwargs


@triton.jit
def _affine(xhat, w, b, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = xhat * w + b in fp32, each term only when present."""
    y = xhat
    if HAS_WEIGHT:
        y = y * w
    if HAS_BIAS:
        y = y + b
    return y


@triton.autotune(**autotune_kwargs(forward=True, key=["N", "HAS_WEIGHT", "HAS_BIAS"], two_reductions=True))
@triton.jit
def layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    stride_x, stride_y, M, N, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """y = (x - mean) * rstd * w + b; mean and rstd = rsqrt(var + eps) per row, in fp32.

    One program per block of BLOCK_M rows (looped: BLOCK_M = 1). PREFETCH is a
    backward knob (configs are shared); the forward ignores it.
    """
    eps = tl.cast(eps, tl.float32)  # Inductor may pass Python floats as fp64
    pid = tl.program_id(0)
    if PERSISTENT:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = 1.0
        b = 0.0
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        if HAS_BIAS:
            b = tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask, mask, rows64 = row_block_mask(rows, col_mask, M)
        # statistics: mean, then the centred sum of squares (padding lanes excluded)
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        # normalise, scale and shift, write back
        y = _affine(xc * rstd[:, None], w, b, HAS_WEIGHT, HAS_BIAS)
        tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(MEAN + rows, mean, mask=row_mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        x_row = X + tl.cast(pid, tl.int64) * stride_x
        y_row = Y + tl.cast(pid, tl.int64) * stride_y
        lanes = tl.arange(0, BLOCK_N)
        # walk 1: per-lane Welford (running mean and sum of squared deviations); x stays in L2 for walk 2
        lane_mean = tl.zeros([BLOCK_N], dtype=tl.float32)
        lane_m2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + lanes
            col_mask = cols < N
            x = tl.load(x_row + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            # values each active lane has seen so far, this one included
            seen = tl.cast(start // BLOCK_N + 1, tl.float32)
            delta = tl.where(col_mask, x - lane_mean, 0.0)
            lane_mean += delta / seen
            lane_m2 += delta * (x - lane_mean)
        # merge the lanes (Chan et al.); lane j took part in every full chunk, and in
        # the last one if j < N % BLOCK_N
        full_chunks = N // BLOCK_N
        lane_count = (full_chunks + (lanes < N - full_chunks * BLOCK_N).to(tl.int32)).to(tl.float32)
        mean = tl.sum(lane_count * lane_mean, axis=0) / N
        spread = lane_mean - mean
        m2 = tl.sum(lane_m2, axis=0) + tl.sum(lane_count * spread * spread, axis=0)
        rstd = tl.math.rsqrt(m2 / N + eps)
        # walk 2: normalise, scale and shift, write back
        for start in range(0, N, BLOCK_N):
            cols = start + lanes
            col_mask = cols < N
            x = tl.load(x_row + cols, mask=col_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w = 1.0
            b = 0.0
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_BIAS:
                b = tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            y = _affine((x - mean) * rstd, w, b, HAS_WEIGHT, HAS_BIAS)
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=col_mask)
        tl.store(MEAN + pid, mean)
        tl.store(RSTD + pid, rstd)


@triton.jit
def _load_bwd_rows(X, DY, MEAN, RSTD, rows, cols, col_mask, stride_x, stride_dy, M):
    """x, dy (storage dtype), mean and rstd of a block of rows; rows past M read as zeros."""
    x, dy, rstd = load_bwd_row_block(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
    mean = tl.load(MEAN + rows, mask=rows < M, other=0.0)
    return x, dy, mean, rstd


@triton.autotune(**autotune_kwargs(forward=False, key=["N", "HAS_WEIGHT", "HAS_BIAS", "PARAM_GRADS"]))
@triton.jit
def layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    stride_dy, stride_x, stride_dx, M, N,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, PARAM_GRADS: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w;
    with ``PARAM_GRADS``: DW_PARTIAL[pid] = sum over own rows of dy * xhat (HAS_WEIGHT),
    DB_PARTIAL[pid] = sum over own rows of dy (HAS_BIAS).

    A fixed grid of programs strides over row blocks, so each keeps one fp32 partial
    row of dw and of db for all its rows. Padding lanes and rows load dy = 0, so they
    add nothing to the sums.
    """
    HAS_WEIGHT_GRAD: tl.constexpr = HAS_WEIGHT and PARAM_GRADS
    HAS_BIAS_GRAD: tl.constexpr = HAS_BIAS and PARAM_GRADS
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dw_row = DW_PARTIAL + tl.cast(pid, tl.int64) * N
    db_row = DB_PARTIAL + tl.cast(pid, tl.int64) * N
    if PERSISTENT:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = 1.0
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        if PREFETCH:
            x_next, dy_next, mean_next, rstd_next = _load_bwd_rows(
                X, DY, MEAN, RSTD, rows, cols, col_mask, stride_x, stride_dy, M
            )
        for _block in tl.range(pid, tl.cdiv(M, BLOCK_M), num_programs):
            if PREFETCH:
                # software pipelining by hand: the next block's loads are issued
                # before this block's reductions, so a program always has a row in flight
                x, dy, mean, rstd = x_next, dy_next, mean_next, rstd_next
                x_next, dy_next, mean_next, rstd_next = _load_bwd_rows(
                    X, DY, MEAN, RSTD, rows + num_programs * BLOCK_M, cols, col_mask, stride_x, stride_dy, M
                )
            else:
                x, dy, mean, rstd = _load_bwd_rows(X, DY, MEAN, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            _row_mask, mask, rows64 = row_block_mask(rows, col_mask, M)
            rows += num_programs * BLOCK_M
            xhat = (x - mean[:, None]) * rstd[:, None]
            g = dy * w if HAS_WEIGHT else dy
            c1 = tl.sum(g * xhat, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
            dx = rstd[:, None] * (g - c2[:, None] - xhat * c1[:, None])
            tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_WEIGHT_GRAD:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if HAS_BIAS_GRAD:
                db_acc += tl.sum(dy, axis=0)
        if HAS_WEIGHT_GRAD:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
        if HAS_BIAS_GRAD:
            tl.store(db_row + cols, db_acc, mask=col_mask)
    else:
        # One row per step and 1-D chunks throughout, so every thread re-reads only
        # the partial elements it wrote itself.
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if HAS_WEIGHT_GRAD:
                tl.store(dw_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
            if HAS_BIAS_GRAD:
                tl.store(db_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
        for row in tl.range(pid, M, num_programs):
            row64 = tl.cast(row, tl.int64)
            mean = tl.load(MEAN + row)
            rstd = tl.load(RSTD + row)
            # walk 1: c1 = mean(g * xhat), c2 = mean(g)
            acc_gxhat = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols, col_mask, x, dy, w = load_bwd_row_chunk(
                    X, DY, W, row64, stride_x, stride_dy, start, N, BLOCK_N, HAS_WEIGHT, "evict_last"
                )
                g = dy * w if HAS_WEIGHT else dy
                acc_gxhat += g * ((x - mean) * rstd)
                acc_g += g
            c1 = tl.sum(acc_gxhat, axis=0) / N
            c2 = tl.sum(acc_g, axis=0) / N
            # walk 2: dx, and dy * xhat, dy into this program's partials (x, dy come back from L2)
            for start in range(0, N, BLOCK_N):
                cols, col_mask, x, dy, w = load_bwd_row_chunk(
                    X, DY, W, row64, stride_x, stride_dy, start, N, BLOCK_N, HAS_WEIGHT, "evict_first"
                )
                xhat = (x - mean) * rstd
                g = dy * w if HAS_WEIGHT else dy
                if HAS_WEIGHT_GRAD:
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + dy * xhat, mask=col_mask)
                if HAS_BIAS_GRAD:
                    db = tl.load(db_row + cols, mask=col_mask, other=0.0)
                    tl.store(db_row + cols, db + dy, mask=col_mask)
                dx = rstd * (g - c2 - xhat * c1)
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_mask)


def _param_grads_configs() -> list[triton.Config]:
    """Column tiles of ``BLOCK_M x BLOCK_N`` with 8 or 16 elements per thread and operand, 4-16 warps,
    rows of 128-256 columns (256-512 contiguous bytes of bf16); 16 per thread and the largest
    tiles first (the most bytes in flight per program: a quick first launch times the first four)."""
    shapes = [(m, n, w) for m in (16, 32, 64) for n in (128, 256) for w in (4, 8, 16)]
    shapes = [(m, n, w) for m, n, w in shapes if m * n // (32 * w) in (8, 16)]
    shapes.sort(key=lambda s: (s[0] * s[1] // (32 * s[2]) != 16, -s[0] * s[1], s[2]))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w) for m, n, w in shapes]


@triton.autotune(configs=_param_grads_configs(), key=["N", "HAS_WEIGHT", "HAS_BIAS"])
@triton.jit
def layer_norm_bwd_param_grads_kernel(
    DY, X, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, stride_dy, stride_x, M, N,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """DW_PARTIAL[group, cols] = sum of dy * xhat and DB_PARTIAL[group, cols] = sum of dy over the
    row blocks ``group, group + groups, ...`` of one ``BLOCK_N``-wide column tile, with
    xhat = (x - MEAN[row]) * RSTD[row] as in the forward.

    Grid ``(cdiv(N, BLOCK_N), groups)``. Each step loads a ``BLOCK_M x BLOCK_N`` tile of x and dy
    and adds it into 2-D fp32 accumulators, reduced over rows once at the end; padding rows and
    columns load dy = 0 and add nothing.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in tl.range(group, tl.cdiv(M, BLOCK_M), groups):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        x, dy, mean, rstd = _load_bwd_rows(X, DY, MEAN, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
        dy = dy.to(tl.float32)
        if HAS_WEIGHT:
            dw_acc += dy * ((x.to(tl.float32) - mean[:, None]) * rstd[:, None])
        if HAS_BIAS:
            db_acc += dy
    out = tl.cast(group, tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + out, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + out, tl.sum(db_acc, axis=0), mask=col_mask)

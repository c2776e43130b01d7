"""RMSNorm Triton kernels (device code and launch configs only; no op registration).

Forward, for each row ``x`` of an ``(M, N)`` input::

    rstd = 1 / sqrt(mean(x**2) + eps)          (fp32, written to RSTD)
    xhat = x * rstd                             (fp32)
    w'   = offset + w                           (fp32; Gemma uses offset=1)
    y    = round_x(xhat) * w'    casting="llama": HF LlamaRMSNorm rounds xhat to x.dtype first
    y    = xhat * w'             casting="gemma": multiply in fp32, round once

Backward, with ``g = dy * w'`` (``g = dy`` without weight)::

    dx = rstd * (g - xhat * mean(g * xhat))
    dw = sum_rows(dy * xhat)

Fused residual add (``HAS_RESIDUAL`` / ``HAS_DRES``, the ``add_rms_norm`` op): the forward
normalises ``h = round_x(x + r)`` instead of x and also writes h (a transformer's residual
stream, ``h = x + attn(x)``, then ``norm(h)``); the backward gets h as its x and adds the
gradient ``dh`` that reached h through its other uses, so the residual branch's gradient
``dx = dh + d norm(h)/dh`` leaves in one write::

    dx = dh + rstd * (g - xhat * mean(g * xhat))

``dw`` is reduced deterministically: each program accumulates the rows it owns in
fp32 and writes one partial row to ``DW_PARTIAL[pid, :]``; the caller sums the
``(num_programs, N)`` partials. No atomics.

Two strategies per kernel, chosen by autotuning among
:func:`inductor_ext.tuning.search_spaces.norm.search_space`:

* persistent: the whole row (``BLOCK_N = next_pow2(N)``) lives in registers,
  ``BLOCK_M`` rows per step; x is read once.
* looped: the row is walked in ``BLOCK_N`` chunks twice (statistics, then
  output), one row per step; used for any N and the only option past
  32768.

The forward runs one program per block of rows (per row, looped). The backward
runs a fixed number of programs (:func:`~inductor_ext.tuning.search_spaces.norm.programs_per_sm` per SM) that stride
over the rows, so each program's dw partial is written once, not once per row.
"""

import triton
import triton.language as tl

from inductor_ext.kernels.norm_rows import load_bwd_row_block, load_bwd_row_chunk, row_block_mask
from inductor_ext.tuning.search_spaces.norm import autotune_kwargs


@triton.jit
def _scale(xhat, w_eff, X_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA_CASTING: tl.constexpr):
    """y (fp32) from xhat (fp32) and w' = offset + w (fp32), following the casting rule."""
    if HAS_WEIGHT:
        if GEMMA_CASTING:
            return xhat * w_eff
        return xhat.to(X_DTYPE).to(tl.float32) * w_eff
    return xhat


@triton.autotune(**autotune_kwargs(forward=True, key=["N", "HAS_WEIGHT", "HAS_RESIDUAL"]))
@triton.jit
def rms_norm_fwd_kernel(
    X, R, W, Y, H, RSTD,
    stride_x, stride_r, stride_y, stride_h, M, N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA_CASTING: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """y = scale(x * rstd), rstd = rsqrt(mean(x**2) + eps); one program per block of BLOCK_M rows.

    HAS_RESIDUAL: x is first replaced by h = round_x(x + r), which is also stored to H.
    PREFETCH is a backward knob (configs are shared); the forward ignores it.
    """
    eps = tl.cast(eps, tl.float32)  # Inductor may pass Python floats as fp64
    offset = tl.cast(offset, tl.float32)
    X_DTYPE: tl.constexpr = X.dtype.element_ty
    pid = tl.program_id(0)
    if PERSISTENT:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_eff = offset
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
            w_eff = w.to(tl.float32)[None, :] + offset
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask, mask, rows64 = row_block_mask(rows, col_mask, M)
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X_DTYPE)
            tl.store(H + rows64 * stride_h + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        y = _scale(x * rstd[:, None], w_eff, X_DTYPE, HAS_WEIGHT, GEMMA_CASTING)
        tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        x_row = X + tl.cast(pid, tl.int64) * stride_x
        y_row = Y + tl.cast(pid, tl.int64) * stride_y
        if HAS_RESIDUAL:
            r_row = R + tl.cast(pid, tl.int64) * stride_r
            h_row = H + tl.cast(pid, tl.int64) * stride_h
            normed_row = h_row  # pass 2 reads back the h this thread wrote in pass 1
        else:
            normed_row = x_row
        # pass 1: sum of squares, chunk by chunk (the row stays in L2 for pass 2)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
            if HAS_RESIDUAL:
                r = tl.load(r_row + cols, mask=cols < N, other=0.0, eviction_policy="evict_first")
                x = (x.to(tl.float32) + r.to(tl.float32)).to(X_DTYPE)
                tl.store(h_row + cols, x, mask=cols < N, eviction_policy="evict_last")
            acc += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
        # pass 2: normalise and write, chunk by chunk
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            x = tl.load(normed_row + cols, mask=col_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w_eff = offset
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
                w_eff = w.to(tl.float32) + offset
            y = _scale(x * rstd, w_eff, X_DTYPE, HAS_WEIGHT, GEMMA_CASTING)
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=col_mask)
        tl.store(RSTD + pid, rstd)


@triton.autotune(**autotune_kwargs(forward=False, key=["N", "HAS_WEIGHT", "HAS_DRES"]))
@triton.jit
def rms_norm_bwd_kernel(
    DY, X, DRES, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dres, stride_dx, M, N, offset,
    HAS_DRES: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA_CASTING: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w'; DW_PARTIAL[pid] = sum over own rows of dy * xhat.

    HAS_DRES: DRES (the gradient that reached x through its other uses) is added to dx.
    A fixed grid of programs strides over row blocks, so each keeps one fp32 dw
    partial for all its rows. Under "llama" casting
    the weight multiplies the rounded xhat; its gradient uses the unrounded one,
    the float64 reference's value.
    """
    offset = tl.cast(offset, tl.float32)
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(M, BLOCK_M)
    dw_row = DW_PARTIAL + tl.cast(pid, tl.int64) * N
    if PERSISTENT:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_eff = offset
        if HAS_WEIGHT:
            w_eff = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] + offset
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        if PREFETCH:
            x_next, dy_next, rstd_next = load_bwd_row_block(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
        for _block in tl.range(pid, num_blocks, num_programs):
            if PREFETCH:
                # software pipelining by hand: the next block's loads are issued
                # before this block's reductions, so a program always has a row in flight
                x, dy, rstd = x_next, dy_next, rstd_next
                x_next, dy_next, rstd_next = load_bwd_row_block(
                    X, DY, RSTD, rows + num_programs * BLOCK_M, cols, col_mask, stride_x, stride_dy, M
                )
            else:
                x, dy, rstd = load_bwd_row_block(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            _row_mask, mask, rows64 = row_block_mask(rows, col_mask, M)
            rows += num_programs * BLOCK_M
            xhat = x * rstd[:, None]
            g = dy * w_eff if HAS_WEIGHT else dy
            c1 = tl.sum(g * xhat, axis=1) / N
            dx = rstd[:, None] * (g - xhat * c1[:, None])
            if HAS_DRES:
                dx += tl.load(DRES + rows64 * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_WEIGHT:
                dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_WEIGHT:
            tl.store(dw_row + cols, dw_acc, mask=col_mask)
    else:
        # One row per step and 1-D chunks throughout, so every thread re-reads only
        # the dw partial elements it wrote itself.
        if HAS_WEIGHT:
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                tl.store(dw_row + cols, tl.zeros([BLOCK_N], dtype=tl.float32), mask=cols < N)
        for row in tl.range(pid, M, num_programs):
            row64 = tl.cast(row, tl.int64)
            rstd = tl.load(RSTD + row)
            # pass 1: c1 = mean(g * xhat)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols, col_mask, x, dy, w = load_bwd_row_chunk(
                    X, DY, W, row64, stride_x, stride_dy, start, N, BLOCK_N, HAS_WEIGHT, "evict_last"
                )
                g = dy * (w + offset) if HAS_WEIGHT else dy
                acc += g * x * rstd
            c1 = tl.sum(acc, axis=0) / N
            # pass 2: dx, and dy * xhat into this program's dw partial (x, dy come back from L2)
            for start in range(0, N, BLOCK_N):
                cols, col_mask, x, dy, w = load_bwd_row_chunk(
                    X, DY, W, row64, stride_x, stride_dy, start, N, BLOCK_N, HAS_WEIGHT, "evict_first"
                )
                xhat = x * rstd
                g = dy * (w + offset) if HAS_WEIGHT else dy
                if HAS_WEIGHT:
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + dy * xhat, mask=col_mask)
                dx = rstd * (g - xhat * c1)
                if HAS_DRES:
                    dres = tl.load(
                        DRES + row64 * stride_dres + cols, mask=col_mask, other=0.0, eviction_policy="evict_first"
                    )
                    dx += dres.to(tl.float32)
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_mask)

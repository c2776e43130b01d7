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

``dw`` is reduced deterministically: each program accumulates the rows it owns in
fp32 and writes one partial row to ``DW_PARTIAL[pid, :]``; the caller sums the
``(num_programs, N)`` partials. No atomics.

Two strategies per kernel, chosen by autotuning among :func:`search_space`:

* persistent: the whole row (``BLOCK_N = next_pow2(N)``) lives in registers,
  ``BLOCK_M`` rows per step; x is read once.
* looped: the row is walked in ``BLOCK_N`` chunks twice (statistics, then
  output), one row per step; used for any N and the only option past
  ``MAX_PERSISTENT_BLOCK`` (N > 32768).

The forward runs one program per block of rows (per row, looped). The backward
runs a fixed number of programs (:func:`programs_per_sm` per SM) that stride
over the rows, so each program's dw partial is written once, not once per row.
"""

import dataclasses

import triton
import triton.language as tl

MAX_PERSISTENT_BLOCK = 32768
"""Largest power-of-two row held in registers (fp32, 32 warps: 32 values per thread and operand)."""


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """One launch configuration of an RMSNorm kernel."""

    persistent: bool
    block_m: int
    block_n: int
    num_warps: int
    prefetch: bool = False
    """Backward, persistent: load the next row block before reducing this one (more
    bytes in flight per program, more registers)."""

    def to_triton(self) -> triton.Config:
        kwargs = {"PERSISTENT": self.persistent, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        return triton.Config({**kwargs, "PREFETCH": self.prefetch}, num_warps=self.num_warps)

    @classmethod
    def from_triton(cls, config: triton.Config) -> "RMSNormConfig":
        kw = config.kwargs
        return cls(bool(kw["PERSISTENT"]), kw["BLOCK_M"], kw["BLOCK_N"], config.num_warps, bool(kw["PREFETCH"]))


def search_space(n: int, forward: bool = True) -> list[RMSNormConfig]:
    """Every config valid for rows of ``n`` elements, the heuristic's favourite first.

    Persistent (rows up to ``MAX_PERSISTENT_BLOCK``): 1-8 rows per step, 8-32 fp32
    values per thread and operand; the backward tries each with and without prefetching.
    Looped (rows longer than 2048): 2048- and 4096-element chunks (also 1024 past
    ``MAX_PERSISTENT_BLOCK``), 8 or 16 warps. (Pipeline depth 1 vs 3 and, in the forward,
    grid-stride vs one program per row block were measured on the H200 and dropped:
    the first made no difference, the second always lost.)
    """
    block = triton.next_power_of_2(max(n, 1))
    persistent = []
    if block <= MAX_PERSISTENT_BLOCK:
        for block_m in (1, 2, 4, 8):
            tile = block_m * block
            if block_m > 1 and tile > 16384:
                continue
            for num_warps in (1, 2, 4, 8, 16, 32):
                per_thread = tile // (32 * num_warps)
                if 8 <= per_thread <= 32 or (num_warps == 1 and per_thread < 8):
                    persistent.append(RMSNormConfig(True, block_m, block, num_warps))
        if not forward:
            persistent += [dataclasses.replace(c, prefetch=True) for c in persistent]
    chunks = (2048, 4096) if block <= MAX_PERSISTENT_BLOCK else (1024, 2048, 4096)
    looped = [RMSNormConfig(False, 1, chunk, num_warps) for chunk in chunks if chunk < block for num_warps in (8, 16)]
    return sorted(persistent + looped, key=lambda c: _heuristic_rank(c, block))


def _heuristic_rank(config: RMSNormConfig, block: int) -> tuple[int, int, int, int]:
    """Prefer persistent, ~16 values per thread, rows of at least 2 KiB per step, no prefetch."""
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    rows_wanted = max(1, 2048 // block)
    return (not config.persistent, abs(per_thread - 16), abs(config.block_m - rows_wanted), config.prefetch)


def programs_per_sm(n: int) -> int:
    """Programs per SM of the grid-stride launches: 4 for short rows, 2 at 4096 elements,
    1 from 8192 (fastest backward on the H200 at 2048-16384, docs/benchmarks.md); fewer
    programs also mean fewer fp32 dw partial rows (programs x N) to write and reduce."""
    return max(1, min(4, 8192 // max(n, 1)))


def heuristic(n: int, forward: bool = True) -> RMSNormConfig:
    return search_space(n, forward)[0]


def _all_configs() -> list[triton.Config]:
    seen: dict[RMSNormConfig, None] = {}
    for log2 in range(18):
        for forward in (True, False):
            seen.update(dict.fromkeys(search_space(2**log2, forward)))
    return [c.to_triton() for c in seen]


def _prune_fwd(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    valid = set(search_space(named_args["N"], forward=True))
    return [c for c in configs if RMSNormConfig.from_triton(c) in valid]


def _prune_bwd(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    valid = set(search_space(named_args["N"], forward=False))
    return [c for c in configs if RMSNormConfig.from_triton(c) in valid]


def _autotune(prune: object) -> dict[str, object]:
    return {"configs": _all_configs(), "key": ["N", "HAS_WEIGHT"], "prune_configs_by": {"early_config_prune": prune}}


@triton.jit
def _scale(xhat, w_eff, X_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, GEMMA_CASTING: tl.constexpr):
    """y (fp32) from xhat (fp32) and w' = offset + w (fp32), following the casting rule."""
    if HAS_WEIGHT:
        if GEMMA_CASTING:
            return xhat * w_eff
        return xhat.to(X_DTYPE).to(tl.float32) * w_eff
    return xhat


@triton.autotune(**_autotune(_prune_fwd))
@triton.jit
def rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    stride_x, stride_y, M, N, eps, offset,
    HAS_WEIGHT: tl.constexpr, GEMMA_CASTING: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """y = scale(x * rstd), rstd = rsqrt(mean(x**2) + eps); one program per block of BLOCK_M rows.

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
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows[:, None].to(tl.int64)
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        y = _scale(x * rstd[:, None], w_eff, X_DTYPE, HAS_WEIGHT, GEMMA_CASTING)
        tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        x_row = X + tl.cast(pid, tl.int64) * stride_x
        y_row = Y + tl.cast(pid, tl.int64) * stride_y
        # pass 1: sum of squares, chunk by chunk (x stays in L2 for pass 2)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
            acc += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
        # pass 2: normalise and write, chunk by chunk
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            x = tl.load(x_row + cols, mask=col_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w_eff = offset
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
                w_eff = w.to(tl.float32) + offset
            y = _scale(x * rstd, w_eff, X_DTYPE, HAS_WEIGHT, GEMMA_CASTING)
            tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=col_mask)
        tl.store(RSTD + pid, rstd)


@triton.jit
def _load_bwd_rows(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M):
    """x, dy (storage dtype) and rstd of a block of rows; rows past M read as zeros."""
    row_mask = rows < M
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows[:, None].to(tl.int64)
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    return x, dy, rstd


@triton.autotune(**_autotune(_prune_bwd))
@triton.jit
def rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx, M, N, offset,
    HAS_WEIGHT: tl.constexpr, GEMMA_CASTING: tl.constexpr,
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w'; DW_PARTIAL[pid] = sum over own rows of dy * xhat.

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
            x_next, dy_next, rstd_next = _load_bwd_rows(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
        for block in tl.range(pid, num_blocks, num_programs):
            if PREFETCH:
                # software pipelining by hand: the next block's loads are issued
                # before this block's reductions, so a program always has a row in flight
                x, dy, rstd = x_next, dy_next, rstd_next
                x_next, dy_next, rstd_next = _load_bwd_rows(
                    X, DY, RSTD, rows + num_programs * BLOCK_M, cols, col_mask, stride_x, stride_dy, M
                )
            else:
                x, dy, rstd = _load_bwd_rows(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
            x = x.to(tl.float32)
            dy = dy.to(tl.float32)
            row_mask = rows < M
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows[:, None].to(tl.int64)
            rows += num_programs * BLOCK_M
            xhat = x * rstd[:, None]
            g = dy * w_eff if HAS_WEIGHT else dy
            c1 = tl.sum(g * xhat, axis=1) / N
            dx = rstd[:, None] * (g - xhat * c1[:, None])
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
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                x = tl.load(X + row64 * stride_x + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
                dy = tl.load(DY + row64 * stride_dy + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
                x = x.to(tl.float32)
                dy = dy.to(tl.float32)
                g = dy
                if HAS_WEIGHT:
                    w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
                    g = dy * (w.to(tl.float32) + offset)
                acc += g * x * rstd
            c1 = tl.sum(acc, axis=0) / N
            # pass 2: dx, and dy * xhat into this program's dw partial (x, dy come back from L2)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                x = tl.load(X + row64 * stride_x + cols, mask=col_mask, other=0.0, eviction_policy="evict_first")
                dy = tl.load(DY + row64 * stride_dy + cols, mask=col_mask, other=0.0, eviction_policy="evict_first")
                x = x.to(tl.float32)
                dy = dy.to(tl.float32)
                xhat = x * rstd
                g = dy
                if HAS_WEIGHT:
                    w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
                    g = dy * (w.to(tl.float32) + offset)
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + dy * xhat, mask=col_mask)
                dx = rstd * (g - xhat * c1)
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_mask)

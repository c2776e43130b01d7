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

Both kernels run a fixed number of programs (a few per SM) that stride over
the rows, so per-program state (the weight, the dw partial) is loaded or
written once per program rather than once per row.
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
    grid_stride: bool = True
    """A fixed grid of programs striding over row blocks (always, in the backward), or
    one program per row block (forward only: the hardware schedules blocks dynamically)."""

    def to_triton(self) -> triton.Config:
        kwargs = {"PERSISTENT": self.persistent, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        return triton.Config({**kwargs, "GRID_STRIDE": self.grid_stride}, num_warps=self.num_warps)

    @classmethod
    def from_triton(cls, config: triton.Config) -> "RMSNormConfig":
        kw = config.kwargs
        return cls(bool(kw["PERSISTENT"]), kw["BLOCK_M"], kw["BLOCK_N"], config.num_warps, bool(kw["GRID_STRIDE"]))


def search_space(n: int, forward: bool = True) -> list[RMSNormConfig]:
    """Every config valid for rows of ``n`` elements, the heuristic's favourite first.

    Persistent: 1-8 rows per step, 8-32 fp32 values per thread and operand.
    Looped: 1024-4096-element chunks (only the two larger ones, 8 warps, where a
    persistent config exists too, to keep compile-time autotuning short).
    The forward also tries each with one program per row block instead of a grid-stride loop.
    """
    block = triton.next_power_of_2(max(n, 1))
    configs = []
    if block <= MAX_PERSISTENT_BLOCK:
        for block_m in (1, 2, 4, 8):
            tile = block_m * block
            if block_m > 1 and tile > 16384:
                continue
            for num_warps in (1, 2, 4, 8, 16, 32):
                per_thread = tile // (32 * num_warps)
                if 8 <= per_thread <= 32 or (num_warps == 1 and per_thread < 8):
                    configs.append(RMSNormConfig(True, block_m, block, num_warps))
        looped = [RMSNormConfig(False, 1, chunk, 8) for chunk in (2048, 4096)]
    else:
        looped = [RMSNormConfig(False, 1, chunk, w) for chunk in (1024, 2048, 4096) for w in (4, 8)]
    configs.extend(c for c in looped if c.block_n < block)
    if forward:
        configs.extend(dataclasses.replace(c, grid_stride=False) for c in list(configs))
    configs.sort(key=lambda c: _heuristic_rank(c, block))
    return configs


def _heuristic_rank(config: RMSNormConfig, block: int) -> tuple[int, int, int, int]:
    """Prefer persistent, ~16 values per thread, rows of at least 2 KiB per step, grid-stride."""
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    rows_wanted = max(1, 2048 // block)
    return (not config.persistent, abs(per_thread - 16), abs(config.block_m - rows_wanted), not config.grid_stride)


def heuristic(n: int, forward: bool = True) -> RMSNormConfig:
    return search_space(n, forward)[0]


def _all_configs() -> list[triton.Config]:
    seen: dict[RMSNormConfig, None] = {}
    for log2 in range(0, 18):
        seen.update(dict.fromkeys(search_space(2**log2)))
    return [c.to_triton() for c in seen]


def _prune_fwd(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    valid = set(search_space(named_args["N"], forward=True))
    return [c for c in configs if RMSNormConfig.from_triton(c) in valid]


def _prune_bwd(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    valid = set(search_space(named_args["N"], forward=False))
    return [c for c in configs if RMSNormConfig.from_triton(c) in valid]


def _autotune(prune: object) -> dict[str, object]:
    return dict(configs=_all_configs(), key=["N", "HAS_WEIGHT"], prune_configs_by={"early_config_prune": prune})


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
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRID_STRIDE: tl.constexpr,
):  # fmt: skip
    """y = scale(x * rstd), rstd = rsqrt(mean(x**2) + eps).

    Programs stride over blocks of BLOCK_M rows. With GRID_STRIDE the launcher
    starts a fixed number of programs, so each loads the weight once for many
    rows; without it, one program per block (the loop runs once).
    """
    eps = tl.cast(eps, tl.float32)  # Inductor may pass Python floats as fp64
    offset = tl.cast(offset, tl.float32)
    X_DTYPE: tl.constexpr = X.dtype.element_ty
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(M, BLOCK_M)
    if PERSISTENT:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_eff = offset
        if HAS_WEIGHT:
            w_eff = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] + offset
        for block in tl.range(pid, num_blocks, num_programs):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows[:, None].to(tl.int64)
            x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
            y = _scale(x * rstd[:, None], w_eff, X_DTYPE, HAS_WEIGHT, GEMMA_CASTING)
            tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
            tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        for row in tl.range(pid, M, num_programs):
            x_row = X + tl.cast(row, tl.int64) * stride_x
            y_row = Y + tl.cast(row, tl.int64) * stride_y
            # pass 1: sum of squares, chunk by chunk
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
                acc += x * x
            rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
            # pass 2: normalise and write, chunk by chunk
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                x = tl.load(x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
                w_eff = offset
                if HAS_WEIGHT:
                    w_eff = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
                y = _scale(x * rstd, w_eff, X_DTYPE, HAS_WEIGHT, GEMMA_CASTING)
                tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=col_mask)
            tl.store(RSTD + row, rstd)


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
    PERSISTENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GRID_STRIDE: tl.constexpr,
):  # fmt: skip
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w'; DW_PARTIAL[pid] = sum over own rows of dy * xhat.

    Programs stride over row blocks (grid = a fixed number of programs, whatever
    GRID_STRIDE says), so each keeps one fp32 dw partial for all its rows. Under "llama" casting
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
        # Software pipelining by hand: the next block's loads are issued before this
        # block's reductions, so a program always has a row in flight.
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        x_next, dy_next, rstd_next = _load_bwd_rows(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
        for block in tl.range(pid, num_blocks, num_programs):
            x = x_next.to(tl.float32)
            dy = dy_next.to(tl.float32)
            rstd = rstd_next
            row_mask = rows < M
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows[:, None].to(tl.int64)
            rows += num_programs * BLOCK_M
            x_next, dy_next, rstd_next = _load_bwd_rows(X, DY, RSTD, rows, cols, col_mask, stride_x, stride_dy, M)
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
                x = tl.load(X + row64 * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * stride_dy + cols, mask=col_mask, other=0.0).to(tl.float32)
                g = dy
                if HAS_WEIGHT:
                    g = dy * (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)
                acc += g * x * rstd
            c1 = tl.sum(acc, axis=0) / N
            # pass 2: dx, and dy * xhat into this program's dw partial
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                x = tl.load(X + row64 * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row64 * stride_dy + cols, mask=col_mask, other=0.0).to(tl.float32)
                xhat = x * rstd
                g = dy
                if HAS_WEIGHT:
                    g = dy * (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset)
                    dw = tl.load(dw_row + cols, mask=col_mask, other=0.0)
                    tl.store(dw_row + cols, dw + dy * xhat, mask=col_mask)
                dx = rstd * (g - xhat * c1)
                tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_mask)

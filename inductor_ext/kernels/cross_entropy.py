"""Cross-entropy Triton kernels (device code and launch configs only; no op registration).

Forward, for each row ``x`` of ``(N, V)`` logits with label ``y`` (all math in fp32)::

    z    = cap * tanh(x / cap)           softcap > 0 (else z = x)
    lse  = log(sum_j exp(z_j))           online max / sum-exp over V chunks
    loss = lse - (1 - eps) * z_y - eps / V * sum_j z_j + s * lse**2
                                         eps = label_smoothing, s = lse_square_scale (z-loss)
    dz_j = exp(z_j - lse) * (1 + 2 * s * lse) - eps / V - (1 - eps) * [j == y]
    dx_j = dz_j * (1 - (z_j / cap)**2)   softcap > 0 (else dx = dz)
    dx  *= grad_scale                    grad_output, times 1 / (non-ignored count) for "mean"

:data:`cross_entropy_fwd_kernel` writes ``loss`` (fp32, per row) and, as asked,
``lse`` (fp32, per row) and/or ``dx`` (logits' dtype). The cross-entropy op stores
``lse`` and leaves the gradient to :func:`cross_entropy_bwd_kernel`, which knows
``grad_output`` and reads each row once more: three passes over the logits in all
(read, read, write), each gradient rounded once. Fused linear cross-entropy, whose
chunk logits are its own buffers, has the forward write ``dx`` over them
(:data:`cross_entropy_fwd_inplace_kernel`). Rows whose label is ``ignore_index``
get ``loss = 0`` and ``dx = 0``. A label outside ``[0, V)`` (other than
``ignore_index``) is never used as an address: its row gets ``loss = NaN`` and the
gradient without the target term.

Two strategies, chosen by autotuning among :func:`search_space`:

* persistent: the whole row (``BLOCK_V = next_pow2(V)``, at most
  ``MAX_PERSISTENT_BLOCK``) is loaded once into registers; one read, one write.
* looped: the row is walked in ``BLOCK_V`` chunks twice. Pass 1 keeps, per lane,
  a running max ``m`` and a running sum ``s`` of ``exp(z - m)`` with one ``exp`` per
  element (``e = exp(-|z - m|)``: a new maximum rescales ``s`` by ``e``, otherwise
  ``e`` is added), then combines the lanes. Pass 2 re-reads the row (mostly from
  L2) and writes the gradient. Any V (tested to 262144).

One program per row in the forward. The backward has no reduction left: a 2-D grid
of (row, ``BLOCK_V`` chunk) programs (:func:`bwd_search_space`).
"""

import dataclasses

import triton
import triton.language as tl

from inductor_ext.tuning.search_spaces.order import in_search_order

MAX_PERSISTENT_BLOCK = 16384
"""Largest power-of-two row held in registers (fp32, 32 warps: 16 values per thread).

ptxas (sm_90, Triton 3.6) puts 32 values per thread at 150-180 registers, or spills
them under the 64-128 register cap of 16-32 warps; 16 values stay at 40-100."""

LOOPED_BLOCKS = (2048, 4096, 8192)
"""(16384 would need 32 warps for 16 values per thread, where the 64-register cap spills.)"""
LOOPED_WARPS = (4, 8, 16, 32)

SCALE_BLOCK = 2048
"""Columns per program of :func:`scale_rows_kernel` (4 warps: 16 values per thread)."""


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    """One launch configuration of the cross-entropy forward kernels."""

    persistent: bool
    block_v: int
    num_warps: int

    def to_triton(self) -> triton.Config:
        return triton.Config({"PERSISTENT": self.persistent, "BLOCK_V": self.block_v}, num_warps=self.num_warps)

    @classmethod
    def from_triton(cls, config: triton.Config) -> "CrossEntropyConfig":
        kw = config.kwargs
        return cls(bool(kw["PERSISTENT"]), kw["BLOCK_V"], config.num_warps)


def _per_thread_ok(block: int, num_warps: int) -> bool:
    per_thread = block // (32 * num_warps)
    return 8 <= per_thread <= 16 or (num_warps == 1 and per_thread < 8)


def search_space(v: int) -> list[CrossEntropyConfig]:
    """Every config valid for rows of ``v`` classes, the heuristic's favourite first
    (:func:`_heuristic_rank`).

    Persistent (row in registers) when ``next_pow2(v) <= MAX_PERSISTENT_BLOCK``, with
    8-16 fp32 values per thread. Looped: chunks of 2048-8192 classes smaller than the
    row, 4-32 warps, 8-16 values per thread.
    """
    block = triton.next_power_of_2(max(v, 1))
    configs = []
    if block <= MAX_PERSISTENT_BLOCK:
        configs += [CrossEntropyConfig(True, block, w) for w in (1, 2, 4, 8, 16, 32) if _per_thread_ok(block, w)]
    configs += [
        CrossEntropyConfig(False, b, w)
        for b in LOOPED_BLOCKS
        for w in LOOPED_WARPS
        if b < block and _per_thread_ok(b, w)
    ]
    configs.sort(key=_heuristic_rank)
    return configs


def _heuristic_rank(config: CrossEntropyConfig) -> tuple[int, int, int]:
    """Prefer persistent; then, persistent, 16 values per thread; looped, the smallest chunks first
    (the most rows in flight per SM), 16 values per thread before 8.

    The looped order puts first the configs a full timing of every config picks (2048-element chunks
    on 8 warps at V = 32000 and 128256): a quick first launch times only the first four.
    """
    per_thread = config.block_v // (32 * config.num_warps)
    if config.persistent:
        return (0, abs(per_thread - 16), -config.block_v)
    return (1, config.block_v, abs(per_thread - 16))


def heuristic(v: int) -> CrossEntropyConfig:
    return search_space(v)[0]


def _all_configs() -> list[triton.Config]:
    seen: dict[CrossEntropyConfig, None] = {}
    for log2 in range(20):
        seen.update(dict.fromkeys(search_space(2**log2)))
    return [c.to_triton() for c in seen]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    return in_search_order(configs, search_space(named_args["V"]), CrossEntropyConfig.from_triton)


@triton.jit
def _softcap(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """(z, t): z = softcap * t with t = tanh(x / softcap), or (x, x) without softcap."""
    if HAS_SOFTCAP:
        t = 1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0)
        z = softcap * t
    else:
        t = x
        z = x
    return z, t


@triton.jit
def _grad(z, t, cols, label, lse, z_coef, smooth_each, target_weight, scale, HAS_SOFTCAP: tl.constexpr):
    """dx for one chunk: (exp(z - lse) * z_coef - eps/V - (1-eps)[j == y]) * (1 - t**2) * scale."""
    g = tl.exp(z - lse) * z_coef - smooth_each - tl.where(cols == label, target_weight, 0.0)
    if HAS_SOFTCAP:
        g = g * (1.0 - t * t)
    return g * scale


@triton.jit
def _cross_entropy_row(
    LOGITS, DLOGITS, LOSS, LSE, LABELS, GRAD_SCALE,
    row, stride_logits, stride_dlogits, stride_scale, V,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_GRAD_SCALE: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, STORE_LSE: tl.constexpr, PERSISTENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Loss (and gradient) of one row; see the module docstring for the math.

    The sum of the logits is taken only with label smoothing (HAS_SMOOTHING): without
    it a ``-inf`` logit would make the unused term ``0 * -inf = NaN``.
    """
    label_smoothing = tl.cast(label_smoothing, tl.float32)  # Inductor may pass Python floats as fp64
    lse_square_scale = tl.cast(lse_square_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    x_row = LOGITS + tl.cast(row, tl.int64) * stride_logits
    label = tl.load(LABELS + row).to(tl.int64)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        if STORE_LSE:
            tl.store(LSE + row, 0.0)
        if COMPUTE_GRAD:
            dx_row = DLOGITS + tl.cast(row, tl.int64) * stride_dlogits
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                tl.store(dx_row + cols, tl.zeros([BLOCK_V], tl.float32).to(DLOGITS.dtype.element_ty), mask=cols < V)
    else:
        in_range = (label >= 0) & (label < V)
        # the target logit, read before the gradient may overwrite the row
        x_y = tl.load(x_row + tl.where(in_range, label, 0)).to(tl.float32)
        z_y, _t_y = _softcap(x_y, softcap, HAS_SOFTCAP)
        if PERSISTENT:
            cols = tl.arange(0, BLOCK_V)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            z, t = _softcap(x, softcap, HAS_SOFTCAP)
            z = tl.where(mask, z, float("-inf"))
            z_max = tl.max(z, axis=0)
            lse = z_max + tl.log(tl.sum(tl.exp(z - z_max), axis=0))
            z_sum = 0.0
            if HAS_SMOOTHING:
                z_sum = tl.sum(tl.where(mask, z, 0.0), axis=0)
        else:
            # pass 1: per-lane running max and sum of exp(z - max), one exp per element
            m = tl.full([BLOCK_V], -3.0e38, tl.float32)
            s = tl.zeros([BLOCK_V], tl.float32)
            z_acc = tl.zeros([BLOCK_V], tl.float32)  # only with HAS_SMOOTHING
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                mask = cols < V
                # keep the row in L2 for pass 2
                x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                z, _t = _softcap(x, softcap, HAS_SOFTCAP)
                z = tl.where(mask, z, float("-inf"))
                d = z - m
                e = tl.exp(-tl.abs(d))
                bigger = d > 0
                s = tl.where(bigger, s * e + 1.0, s + e)
                m = tl.where(bigger, z, m)
                if HAS_SMOOTHING:
                    z_acc += tl.where(mask, z, 0.0)
            z_max = tl.max(m, axis=0)
            lse = z_max + tl.log(tl.sum(s * tl.exp(m - z_max), axis=0))
            z_sum = tl.sum(z_acc, axis=0)
        loss = lse - (1.0 - label_smoothing) * z_y + lse_square_scale * lse * lse
        if HAS_SMOOTHING:
            loss -= label_smoothing / V * z_sum
        tl.store(LOSS + row, tl.where(in_range, loss, float("nan")))
        if STORE_LSE:
            tl.store(LSE + row, lse)
        if COMPUTE_GRAD:
            dx_row = DLOGITS + tl.cast(row, tl.int64) * stride_dlogits
            scale = 1.0
            if HAS_GRAD_SCALE:
                scale = tl.load(GRAD_SCALE + tl.cast(row, tl.int64) * stride_scale).to(tl.float32)
            z_coef = 1.0 + 2.0 * lse_square_scale * lse
            smooth_each = label_smoothing / V
            target_weight = tl.where(in_range, 1.0 - label_smoothing, 0.0)
            if PERSISTENT:
                g = _grad(z, t, cols, label, lse, z_coef, smooth_each, target_weight, scale, HAS_SOFTCAP)
                tl.store(dx_row + cols, g.to(DLOGITS.dtype.element_ty), mask=mask)
            else:
                # pass 2: re-read each chunk and write its gradient
                for start in range(0, V, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    mask = cols < V
                    x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                    z, t = _softcap(x, softcap, HAS_SOFTCAP)
                    g = _grad(z, t, cols, label, lse, z_coef, smooth_each, target_weight, scale, HAS_SOFTCAP)
                    tl.store(dx_row + cols, g.to(DLOGITS.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_fwd(
    LOGITS, DLOGITS, LOSS, LSE, LABELS, GRAD_SCALE,
    stride_logits, stride_dlogits, stride_scale, V,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_GRAD_SCALE: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, STORE_LSE: tl.constexpr, PERSISTENT: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One program per row: LOSS[row], (STORE_LSE) LSE[row] and (COMPUTE_GRAD) DLOGITS[row, :] from LOGITS[row, :].

    Each element is read (both passes) before the same thread writes its gradient, and the
    target logit is read first, so DLOGITS may be LOGITS.
    """
    _cross_entropy_row(
        LOGITS, DLOGITS, LOSS, LSE, LABELS, GRAD_SCALE,
        tl.program_id(0), stride_logits, stride_dlogits, stride_scale, V,
        ignore_index, label_smoothing, lse_square_scale, softcap,
        HAS_GRAD_SCALE, HAS_SMOOTHING, HAS_SOFTCAP, COMPUTE_GRAD, STORE_LSE, PERSISTENT, BLOCK_V,
    )  # fmt: skip


_FWD_AUTOTUNE = {"configs": _all_configs(), "key": ["V"], "prune_configs_by": {"early_config_prune": _prune}}
cross_entropy_fwd_kernel = triton.autotune(**_FWD_AUTOTUNE)(_cross_entropy_fwd)
"""Writes the gradient, if any, to its own buffer."""

cross_entropy_fwd_inplace_kernel = triton.autotune(**_FWD_AUTOTUNE, restore_value=["DLOGITS"])(_cross_entropy_fwd)
"""DLOGITS is LOGITS: the gradient replaces the logits (the autotuner restores them after each timed run)."""


BWD_CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))
"""(BLOCK_V, num_warps) of the backward: 8-16 fp32 values per thread."""


def bwd_search_space(v: int) -> list[triton.Config]:
    """Backward configs for rows of ``v`` classes: chunks no wider than the row (1024 at least)."""
    widest = max(1024, triton.next_power_of_2(max(v, 1)))
    return [triton.Config({"BLOCK_V": b}, num_warps=w) for b, w in BWD_CONFIGS if b <= widest]


def _bwd_prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    return in_search_order(configs, [_bwd_key(c) for c in bwd_search_space(named_args["V"])], _bwd_key)


def _bwd_key(config: triton.Config) -> tuple[int, int]:
    return config.kwargs["BLOCK_V"], config.num_warps


@triton.jit
def _cross_entropy_bwd(
    LOGITS, DLOGITS, LSE, LABELS, GRAD_SCALE,
    stride_logits, stride_dlogits, stride_scale, V,
    ignore_index, label_smoothing, lse_square_scale, softcap,
    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): DLOGITS[row, chunk] = dx (module docstring) from LOGITS, LSE[row] and
    GRAD_SCALE[row * stride_scale] (stride 0: one scalar); zeros for an ignored row, which reads no logits.

    Each element is read before the same thread writes it, so DLOGITS may be LOGITS.
    """
    label_smoothing = tl.cast(label_smoothing, tl.float32)  # Inductor may pass Python floats as fp64
    lse_square_scale = tl.cast(lse_square_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    dx_row = DLOGITS + row * stride_dlogits
    label = tl.load(LABELS + row).to(tl.int64)
    if label == ignore_index:
        tl.store(dx_row + cols, tl.zeros([BLOCK_V], tl.float32).to(DLOGITS.dtype.element_ty), mask=mask)
    else:
        in_range = (label >= 0) & (label < V)
        lse = tl.load(LSE + row)
        scale = tl.load(GRAD_SCALE + row * stride_scale).to(tl.float32)
        x = tl.load(LOGITS + row * stride_logits + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        z, t = _softcap(x.to(tl.float32), softcap, HAS_SOFTCAP)
        z_coef = 1.0 + 2.0 * lse_square_scale * lse
        target_weight = tl.where(in_range, 1.0 - label_smoothing, 0.0)
        g = _grad(z, t, cols, label, lse, z_coef, label_smoothing / V, target_weight, scale, HAS_SOFTCAP)
        tl.store(dx_row + cols, g.to(DLOGITS.dtype.element_ty), mask=mask)


_BWD_AUTOTUNE = {
    "configs": bwd_search_space(2**20),
    "key": ["V"],
    "prune_configs_by": {"early_config_prune": _bwd_prune},
}
cross_entropy_bwd_kernel = triton.autotune(**_BWD_AUTOTUNE)(_cross_entropy_bwd)
"""Writes the gradient to its own buffer. Grid ``(N, cdiv(V, BLOCK_V))``."""

cross_entropy_bwd_inplace_kernel = triton.autotune(**_BWD_AUTOTUNE, restore_value=["DLOGITS"])(_cross_entropy_bwd)
"""DLOGITS is LOGITS: the gradient replaces the logits (the autotuner restores them after each timed run)."""


@triton.jit
def scale_rows_kernel(X, OUT, SCALE, stride_x, stride_out, stride_scale, V, BLOCK_V: tl.constexpr):
    """OUT[r, :] = X[r, :] * SCALE[r * stride_scale] in fp32, rounded once (stride_scale=0: one scalar).

    Grid: (rows * cdiv(V, BLOCK_V),), program ``p`` takes block ``p % cdiv(V, BLOCK_V)`` of
    row ``p // cdiv(V, BLOCK_V)`` (a scalar scale over a contiguous tensor is one long row).
    """
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(V, BLOCK_V)
    row = tl.cast(pid // col_blocks, tl.int64)
    cols = (pid % col_blocks) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_out + cols, (x * scale).to(OUT.dtype.element_ty), mask=mask)

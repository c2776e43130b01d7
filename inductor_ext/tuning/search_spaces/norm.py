"""The search space of the row-normalisation kernels (one reduction over the last dim per row:
:mod:`inductor_ext.kernels.rms_norm`, :mod:`inductor_ext.kernels.layer_norm`), for kernels that take the
constexprs ``PERSISTENT``, ``BLOCK_M``, ``BLOCK_N`` and ``PREFETCH`` and a row length argument ``N``:

* persistent: the whole row (``BLOCK_N = next_pow2(N)``) in registers,
  ``BLOCK_M`` rows per step; x is read once.
* looped: the row is walked in ``BLOCK_N`` chunks, one row per step; valid for
  any N and the only option past :data:`MAX_PERSISTENT_BLOCK`.
* grid: the forward runs one program per block of rows; the backward runs a
  fixed grid (:func:`programs_per_sm` per SM) that strides over row blocks, so
  each program writes its fp32 partial rows (dw, db) once.
* prefetch (backward, persistent): the next row block's loads are issued
  before this block's reductions.

Kernels use it as ``@triton.autotune(**autotune_kwargs(forward, key=[...]))``.
"""

import dataclasses
import functools

import triton

from inductor_ext.tuning.search_spaces.order import in_search_order

MAX_PERSISTENT_BLOCK = 32768
"""Largest power-of-two row held in registers (fp32, 32 warps: 32 values per thread and operand)."""


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """One launch configuration of a row-normalisation kernel."""

    persistent: bool
    block_m: int
    block_n: int
    num_warps: int
    prefetch: bool = False
    """Backward, persistent: load the next row block before reducing this one (more
    bytes in flight per program, more registers). The forward ignores it."""

    def to_triton(self) -> triton.Config:
        kwargs = {"PERSISTENT": self.persistent, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        return triton.Config({**kwargs, "PREFETCH": self.prefetch}, num_warps=self.num_warps)

    @classmethod
    def from_triton(cls, config: triton.Config) -> "NormConfig":
        kw = config.kwargs
        return cls(bool(kw["PERSISTENT"]), kw["BLOCK_M"], kw["BLOCK_N"], config.num_warps, bool(kw["PREFETCH"]))


def search_space(n: int, forward: bool = True, two_reductions: bool = False) -> list[NormConfig]:
    """Every config valid for rows of ``n`` elements, the heuristic's favourite first
    (:func:`_heuristic_rank`; ``two_reductions``: :func:`_two_reductions_rank`, same configs).

    Persistent (rows up to ``MAX_PERSISTENT_BLOCK``): 1-8 rows per step, 8-32 fp32
    values per thread and operand; the backward tries each with and without prefetching.
    Looped (rows longer than 2048): 2048- and 4096-element chunks (also 1024 past
    ``MAX_PERSISTENT_BLOCK``), 8 or 16 warps.
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
                    persistent.append(NormConfig(True, block_m, block, num_warps))
        if not forward:
            persistent += [dataclasses.replace(c, prefetch=True) for c in persistent]
    chunks = (2048, 4096) if block <= MAX_PERSISTENT_BLOCK else (1024, 2048, 4096)
    looped = [NormConfig(False, 1, chunk, num_warps) for chunk in chunks if chunk < block for num_warps in (8, 16)]
    rank = _two_reductions_rank if two_reductions else _heuristic_rank
    return sorted(persistent + looped, key=lambda c: rank(c, block))


def _heuristic_rank(config: NormConfig, block: int) -> tuple[int, int, int, int]:
    """Prefer persistent, ~16 values per thread, rows of at least 2 KiB per step, no prefetch."""
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    rows_wanted = max(1, 2048 // block)
    return (not config.persistent, abs(per_thread - 16), abs(config.block_m - rows_wanted), config.prefetch)


def _two_reductions_rank(config: NormConfig, block: int) -> tuple[int, int, int]:
    """For a forward that reduces twice in a row (LayerNorm: the mean, then the centred squares):
    prefer persistent, at least two rows and 8192 elements per step, 32 values per thread.

    Two rows per program keep a second row's reductions in flight while one waits; a full timing of
    every config picks these at 2048, 4096 and 8192 elements (4, 2, 2 rows; 8, 8, 16 warps), ahead
    of the one-row configs :func:`_heuristic_rank` puts first.
    """
    per_thread = config.block_m * config.block_n // (32 * config.num_warps)
    rows_wanted = max(2, 8192 // block)
    return (not config.persistent, abs(config.block_m - rows_wanted), abs(per_thread - 32))


def programs_per_sm(n: int) -> int:
    """Programs per SM of the backward's grid-stride launch: 4 for short rows, 2 at 4096
    elements, 1 from 8192 (RMSNorm's fastest backward at 2048-16384); fewer
    programs also mean fewer fp32 partial rows (programs x N) to write and reduce."""
    return max(1, min(4, 8192 // max(n, 1)))


def heuristic(n: int, forward: bool = True) -> NormConfig:
    return search_space(n, forward)[0]


def _all_configs() -> list[triton.Config]:
    """The union of the forward and backward search spaces over every power-of-two row length."""
    seen: dict[NormConfig, None] = {}
    for log2 in range(18):
        for forward in (True, False):
            seen.update(dict.fromkeys(search_space(2**log2, forward)))
    return [c.to_triton() for c in seen]


def _prune(
    configs: list[triton.Config], named_args: dict, *, forward: bool, two_reductions: bool = False, **kwargs: object
) -> list[triton.Config]:
    """``early_config_prune``: the configs in ``search_space(N, forward, two_reductions)``, in its order."""
    space = search_space(named_args["N"], forward, two_reductions)
    return in_search_order(configs, space, NormConfig.from_triton)


def autotune_kwargs(forward: bool, key: list[str], two_reductions: bool = False) -> dict[str, object]:
    """``@triton.autotune`` arguments: every config, pruned per call to the valid ones for ``N``
    (in :func:`search_space`'s order, with ``two_reductions`` for a forward that reduces twice).

    Only what Inductor accepts on a user kernel (configs, key, prune_configs_by).
    """
    prune = functools.partial(_prune, forward=forward, two_reductions=two_reductions)
    return {"configs": _all_configs(), "key": key, "prune_configs_by": {"early_config_prune": prune}}

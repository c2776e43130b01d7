"""The op recipe's launch helpers (what every op's traced kernel launch goes through)."""

import pytest
import torch
import triton
from triton.runtime.autotuner import Autotuner

from inductor_ext.kernels.cross_entropy import (
    CrossEntropyConfig,
    cross_entropy_fwd_inplace_kernel,
    scale_rows_kernel,
    search_space,
)
from inductor_ext.ops._library import pruned_autotuner


def _inplace_args(v: int) -> tuple:
    logits = torch.empty(3, v)
    return (logits, logits, torch.empty(3), None, torch.zeros(3, dtype=torch.long), None, v, v, 0, v, -100, 0.0, 0.0, 0.0)


def test_pruned_autotuner_keeps_restore_value_and_only_the_valid_configs():
    """torch's kernel tracing re-wraps a pruning autotuner without ``restore_value``; ours must keep it."""
    for v in (100, 32000, 262144):
        pruned = pruned_autotuner(cross_entropy_fwd_inplace_kernel, _inplace_args(v), {"HAS_GRAD_SCALE": False})
        assert isinstance(pruned, Autotuner)
        assert pruned.restore_value == ["DLOGITS"]
        assert pruned.early_config_prune is None  # nothing left for the tracer to re-wrap
        assert pruned.fn is cross_entropy_fwd_inplace_kernel.fn
        assert sorted(map(CrossEntropyConfig.from_triton, pruned.configs), key=str) == sorted(search_space(v), key=str)


def test_pruned_autotuner_passes_plain_kernels_through():
    assert pruned_autotuner(scale_rows_kernel, (), {}) is scale_rows_kernel
    no_prune = triton.autotune(configs=[triton.Config({})], key=[])(scale_rows_kernel)
    assert pruned_autotuner(no_prune, (), {}) is no_prune


def test_precompile_configs_warms_up_each_pruned_config_once_in_async_compile_mode(monkeypatch):
    """The first launch of an autotuned kernel compiles every config its autotuner will time, on a
    thread pool (Triton's AsyncCompileMode), before timing them; here with RMSNorm's backward
    autotuner (its real pruning for N) and the warm-up stubbed (it needs a GPU)."""
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton.runtime._async_compile import active_mode

    from inductor_ext.kernels.norm_config import search_space
    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel
    from inductor_ext.ops._library import precompile_configs

    n, compiled = 3000, []

    def warmup(*args, grid, **meta):
        mode = active_mode.get()
        assert mode is not None and isinstance(mode.executor, ThreadPoolExecutor)
        compiled.append((grid, meta))

    monkeypatch.setattr(rms_norm_bwd_kernel.fn, "warmup", warmup)
    tensors = [torch.empty(8, n, dtype=torch.bfloat16) for _ in range(2)]
    args = (*tensors, None, torch.empty(n, dtype=torch.bfloat16), torch.empty(8), *tensors[:1], torch.empty(2, n))
    args += (n, n, 0, n, 8, n, 0.0)
    kwargs = {"HAS_DRES": False, "HAS_WEIGHT": True, "GEMMA_CASTING": False}
    precompile_configs(rms_norm_bwd_kernel, lambda meta: (meta["BLOCK_M"],), args, kwargs)

    expected = {c.to_triton() for c in search_space(n, forward=False)}
    configs = [triton.Config({k: meta[k] for k in ("PERSISTENT", "BLOCK_M", "BLOCK_N", "PREFETCH")},
                             num_warps=meta["num_warps"]) for _, meta in compiled]  # fmt: skip
    assert sorted(map(str, configs)) == sorted(map(str, expected)) and len(configs) == len(expected) > 1
    assert all(grid == (meta["BLOCK_M"],) and meta["HAS_WEIGHT"] for grid, meta in compiled)
    assert active_mode.get() is None
    assert rms_norm_bwd_kernel.nargs is None  # the autotuner is left as Triton leaves it


def test_quick_benchmarks_shortens_the_autotuners_timing_only_within():
    """A first launch's autotuning times each config for AUTOTUNE_BENCH_MS (not Triton's 25 + 100 ms);
    the autotuner itself keeps Triton's default, which Inductor requires of user kernels."""
    from inductor_ext.kernels.glu import glu_fwd_kernel
    from inductor_ext.ops._library import AUTOTUNE_BENCH_MS, quick_benchmarks

    assert "do_bench" not in glu_fwd_kernel.__dict__
    with quick_benchmarks(glu_fwd_kernel):
        bench = glu_fwd_kernel.do_bench
        assert (bench.keywords["warmup"], bench.keywords["rep"]) == AUTOTUNE_BENCH_MS
    assert "do_bench" not in glu_fwd_kernel.__dict__


def test_thorough_benchmarks_turn_the_quick_first_launch_off_only_within():
    from inductor_ext.ops._library import DirectLaunch, thorough_benchmarks

    assert DirectLaunch.quick_first_launch
    with pytest.raises(RuntimeError, match="inside"), thorough_benchmarks():
        assert not DirectLaunch.quick_first_launch
        raise RuntimeError("inside")
    assert DirectLaunch.quick_first_launch

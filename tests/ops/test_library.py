"""The op recipe's launch helpers (what every op's traced kernel launch goes through)."""

import contextlib

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
    return (
        logits,
        logits,
        torch.empty(3),
        None,
        torch.zeros(3, dtype=torch.long),
        None,
        v,
        v,
        0,
        v,
        -100,
        0.0,
        0.0,
        0.0,
    )


def test_pruned_autotuner_keeps_restore_value_and_only_the_valid_configs():
    """torch's kernel tracing re-wraps a pruning autotuner without ``restore_value``; ours must keep it.
    Inductor tunes the traced launch at compile time, so it gets a quick first launch's configs (the
    search space's first QUICK_FIRST_LAUNCH_CONFIGS); within thorough_benchmarks, all of them."""
    from inductor_ext.ops._library import QUICK_FIRST_LAUNCH_CONFIGS, thorough_benchmarks

    for v in (100, 32000, 262144):
        for thorough in (False, True):
            with thorough_benchmarks() if thorough else contextlib.nullcontext():
                pruned = pruned_autotuner(cross_entropy_fwd_inplace_kernel, _inplace_args(v), {"HAS_GRAD_SCALE": False})
            assert isinstance(pruned, Autotuner)
            assert pruned.restore_value == ["DLOGITS"]
            assert pruned.early_config_prune is None  # nothing left for the tracer to re-wrap
            assert pruned.fn is cross_entropy_fwd_inplace_kernel.fn
            expected = search_space(v) if thorough else search_space(v)[:QUICK_FIRST_LAUNCH_CONFIGS]
            assert list(map(CrossEntropyConfig.from_triton, pruned.configs)) == expected
        assert len(search_space(v)) > QUICK_FIRST_LAUNCH_CONFIGS or v == 100


def _rms_norm_bwd_args(n: int) -> tuple:
    tensors = [torch.empty(8, n, dtype=torch.bfloat16) for _ in range(2)]
    args = (*tensors, None, torch.empty(n, dtype=torch.bfloat16), torch.empty(8), *tensors[:1], torch.empty(2, n))
    return (*args, n, n, 0, n, 8, n, 0.0)


def test_every_pruning_keeps_its_search_space_order():
    """Each kernel's early_config_prune returns the valid configs heuristic's favourite first (the
    search space's order), whatever the order of the autotuner's full config list: the first is what
    the interpreter launches, the first few what a quick first launch times."""
    from inductor_ext.kernels import cross_entropy, norm_config, rope
    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel, rms_norm_fwd_kernel

    for kernel, forward in ((rms_norm_fwd_kernel, True), (rms_norm_bwd_kernel, False)):
        for n in (100, 3000, 4096, 16384, 65536):
            pruned = kernel.early_config_prune(kernel.configs[::-1], {"N": n})
            assert list(map(norm_config.NormConfig.from_triton, pruned)) == norm_config.search_space(n, forward)
    for v in (100, 32000, 262144):
        pruned = cross_entropy._prune(cross_entropy.cross_entropy_fwd_kernel.configs[::-1], {"V": v})
        assert list(map(CrossEntropyConfig.from_triton, pruned)) == search_space(v)
        pruned = cross_entropy._bwd_prune(cross_entropy.cross_entropy_bwd_kernel.configs[::-1], {"V": v})
        assert [str(c) for c in pruned] == [str(c) for c in cross_entropy.bwd_search_space(v)]
    named = {"n_q_heads": 32, "n_k_heads": 8, "HALF_PAD": 64, "PASS": 0, "PASS_PAD": 1}
    pruned = rope._prune(rope._AUTOTUNE["configs"][::-1], named)
    assert list(map(rope.RoPEConfig.from_triton, pruned)) == rope.search_space(32, 8, 64)


def test_quick_first_launch_offers_the_first_configs_only_within():
    """Within quick_first_launch the autotuner offers (and precompile_configs compiles) this launch's
    first QUICK_FIRST_LAUNCH_CONFIGS configs, timed for AUTOTUNE_BENCH_MS; after it, every config again."""
    from inductor_ext.kernels.norm_config import search_space as norm_search_space
    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel
    from inductor_ext.ops._library import (
        AUTOTUNE_BENCH_MS,
        QUICK_FIRST_LAUNCH_CONFIGS,
        candidate_configs,
        quick_first_launch,
    )

    args, kwargs = _rms_norm_bwd_args(4096), {"HAS_DRES": False, "HAS_WEIGHT": True, "GEMMA_CASTING": False}
    everything = rms_norm_bwd_kernel.configs
    assert len(candidate_configs(rms_norm_bwd_kernel, args, kwargs)) == len(norm_search_space(4096, False)) > 4
    with quick_first_launch(rms_norm_bwd_kernel, args, kwargs):
        offered = candidate_configs(rms_norm_bwd_kernel, args, kwargs)
        bench = rms_norm_bwd_kernel.do_bench
        assert (bench.keywords["warmup"], bench.keywords["rep"]) == AUTOTUNE_BENCH_MS
    first = norm_search_space(4096, False)[:QUICK_FIRST_LAUNCH_CONFIGS]
    assert [str(c) for c in offered] == [str(c.to_triton()) for c in first]
    assert rms_norm_bwd_kernel.configs is everything and "do_bench" not in rms_norm_bwd_kernel.__dict__


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
    kwargs = {"HAS_DRES": False, "HAS_WEIGHT": True, "GEMMA_CASTING": False}
    precompile_configs(rms_norm_bwd_kernel, lambda meta: (meta["BLOCK_M"],), _rms_norm_bwd_args(n), kwargs)

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

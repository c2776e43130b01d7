"""The op recipe's launch helpers (what every op's traced kernel launch goes through) and the sharding rules
op files declare."""

import contextlib
import warnings

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
from inductor_ext.library.launch import pruned_autotuner


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
    from inductor_ext.tuning.launch_settings import QUICK_FIRST_LAUNCH_CONFIGS, thorough_benchmarks

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
    from inductor_ext.kernels import cross_entropy, rope
    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel, rms_norm_fwd_kernel
    from inductor_ext.tuning.search_spaces import norm

    for kernel, forward in ((rms_norm_fwd_kernel, True), (rms_norm_bwd_kernel, False)):
        for n in (100, 3000, 4096, 16384, 65536):
            pruned = kernel.early_config_prune(kernel.configs[::-1], {"N": n})
            assert list(map(norm.NormConfig.from_triton, pruned)) == norm.search_space(n, forward)
    for v in (100, 32000, 262144):
        pruned = cross_entropy._prune(cross_entropy.cross_entropy_fwd_kernel.configs[::-1], {"V": v})
        assert list(map(CrossEntropyConfig.from_triton, pruned)) == search_space(v)
        pruned = cross_entropy._bwd_prune(cross_entropy.cross_entropy_bwd_kernel.configs[::-1], {"V": v})
        assert [str(c) for c in pruned] == [str(c) for c in cross_entropy.bwd_search_space(v)]
    named = {"n_q_heads": 32, "n_k_heads": 8, "HALF_PAD": 64, "PASS": 0, "PASS_PAD": 1}
    pruned = rope._prune(rope._AUTOTUNE["configs"][::-1], named)
    assert list(map(rope.RoPEConfig.from_triton, pruned)) == rope.search_space(32, 8, 64)


@pytest.mark.parametrize("thorough", [False, True], ids=["quick", "thorough"])
def test_a_first_launch_tunes_on_an_autotuner_of_its_own(thorough):
    """A first launch's autotuner offers (so precompile_configs compiles) this launch's first
    QUICK_FIRST_LAUNCH_CONFIGS configs, timed for AUTOTUNE_BENCH_MS; within thorough_benchmarks every
    config, with Triton's default timing. It is built for the launch: the kernel's own autotuner, which
    another thread may be running and which Inductor reads, keeps its configs and benchmark settings."""
    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel
    from inductor_ext.tuning.first_launch import candidate_configs, first_launch_autotuner
    from inductor_ext.tuning.launch_settings import AUTOTUNE_BENCH_MS, QUICK_FIRST_LAUNCH_CONFIGS, thorough_benchmarks
    from inductor_ext.tuning.search_spaces.norm import search_space as norm_search_space

    args, kwargs = _rms_norm_bwd_args(4096), {"HAS_DRES": False, "HAS_WEIGHT": True, "GEMMA_CASTING": False}
    everything = rms_norm_bwd_kernel.configs
    candidates = norm_search_space(4096, False)
    assert len(candidate_configs(rms_norm_bwd_kernel, args, kwargs)) == len(candidates) > QUICK_FIRST_LAUNCH_CONFIGS
    with thorough_benchmarks() if thorough else contextlib.nullcontext():
        tuner = first_launch_autotuner(rms_norm_bwd_kernel, args, kwargs)
    assert tuner is not rms_norm_bwd_kernel and tuner.fn is rms_norm_bwd_kernel.fn
    kept = ("keys", "restore_value", "reset_to_zero")
    assert [getattr(tuner, name) for name in kept] == [getattr(rms_norm_bwd_kernel, name) for name in kept]
    in_place = first_launch_autotuner(cross_entropy_fwd_inplace_kernel, _inplace_args(32000), {"HAS_GRAD_SCALE": False})
    assert in_place.restore_value == ["DLOGITS"]
    offered = candidate_configs(tuner, args, kwargs)
    expected = candidates if thorough else candidates[:QUICK_FIRST_LAUNCH_CONFIGS]
    assert [str(c) for c in offered] == [str(c.to_triton()) for c in expected]
    if thorough:
        assert "do_bench" not in tuner.__dict__  # Triton's default, read when it first times
    else:
        bench = tuner.do_bench
        assert (bench.keywords["warmup"], bench.keywords["rep"]) == AUTOTUNE_BENCH_MS
    assert rms_norm_bwd_kernel.configs is everything and "do_bench" not in rms_norm_bwd_kernel.__dict__
    assert getattr(rms_norm_bwd_kernel, "nargs", None) is None


@pytest.fixture
def no_tuned_launches():
    """The eager picks' registry empty for the test, and emptied after it."""
    from inductor_ext.tuning.first_launch import clear_tuned_launch_configs

    clear_tuned_launch_configs()
    yield
    clear_tuned_launch_configs()


def test_a_first_launch_times_once_and_records_its_pick(monkeypatch, no_tuned_launches):
    """A direct launch's GPU path, on CPU: the interpreter cannot time, so a stand-in for Triton's
    ``do_bench`` (which the quick budget wraps) rates the second quick config fastest. The first launch
    times the quick configs once each and records that pick, which later launches use without timing;
    the kernel's own autotuner is left as it was, and the registry is read through copies."""
    from inductor_ext.library.launch import DirectLaunch
    from inductor_ext.ops.rms_norm import rms_norm_fwd_kernels, rms_norm_ref
    from inductor_ext.tuning import first_launch
    from inductor_ext.tuning.first_launch import (
        candidate_configs,
        launch_key,
        tuned_launch_config,
        tuned_launch_configs,
    )
    from inductor_ext.tuning.launch_settings import AUTOTUNE_BENCH_MS, quick_configs, record_autotuned_launches

    timed = []

    def do_bench(kernel_call, quantiles, warmup=None, rep=None):
        kernel_call()
        timed.append((warmup, rep))
        ms = 1.0 if len(timed) == 2 else 2.0 + len(timed)
        return [ms, ms, ms]

    compiled = []
    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    # (compiling ahead of the timing is Triton's warm-up, which needs a GPU)
    monkeypatch.setattr(first_launch, "precompile_configs", lambda kernel, grid, args, kwargs: compiled.append(kernel))
    x, w = torch.randn(6, 300), torch.randn(300)
    launch = DirectLaunch(interpreter=False)
    with record_autotuned_launches() as launches:
        y, _ = rms_norm_fwd_kernels(launch, x, w, 1e-6, 0.0, "llama")
    ((kernel, args, kwargs),) = launches
    configs, cache = kernel.configs, dict(kernel.cache)
    quick = quick_configs(candidate_configs(kernel, args, kwargs))
    assert len(quick) > 2 and timed == [AUTOTUNE_BENCH_MS] * len(quick)
    assert [str(c) for c in candidate_configs(compiled[0], args, kwargs)] == [str(c) for c in quick]
    assert tuned_launch_config(kernel, args, kwargs) == quick[1].all_kwargs()
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)

    y, _ = rms_norm_fwd_kernels(launch, x, w, 1e-6, 0.0, "llama")
    assert len(timed) == len(quick) and len(compiled) == 1  # tuned once per launch key
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert kernel.configs is configs and kernel.cache == cache and getattr(kernel, "nargs", None) is None
    assert "do_bench" not in kernel.__dict__

    snapshot = tuned_launch_configs()
    snapshot[launch_key(kernel, args, kwargs)]["BLOCK_M"] = -1
    snapshot.clear()
    tuned_launch_config(kernel, args, kwargs)["BLOCK_M"] = -1
    assert tuned_launch_configs() == {launch_key(kernel, args, kwargs): quick[1].all_kwargs()}


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

    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel
    from inductor_ext.tuning.first_launch import precompile_configs
    from inductor_ext.tuning.search_spaces.norm import search_space

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
    assert getattr(rms_norm_bwd_kernel, "nargs", None) is None  # the autotuner is left as Triton leaves it


def test_thorough_benchmarks_turn_the_quick_first_launch_off_only_within():
    from inductor_ext.tuning.launch_settings import quick_first_launch_enabled, thorough_benchmarks

    assert quick_first_launch_enabled()
    with pytest.raises(RuntimeError, match="inside"), thorough_benchmarks():
        assert not quick_first_launch_enabled()
        raise RuntimeError("inside")
    assert quick_first_launch_enabled()


def test_launch_settings_hold_in_their_own_thread_only():
    """Each setting is a context variable: another thread does not see it, unless it runs in a copy
    of the setter's context (as route timing's threads do: tests/inductor/test_backend.py)."""
    import concurrent.futures
    import contextvars

    from inductor_ext.tuning.launch_settings import (
        autotuned_launch_log,
        force_launch_config,
        forced_launch_config,
        quick_first_launch_enabled,
        record_autotuned_launches,
        thorough_benchmarks,
    )

    def settings():
        return quick_first_launch_enabled(), forced_launch_config(), autotuned_launch_log()

    config = {"BLOCK_M": 1}
    with thorough_benchmarks(), force_launch_config(config), record_autotuned_launches() as log:
        assert settings() == (False, config, log)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            assert pool.submit(settings).result() == (True, None, None)
            assert pool.submit(contextvars.copy_context().run, settings).result() == (False, config, log)
    assert settings() == (True, None, None)


SHARDED_OPS = [
    f"fastops::{family}_{direction}"
    for family in ("rms_norm", "add_rms_norm", "layer_norm", "glu", "glu_packed", "rope", "cross_entropy",
                   "fused_linear_cross_entropy")
    for direction in ("fwd", "bwd")
]  # fmt: skip
SHARDED_OPS.append("fastops::recomputable_norm_output")  # the backend's recompute marker (inductor/recompute_norms.py)


def test_op_files_declare_a_sharding_rule_per_op():
    """Importing the ops records their rules (checked against the unsharded ops in tests/distributed)."""
    import inductor_ext.ops  # noqa: F401
    from inductor_ext.library.sharding import RULES, sharding_rule

    assert sorted(op.name() for op in RULES) == sorted(SHARDED_OPS)
    assert RULES[torch.ops.fastops.rope_fwd.default] is RULES[torch.ops.fastops.rope_bwd.default]
    for op in (torch.ops.fastops.rms_norm_fwd.default, "fastops::rms_norm_fwd", "fastops::rms_norm_fwd.default"):
        with pytest.raises(ValueError, match="already has a sharding rule"):
            sharding_rule(op)(lambda *args: [])


def test_sharding_rules_register_once_and_warn_when_dtensor_refuses(monkeypatch):
    """A rule DTensor refuses (a torch whose API differs) is skipped with a warning; registration hands
    each rule over once, and does nothing without torch.distributed."""
    import torch.distributed.tensor.experimental

    import inductor_ext.ops  # noqa: F401
    from inductor_ext.library import sharding

    def refuse(op):
        raise TypeError(f"refused {op}")

    monkeypatch.setattr(torch.distributed.tensor.experimental, "register_sharding", refuse)
    monkeypatch.setattr(sharding, "_registered", set())
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharding.register_sharding_rules()  # nothing to register with
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    with pytest.warns(UserWarning, match="no DTensor sharding rule") as record:
        sharding.register_sharding_rules()
    assert len(record) == len(SHARDED_OPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharding.register_sharding_rules()  # each rule was handed over once

"""The tuning database's consumers on a real GPU: after a tuning run, compiling with ``cpp_wrapper``
times nothing (no route timing, no kernel benchmarking) and launches the recorded config."""

import pytest
import torch

import inductor_ext
from inductor_ext.inductor.options import BackendOptions
from inductor_ext.ops.rms_norm import rms_norm_family, rms_norm_ref
from inductor_ext.tuning import routes
from inductor_ext.tuning.database import TuningDatabase
from tests.gpu.compile_checks import record_benchmarked_kernels, run_and_get_joined_code

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_warm_database_compiles_with_no_timing_and_the_recorded_config(monkeypatch, tmp_path):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    # what `python -m inductor_ext.tuning tune` does for this call: time both routes, record the picks
    routes.decide_routes(rms_norm_family, (x, w, 1e-6, 0.0, "llama"), BackendOptions(), TuningDatabase(), x.device)
    configs = [k for k, _ in TuningDatabase().items() if k.startswith("config|rms_norm_fwd_kernel")]
    assert configs, list(dict(TuningDatabase().items()))

    timed = record_benchmarked_kernels(monkeypatch)
    monkeypatch.setattr(routes, "measure_routes", lambda *a, **k: timed.append("route timing") or [])
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w: rms_norm_ref(x, w, 1e-6), backend="fastops_inductor", options={"fastops.route": "kernel"}
    )
    with torch._inductor.config.patch({"cpp_wrapper": True, "triton.autotune_at_compile_time": True,
                                       "fx_graph_cache": False}):  # fmt: skip
        y, code = run_and_get_joined_code(compiled, x, w)
    # (Inductor may still tune kernels of its own elsewhere in a graph: only ours and the routes count here)
    assert [t for t in timed if t == "route timing" or "rms_norm" in t] == [], timed
    assert "rms_norm_fwd_kernel" in code
    torch.testing.assert_close(y, rms_norm_ref(x, w, 1e-6), rtol=2e-2, atol=2e-2)


def test_hf_config_of_a_llama_traces_every_rewritten_op(monkeypatch, tmp_path):
    """``tune --hf-config``: transformers' own Llama built from a config on the meta device (no weights);
    its norms, RoPE, MLP and loss are all found. (transformers is installed on the GPU machine, not in CI.)"""
    transformers = pytest.importorskip("transformers")
    from inductor_ext.tuning.cli.main import main

    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "llama")
    args = ["tune", "--hf-config", str(tmp_path / "llama"), "--batch", "2", "--seq", "64", "--device", "cpu"]
    assert main(args) == 0
    calls = {key.split("|")[1]: key.split("|")[2] for key, _ in TuningDatabase().items() if key.startswith("route|")}
    assert {"fastops::rms_norm_fwd", "fastops::rope_fwd", "fastops::glu_fwd", "fastops::cross_entropy_fwd"} <= set(
        calls
    ), calls
    # ForCausalLMLoss upcasts, then flattens: the loss reads the bf16 logits, not an fp32 copy
    assert calls["fastops::cross_entropy_fwd"].startswith("(bfloat16[128,1000]"), calls


def test_route_timing_counts_gpu_time_not_host_time():
    """``median_ms`` times a CUDA graph of the calls: host work in ``run`` (here a 2 ms sleep
    around a tiny kernel) is not captured, so it cannot be timed. Stream timing measured the host
    whenever it was slower than the kernels (docs/autotune.md)."""
    import time

    from inductor_ext.tuning.timing import median_ms

    def run(inputs):
        time.sleep(0.002)
        return inputs[0] * 2

    ms, _ = median_ms(run, lambda: [torch.randn(1024, device="cuda")])
    assert ms < 0.2, ms


def test_first_launch_compiles_every_candidate_config_before_timing():
    """``precompile_configs`` (on the first launch of an autotuned kernel) leaves every config the
    autotuner will time compiled in the JIT cache, so its timing compiles nothing more."""
    import triton

    from inductor_ext.kernels.rms_norm import rms_norm_fwd_kernel
    from inductor_ext.tuning.first_launch import candidate_configs, precompile_configs

    m, n = 300, 5000  # a row length no other test launches, so nothing is compiled yet
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(m, device="cuda")
    args = (x, None, w, y, None, rstd, n, 0, n, 0, m, n, 1e-6, 0.0)
    kwargs = {"HAS_RESIDUAL": False, "HAS_WEIGHT": True, "GEMMA_CASTING": False}
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)
    cache = rms_norm_fwd_kernel.fn.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    precompile_configs(rms_norm_fwd_kernel, grid, args, kwargs)
    compiled = len(cache) - before
    assert compiled == len(candidate_configs(rms_norm_fwd_kernel, args, kwargs)) > 1
    rms_norm_fwd_kernel[grid](*args, **kwargs)  # the autotuner times every config: all cached
    assert len(cache) - before == compiled
    torch.testing.assert_close(y.float(), rms_norm_ref(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)


def _record_benchmark_budgets(monkeypatch) -> list[tuple]:
    """``(warmup, rep)`` of every ``triton.testing.do_bench`` call from now on (the timing still runs)."""
    import triton.testing

    budgets = []
    real = triton.testing.do_bench

    def recording(fn, *args, **kwargs):
        budgets.append((kwargs.get("warmup"), kwargs.get("rep")))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(triton.testing, "do_bench", recording)
    return budgets


def test_first_launch_times_each_config_with_the_short_budget(monkeypatch):
    """DirectLaunch's first launch autotunes the first QUICK_FIRST_LAUNCH_CONFIGS configs with
    AUTOTUNE_BENCH_MS each; later launches time nothing."""

    from inductor_ext.tuning.launch_settings import AUTOTUNE_BENCH_MS, QUICK_FIRST_LAUNCH_CONFIGS

    budgets = _record_benchmark_budgets(monkeypatch)
    x = torch.randn(333, 2999, device="cuda", dtype=torch.bfloat16)  # a row length no other test launches
    w = torch.randn(2999, device="cuda", dtype=torch.bfloat16)
    y = inductor_ext.rms_norm(x, w)
    assert len(budgets) == QUICK_FIRST_LAUNCH_CONFIGS and set(budgets) == {AUTOTUNE_BENCH_MS}
    timed = len(budgets)
    inductor_ext.rms_norm(x, w)
    assert len(budgets) == timed  # tuned once per shape: the second launch times nothing
    torch.testing.assert_close(y, rms_norm_ref(x, w), rtol=2e-2, atol=2e-2)


def test_thorough_benchmarks_keep_tritons_budget_on_first_launches(monkeypatch):
    """Within thorough_benchmarks (the standalone tuner's setting) a first launch times every candidate
    config with Triton's default budget; outside, the first QUICK_FIRST_LAUNCH_CONFIGS with AUTOTUNE_BENCH_MS."""

    from inductor_ext.tuning.first_launch import candidate_configs
    from inductor_ext.tuning.launch_settings import (
        AUTOTUNE_BENCH_MS,
        QUICK_FIRST_LAUNCH_CONFIGS,
        record_autotuned_launches,
        thorough_benchmarks,
    )

    budgets = _record_benchmark_budgets(monkeypatch)
    x = torch.randn(77, 3001, device="cuda", dtype=torch.bfloat16)  # row lengths no other test launches
    with thorough_benchmarks(), record_autotuned_launches() as launches:
        inductor_ext.rms_norm(x)
    ((kernel, args, kwargs),) = launches
    candidates = len(candidate_configs(kernel, args, kwargs))
    assert budgets == [(None, None)] * candidates and candidates > QUICK_FIRST_LAUNCH_CONFIGS  # Triton's defaults
    budgets.clear()
    inductor_ext.rms_norm(torch.randn(77, 3003, device="cuda", dtype=torch.bfloat16))
    assert budgets == [AUTOTUNE_BENCH_MS] * QUICK_FIRST_LAUNCH_CONFIGS

"""The benchmark modules (``benchmarks/`` and ``inductor_ext.bench``) import and follow their protocol
without a GPU; the harness's pure helpers: kernel classes, child processes."""

import importlib
import sys

import pytest

from benchmarks import harness as op_harness
from benchmarks.__main__ import MODEL_BENCHES, OPS, TOOLS
from inductor_ext.bench import harness


@pytest.mark.parametrize("op", OPS)
def test_op_benchmark_modules_follow_the_protocol(op):
    bench = importlib.import_module(f"benchmarks.{op}")
    assert callable(bench.run) and bench.SHAPES
    assert all(isinstance(d, int) and d > 0 for shape in bench.SHAPES for d in shape)


@pytest.mark.parametrize("name", sorted(MODEL_BENCHES) + sorted(TOOLS))
def test_model_benchmark_and_tool_modules_have_a_main(name):
    assert callable(importlib.import_module({**MODEL_BENCHES, **TOOLS}[name]).main)


def test_the_package_benchmarks_are_train_and_generate(capsys):
    from inductor_ext.bench.__main__ import BENCHMARKS, main

    assert sorted(BENCHMARKS) == ["generate", "train"]
    assert main(["rms_norm"]) == 2 and "train,generate" in capsys.readouterr().err
    for flag in ("-h", "--help"):
        assert main([flag]) == 0 and "python -m inductor_ext.bench train --help" in capsys.readouterr().out


def test_profile_compile_sampler_credits_the_sampled_threads():
    import threading
    import time

    from benchmarks.profile_compile import StackSampler

    done = threading.Event()

    def busy_wait():
        while not done.is_set():
            time.sleep(0.001)

    worker = threading.Thread(target=busy_wait)
    worker.start()
    with StackSampler(0.002) as sampler:
        time.sleep(0.1)
    done.set()
    worker.join()
    assert sampler.samples > 0 and sampler.seconds > 0
    assert any("busy_wait" in key for key in sampler.inclusive), sampler.report(10)
    assert "inclusive" in sampler.report(5) and "innermost" in sampler.report(5)


@pytest.mark.parametrize(
    "kernel,expected",
    [
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("void cudnn::fusion::compute_dot_do_o_specialized<true, 128>(void const*)", "attention"),
        ("triton_poi_fused_add_view_7", "other"),
        ("rms_norm_bwd_kernel", "other"),
    ],
)
def test_kernel_classes(kernel, expected):
    assert harness.kernel_class(kernel) == expected
    totals = harness.kernel_us_by_class({kernel: 2.0, "Memset (Device)": 1.0})
    assert totals[expected] == 2.0 + (1.0 if expected == "other" else 0.0) and sum(totals.values()) == 3.0


def test_run_child_returns_the_last_result_line_and_reports_failures():
    emit = "from inductor_ext.bench.harness import print_child_result as p; print('noise'); p({'a': 1}); p({'a': 2})"
    assert harness.run_child([sys.executable, "-c", emit], {}) == {"a": 2}
    with pytest.raises(RuntimeError, match="exit 3"):
        harness.run_child([sys.executable, "-c", "print('partial'); raise SystemExit(3)"], {})


def test_rotated_order_puts_every_name_in_every_place():
    names = ["eager", "torch_compile", "fastops_auto", "fastops_kernel"]
    orders = [op_harness.rotated_order(names, r) for r in range(len(names))]
    assert orders[0] == names and all(sorted(order) == sorted(names) for order in orders)
    for place in range(len(names)):
        assert sorted(order[place] for order in orders) == sorted(names)
    assert op_harness.rotated_order(names, len(names) + 1) == orders[1]
    assert op_harness.rotated_order([], 3) == []


def test_backend_bench_compile_time_flags_exclude_each_other(capsys):
    from benchmarks import backend

    with pytest.raises(SystemExit) as exit_info:
        backend.main(["--no-compile-times", "--compile-times-only"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("providers,message", [
    (["fastops_auto"], "must include torch_compile"),
    (["torch_compile", "fastops_auto_warm_db"], "fastops_auto_warm_db needs fastops_auto"),
    (["torch_compile", "fastops_eager"], "invalid choice: 'fastops_eager'"),
])  # fmt: skip
def test_backend_bench_compile_providers_are_checked(capsys, providers, message):
    from benchmarks import backend

    with pytest.raises(SystemExit) as exit_info:
        backend.main(["--compile-times-only", "--compile-providers", *providers])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

"""``inductor_ext.bench.compile_split``: phases from two snapshots of the compile timers, Dynamo and
AOTAutograd without the work nested in them, each of our passes by name."""

import pytest

from inductor_ext.bench.compile_split import compile_split


def test_phases_subtract_what_runs_inside_them():
    before = {"_compile.compile_inner": 1.0, "fastops.pass.rewrites": 0.5}
    after = {
        "_compile.compile_inner": 11.0,  # 10 s, of which the backend call took 8
        "OutputGraph.call_user_compiler": 8.0,
        "create_aot_dispatcher_function": 7.0,  # of which the forward's Inductor compile took 4
        "compile_fx.<locals>.fw_compiler_base": 4.0,
        "compile_fx_inner": 6.0,  # forward and backward
        "compile_file": 1.5,
        "async_compile.wait": 2.0,
        "CachingAutotuner.benchmark_all_configs": 0.25,
        "CachingAutotuner.coordinate_descent_tuning": 0.5,
        "fastops.route_timing": 0.75,
        "fastops.pass.rewrites": 0.75,
        "fastops.pass.recompute_norms": 0.0,
    }
    split = compile_split(before, after)
    assert split == {
        "dynamo": 2.0,
        "aot_autograd": 3.0,
        "inductor": 6.0,
        "triton compile": 2.0,
        "c++ compile": 1.5,
        "autotune": 0.75,
        "route timing": 0.75,
        "passes": {"rewrites": 0.25},  # a pass that took no time is left out
    }


def test_a_compile_under_the_backend_times_our_passes():
    torch = pytest.importorskip("torch")
    from inductor_ext.bench.compile_split import timer_seconds

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.nn.functional.silu(x[..., :4]) * x[..., 4:], backend="fastops_inductor")
    before = timer_seconds()
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would skip Inductor
        compiled(torch.randn(3, 8))
    split = compile_split(before)
    assert split["dynamo"] > 0 and split["inductor"] > 0
    assert "rewrites" in split["passes"], split

"""The fastops_inductor backend on CPU: options, rewrites (forward and backward on the
fastops ops), routes, generated code, cpp_wrapper and cache keys.

The HF spellings are reproduced verbatim (transformers is not a test dependency);
tests/gpu/test_backend_gpu.py runs the real transformers classes.
"""

import operator

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext.inductor.options import BackendOptions, parse_options
from inductor_ext.inductor.pass_types import PassContext
from inductor_ext.inductor.pipeline import InductorPasses
from inductor_ext.ops.rope import apply_rotary_pos_emb_ref
from inductor_ext.tuning.cli.trace import trace_calls
from inductor_ext.tuning.inputs import random_inputs
from tests.hf_spellings import (
    CausalLMLoss,
    GemmaRMSNorm,
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    rotate_half,
)
from tests.tolerances import OUTPUT, reduced_grad, rel_err


class FunctionalRMSNorm(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


class NotRMSNorm(torch.nn.Module):
    """Normalises over dim 0: must be left alone."""

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


@pytest.fixture(autouse=True)
def _fresh_dynamo(tmp_path, monkeypatch):
    """Fresh Dynamo state and tuning database; no FX-graph / AOTAutograd cache hits, which
    skip tracing (and so the op bodies' route counters these tests read)."""
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    # config.patch, not monkeypatch: config modules resolve their entries dynamically
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _run(module, x, **compile_kwargs):
    """(compiled output, compiled grads) and (eager output, eager grads) for a random cotangent."""
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True, **compile_kwargs)
    dy = torch.randn(x.shape)
    results = []
    for fn in (compiled, module):
        module.zero_grad()
        xi = x.detach().clone().requires_grad_()
        y = fn(xi)
        y.backward(dy.to(y.dtype))
        results.append((y.detach(), xi.grad, [p.grad for p in module.parameters()]))
    return results


REWRITES = [
    (LlamaRMSNorm, "rms_norm_hf_llama"),
    (GemmaRMSNorm, "rms_norm_gemma"),
    (lambda n: torch.nn.RMSNorm(n, eps=1e-5), "rms_norm_torch"),
    (FunctionalRMSNorm, "rms_norm_torch"),
]


@pytest.mark.parametrize("make,rewrite", REWRITES, ids=[r[1] + str(i) for i, r in enumerate(REWRITES)])
def test_rms_norm_spellings_are_rewritten_forward_and_backward(make, rewrite):
    module = make(96)
    if isinstance(module, torch.nn.RMSNorm):
        torch.nn.init.normal_(module.weight, 1.0, 0.1)
    (y, dx, dws), (y_e, dx_e, dws_e) = _run(module, torch.randn(3, 5, 96))
    assert counters["inductor_ext"][f"rewrite_{rewrite}"] == 1
    # both fastops ops were traced (on CPU: the Inductor route), so autograd went through ours
    assert counters["inductor_ext"]["fastops::rms_norm_fwd->inductor"] >= 1
    assert counters["inductor_ext"]["fastops::rms_norm_bwd->inductor"] == 1
    assert sum(counters["graph_break"].values()) == 0
    tol = OUTPUT[torch.float32]
    assert rel_err(y, y_e) < tol and rel_err(dx, dx_e) < tol
    for dw, dw_e in zip(dws, dws_e):
        assert rel_err(dw, dw_e) < reduced_grad(torch.float32, 15)


def test_bf16_llama_rewrite_keeps_hf_rounding():
    module = LlamaRMSNorm(128).to(torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    (y, dx, _), (y_e, dx_e, _) = _run(module, x)
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] == 1
    assert y.dtype == torch.bfloat16
    ref = module.float()(x.double().float()).double()  # fp32 math as the reference's upper bound
    assert rel_err(y, y_e) <= 2 * OUTPUT[torch.bfloat16]
    assert rel_err(dx, dx_e) <= 2 * OUTPUT[torch.bfloat16]
    assert rel_err(y, ref) < OUTPUT[torch.bfloat16]


def test_near_miss_is_left_alone():
    module = NotRMSNorm()
    (y, dx, _), (y_e, dx_e, _) = _run(module, torch.randn(6, 32))
    assert not any(k.startswith("rewrite_") for k in counters["inductor_ext"])
    assert rel_err(y, y_e) < OUTPUT[torch.float32] and rel_err(dx, dx_e) < OUTPUT[torch.float32]


def test_rewrites_option_turns_rewrites_off():
    _run(LlamaRMSNorm(64), torch.randn(2, 64), options={"fastops.rewrites": False})
    assert not any(k.startswith("rewrite_") for k in counters["inductor_ext"])


def test_old_option_name_patterns_still_works_with_a_warning():
    with pytest.warns(FutureWarning, match="fastops.patterns is renamed fastops.rewrites"):
        assert not parse_options({"fastops.patterns": False}, env={})[0].runs("rewrites")
    with pytest.warns(FutureWarning, match="INDUCTOR_EXT_PATTERNS is renamed INDUCTOR_EXT_REWRITES"):
        assert not parse_options(None, env={"INDUCTOR_EXT_PATTERNS": "0"})[0].runs("rewrites")
    with pytest.raises(ValueError, match="fastops.patterns is the old name of fastops.rewrites; give only"):
        parse_options({"fastops.patterns": False, "fastops.rewrites": True}, env={})


class NormThenCacheWrite(torch.nn.Module):
    """A rewritten RMSNorm beside in-place writes whose results nothing reads (a static KV cache's
    ``index_copy_``, a step counter's ``add_``): the rewrites' dead-code pass must keep them."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(dim)

    def forward(self, x, cache, slots, steps):
        cache.index_copy_(0, slots, x)
        steps.add_(1)
        return self.norm(x)


def test_in_place_writes_with_unused_results_survive_the_rewrites():
    module = NormThenCacheWrite(32)
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True)
    x, slots = torch.randn(3, 32), torch.tensor([4, 0, 2])
    cache, steps = torch.zeros(6, 32), torch.zeros((), dtype=torch.long)
    with torch.no_grad():
        y = compiled(x, cache, slots, steps)
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] == 1
    torch.testing.assert_close(cache[slots], x, rtol=0, atol=0)
    assert not cache[[1, 3, 5]].any() and int(steps) == 1
    assert rel_err(y, module.norm(x)) < OUTPUT[torch.float32]


def test_generated_code_has_no_call_back_to_the_op():
    module = LlamaRMSNorm(64)
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True)
    with torch.no_grad():
        _, code = run_and_get_code(compiled, torch.randn(8, 64))
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] == 1
    assert "fastops" not in "\n".join(code)


def test_cpp_wrapper_option():
    module = LlamaRMSNorm(64)
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True, options={"cpp_wrapper": True})
    x = torch.randn(8, 64)
    with torch.no_grad():
        y, code = run_and_get_code(compiled, x)
        assert rel_err(y, module(x)) < OUTPUT[torch.float32]
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] == 1
    assert any('extern "C"' in c or "cpp_wrapper" in c or "AOTInductor" in c for c in code)


def test_dynamic_shapes_do_not_recompile():
    module = LlamaRMSNorm(64)
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows in (3, 17, 40):
            x = torch.randn(rows, 64)
            assert rel_err(compiled(x), module(x)) < OUTPUT[torch.float32]
    assert counters["stats"]["unique_graphs"] == 1


def test_parse_options_defaults_env_and_precedence():
    ours, rest = parse_options({"cpp_wrapper": True, "max_autotune": False}, env={})
    assert ours == BackendOptions(cpp_wrapper=True) and rest == {"max_autotune": False}
    assert ours.inductor_patches() == {
        "triton.multi_kernel": 1, "cpp_wrapper": True, "triton.autotune_at_compile_time": True
    }  # fmt: skip
    env = {"INDUCTOR_EXT_ROUTE": "kernel,cross_entropy=inductor", "INDUCTOR_EXT_REWRITES": "0"}
    ours, _ = parse_options(None, env=env)
    assert ours.route_for("rms_norm") == "kernel" and ours.route_for("cross_entropy") == "inductor"
    assert not ours.runs("rewrites") and ours.runs("causal_mask")
    ours, _ = parse_options({"fastops.route": {"rms_norm": "inductor"}}, env=env)  # option beats env
    assert ours.route_for("rms_norm") == "inductor" and ours.route_for("glu") == "auto"
    # Inductor's own multi-kernel setting is respected
    assert parse_options(None, env={"TORCHINDUCTOR_MULTI_KERNEL": "0"})[0].multi_kernel is None
    assert parse_options({"triton.multi_kernel": 0}, env={})[0].multi_kernel is None
    assert parse_options(None, env={"INDUCTOR_EXT_MULTI_KERNEL": "0"})[0].multi_kernel == 0


@pytest.mark.parametrize(
    "options,env,message",
    [
        ({"fastops.rout": "auto"}, {}, "unknown options"),
        ({"fastops.route": "fast"}, {}, "must be one of"),
        ({"fastops.route": 3}, {}, "must be a str or a dict"),
        (None, {"INDUCTOR_EXT_REWRITES": "maybe"}, "INDUCTOR_EXT_REWRITES must be"),
        ({"fastops.route": {"rms_norm": "kernel", "bogus_op": "kernel"}}, {}, r"unknown op families \['bogus_op'\]"),
        (None, {"INDUCTOR_EXT_ROUTE": "auto,rmsnorm=kernel"}, r"unknown op families \['rmsnorm'\]"),
        ({"fastops.multi_kernel": "yes"}, {}, "fastops.multi_kernel must be 0, 1, 2 or 3"),
        ({"fastops.multi_kernel": 7}, {}, "fastops.multi_kernel must be 0, 1, 2 or 3"),
        (None, {"INDUCTOR_EXT_MULTI_KERNEL": "on"}, "INDUCTOR_EXT_MULTI_KERNEL must be 0, 1, 2 or 3"),
        ({"fastops.document_mask": "no"}, {}, "fastops.document_mask must be True or False"),
        ({"fastops._passes_off": ("causal_masks",)}, {}, r"passes turned off that do not exist: \['causal_masks'\]"),
        (None, {"INDUCTOR_EXT_PASSES_OFF": "patern"}, r"passes turned off that do not exist: \['patern'\]"),
        ({"fastops.assume_no_padding": 1}, {}, "fastops.assume_no_padding must be True or False"),
        ("fastops.route=kernel", {}, "options must be a dict of option name -> value, got str"),
    ],
)
def test_bad_options_are_named(options, env, message):
    with pytest.raises((ValueError, TypeError), match=message):
        parse_options(options, env=env)


def test_bad_option_through_torch_compile():
    compiled = torch.compile(LlamaRMSNorm(8), backend="fastops_inductor", options={"fastops.route": "fast"})
    with pytest.raises(Exception, match="must be one of"):
        compiled(torch.randn(2, 8))


def test_cache_pass_uuid_tracks_stage_and_state_and_chains_user_pass():
    seen = []

    class UserPass(InductorPasses):  # any CustomGraphPass
        def __call__(self, graph):
            seen.append(graph)

    context = PassContext(BackendOptions())
    a, b = InductorPasses("post_grad", context, "route=auto"), InductorPasses("post_grad", context, "route=kernel")
    assert a.uuid() != b.uuid() and a.uuid() == InductorPasses("post_grad", context, "route=auto").uuid()
    assert InductorPasses("joint", context, "route=auto").uuid() != a.uuid()
    chained = InductorPasses("post_grad", context, "route=auto", chained=UserPass("post_grad", context, "user"))
    assert chained.uuid() != a.uuid()
    chained(torch.fx.Graph())
    assert len(seen) == 1


def test_fx_graph_cache_misses_when_our_options_change(monkeypatch, tmp_path):
    """Same model, different fastops options: the second compile must not be served from the cache."""
    from torch._inductor import config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    module, x = LlamaRMSNorm(32), torch.randn(4, 32)
    with torch.no_grad(), config.patch(fx_graph_cache=True):
        for route in ("auto", "inductor", "auto"):
            torch._dynamo.reset()
            torch.compile(module, backend="fastops_inductor", options={"fastops.route": route})(x)
    assert counters["inductor"]["fxgraph_cache_miss"] == 2
    assert counters["inductor"]["fxgraph_cache_hit"] == 1


def test_kernels_from_the_fx_graph_cache_get_their_hash_lock_back():
    """inductor_ext/_compat/torch_fixes.py, installed during our compiles: a kernel loaded from the FX-graph
    cache comes with ``fn._hash_lock = None``, on which a multi-kernel's ``fn.cache_key`` raised (seen on
    the H200 with torch 2.11, second process); torch's own ``StaticAutotunerFuture`` leaves it None.
    tests/gpu/test_backend_gpu.py checks the real cache hit."""
    import threading
    import types

    from torch._inductor.codecache import StaticAutotunerFuture

    from inductor_ext import _compat
    from inductor_ext._compat import torch_fixes

    class CachedKernel:  # what the FX-graph cache hands back: a CachingAutotuner after prepare_for_pickle
        def __init__(self):
            self.fn = types.SimpleNamespace(_hash_lock=None)

        def recheck_autotune_cache(self, reload_kernel_from_src):
            pass

        def precompile(self, **kwargs):
            pass

    def cached_kernel_lock():
        future = StaticAutotunerFuture(CachedKernel())
        future.reload_kernel_from_src = lambda: None
        return future.result().fn._hash_lock

    assert cached_kernel_lock() is None  # torch's own result()
    with _compat.applied(torch_fixes.PATCHES):
        lock = cached_kernel_lock()
    assert isinstance(lock, type(threading.RLock()))
    with lock:  # what JITFunction.cache_key does
        pass


def test_backend_starts_inductors_compile_workers_before_route_timing(monkeypatch):
    """Route timing compiles the ops' math with Inductor before the graph: the compile workers must
    already be starting then (as the "inductor" backend starts them), or Inductor compiles every
    Triton config of those kernels in this process, one by one, until they are up."""
    import torch._inductor.async_compile

    from inductor_ext.inductor.route_planner import RoutePlanner

    events = []
    monkeypatch.setattr(torch._inductor.async_compile, "maybe_warm_pool", lambda: events.append("warm pool"))
    plan_graph = RoutePlanner.plan_graph
    monkeypatch.setattr(RoutePlanner, "plan_graph", lambda self, gm: events.append("plan") or plan_graph(self, gm))
    torch.compile(LlamaRMSNorm(32), backend="fastops_inductor", fullgraph=True)(torch.randn(4, 32))
    assert events[:2] == ["warm pool", "plan"]


def test_route_timing_out_of_memory_falls_back_to_our_kernels(monkeypatch, caplog):
    """Route timing allocates random inputs beside whatever the process holds (a training step's
    weights and activations): running out of GPU memory there must not fail the compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_ext.inductor import route_planner
    from inductor_ext.ops.rms_norm import rms_norm_family

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(route_planner, "decide_routes", out_of_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with FakeTensorMode():  # shapes on a "cuda" device, no GPU needed
        x, w = (
            torch.empty(64, 256, device="cuda", dtype=torch.bfloat16),
            torch.empty(256, device="cuda", dtype=torch.bfloat16),
        )
    args = (x, w, 1e-6, 0.0, "llama")
    planner = route_planner.RoutePlanner(BackendOptions())
    planner.plan_call(rms_norm_family, args)
    (decision,) = planner.decisions.values()
    assert (decision.route, decision.reason) == ("kernel", "untimed: out of GPU memory")
    assert not planner.traces_math("fastops::rms_norm_fwd", args)
    assert "out of GPU memory" in caplog.text


def test_route_timing_runs_inside_a_dynamo_compile(monkeypatch, caplog):
    """measure_routes is called from within a backend (Dynamo's tracing context and fake tensors
    active): it must build real inputs, run the kernels, compile the math with Inductor and time
    both. Timed with a CPU clock here (CUDA events on a GPU)."""
    import time

    from inductor_ext.ops.rms_norm import rms_norm_family
    from inductor_ext.tuning import routes, timing

    def cpu_median_ms(run, make_inputs):
        inputs = make_inputs()
        run(inputs)
        start = time.perf_counter()
        run(inputs)
        return (time.perf_counter() - start) * 1e3, 0.0

    monkeypatch.setattr(routes, "median_ms", cpu_median_ms)
    assert timing.median_ms is not cpu_median_ms
    decisions = []

    def backend(gm, example_inputs):
        x, w = example_inputs
        options = BackendOptions(cpp_wrapper=True)
        decisions.extend(routes.measure_routes(rms_norm_family, (x.view(-1, 48), w, 1e-6, 0.0, "llama"), options))
        return gm.forward

    x, w = torch.randn(6, 48), torch.randn(48)
    with caplog.at_level("INFO", logger="inductor_ext.tuning.routes"):
        torch.compile(lambda x, w: x * w, backend=backend, fullgraph=True)(x, w)
    # where the time went, per stage (what a cold compile's cost is made of)
    assert "route timing of rms_norm, seconds: first launches beside Inductor's compiles" in caplog.text
    assert "fastops::rms_norm_bwd inductor timing" in caplog.text
    assert [d.op for d in decisions] == ["fastops::rms_norm_fwd", "fastops::rms_norm_bwd"]
    assert all(d.kernel_ms > 0 and d.inductor_ms > 0 and d.route in ("kernel", "inductor") for d in decisions)
    assert all(d.kernel_spread_ms == 0.0 and d.inductor_spread_ms == 0.0 for d in decisions)  # spreads recorded
    assert decisions[1].signature.startswith("(float32[6,48], float32[6,48], float32[48], float32[6]")


def test_route_timing_compiles_inductor_route_beside_first_launches(monkeypatch):
    """Inductor's compile of a direction's math runs on another thread while our kernels' first
    launch compiles and tunes (they were one after the other: 6.9 s of first launches and 7.5 s
    of Inductor compiles in a cold 4-family compile on the H200), on the first launch's own
    inputs (no second set held). Each side waits, with a timeout, for the other to have started:
    both see the other only if they run at once."""
    import threading

    from inductor_ext.ops.rms_norm import rms_norm_family
    from inductor_ext.tuning import routes

    monkeypatch.setattr(routes, "median_ms", lambda run, make_inputs: (run(make_inputs()), (1.0, 0.0))[1])
    compile_started, launch_started = threading.Event(), threading.Event()
    seen = {"compiles": [], "launch_saw_compile": None}
    compile_math, capture = routes.compile_math, routes.capture_backward_args

    def slow_compile(math, args, options):
        if not compile_started.is_set():  # the forward's
            compile_started.set()
            seen["compile_saw_launch"] = launch_started.wait(timeout=20)
        seen["compiles"].append((threading.get_ident(), [id(a) for a in args if isinstance(a, torch.Tensor)]))
        return compile_math(math, args, options)

    def waiting_capture(family, fwd_args, **kwargs):
        launch_started.set()
        seen["launch_saw_compile"] = compile_started.wait(timeout=20)
        seen["fwd_args"] = [id(a) for a in fwd_args if isinstance(a, torch.Tensor)]
        seen["route_thread"] = threading.get_ident()
        return capture(family, fwd_args, **kwargs)

    monkeypatch.setattr(routes, "compile_math", slow_compile)
    monkeypatch.setattr(routes, "capture_backward_args", waiting_capture)
    args = (torch.empty(6, 48, device="meta"), torch.empty(48, device="meta"), 1e-6, 0.0, "llama")
    decisions = routes.measure_routes(rms_norm_family, args, BackendOptions(), torch.device("cpu"))
    assert [d.op for d in decisions] == ["fastops::rms_norm_fwd", "fastops::rms_norm_bwd"]
    assert seen["launch_saw_compile"] and seen["compile_saw_launch"]
    (fwd_thread, fwd_compile_args), (bwd_thread, _) = seen["compiles"]
    assert fwd_thread == bwd_thread != seen["route_thread"]
    assert fwd_compile_args == seen["fwd_args"]  # the forward's first launch's inputs, not a copy


def test_inductor_route_is_traced_without_running_the_math():
    """compile_math traces the op's math on fake tensors: run on the real ones, a cross-entropy
    backward's fp32 intermediates took its route timing to 8.3 GiB for 2 GiB of logits (H200)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from inductor_ext.library.registration import DECOMPOSITIONS
    from inductor_ext.tuning import routes

    math = DECOMPOSITIONS[torch.ops.fastops.cross_entropy_fwd.default]
    seen = []

    def recording(logits, *rest):
        seen.append(type(logits))
        return math(logits, *rest)

    logits, labels = torch.randn(8, 50), torch.randint(0, 50, (8,))
    args = [logits, labels, -100, 0.0, 0.0, 0.0, "mean"]
    compiled = routes.compile_math(recording, args, BackendOptions())
    assert seen and all(issubclass(t, FakeTensor) for t in seen)
    torch.testing.assert_close(compiled(args), math(*args))


def _ce_meta_call(rows, classes):
    logits = torch.empty(rows, classes, device="meta")
    return [logits, torch.empty(rows, dtype=torch.int64, device="meta"), -100, 0.0, 0.0, 0.0, "mean"]


@pytest.mark.parametrize("large", [True, False], ids=["above_threshold", "below"])
def test_large_cross_entropy_backward_is_timed_in_place(monkeypatch, large):
    """Route timing holds a cross-entropy backward's logits, not also their gradient, when the
    logits are large (on the H200: 0.98 GiB of logits and 0.98 GiB of gradient made the
    tuner's peak). Both routes then write the functional op's gradient over the logits, our
    kernels through the functional op's autotuner (which keeps no copy of the logits); the
    direction keeps the functional op's name, under which the decision is stored."""
    from inductor_ext.kernels.cross_entropy import cross_entropy_bwd_inplace_kernel, cross_entropy_bwd_kernel
    from inductor_ext.ops.cross_entropy import cross_entropy_family
    from inductor_ext.tuning import routes
    from inductor_ext.tuning.launch_settings import record_autotuned_launches

    monkeypatch.setattr(routes, "IN_PLACE_TIMING_MIN_BYTES", 0 if large else 10**9)
    with record_autotuned_launches() as launches:
        fwd, bwd = routes.call_directions(cross_entropy_family, _ce_meta_call(6, 50), torch.device("cpu"))
    launched = [kernel for kernel, _, _ in launches]
    assert (fwd.op, bwd.op) == (cross_entropy_family.fwd, cross_entropy_family.bwd)
    # one backward launch (its first), after the forward: none while its arguments were captured
    assert launched.count(cross_entropy_bwd_kernel) == 1 and cross_entropy_bwd_inplace_kernel not in launched

    args = random_inputs(bwd.op, bwd.templates, "cpu")
    expected = cross_entropy_family.run_bwd_direct(*args)
    for route in ("kernel", "inductor"):
        run_args = [*args[:1], args[1].clone(), *args[2:]]
        logits = run_args[1].clone()
        if route == "kernel":
            out = bwd.direct(*run_args)
        else:
            out = routes.compile_math(bwd.math, run_args, BackendOptions())(run_args)
        if large:
            torch.testing.assert_close(run_args[1], expected, rtol=1e-5, atol=1e-6)
        else:
            out = out[0] if isinstance(out, (tuple, list)) else out
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(run_args[1], logits)  # the functional op leaves the logits alone


def test_route_timing_threads_run_with_the_callers_launch_settings(monkeypatch):
    """measure_routes times our kernels on a worker thread and compiles Inductor's route on another;
    both run in a copy of the caller's context. So the standalone tuner's thorough_benchmarks around
    decide_routes (inductor_ext.tuning.cli.tune) reaches the first launches it times, as do a forced
    config and a launch log. The timings and Inductor's compile are stubbed (no GPU); the first
    launches are real."""
    import threading

    from inductor_ext.kernels.cross_entropy import cross_entropy_bwd_kernel, cross_entropy_fwd_kernel
    from inductor_ext.ops.cross_entropy import cross_entropy_family
    from inductor_ext.tuning import routes
    from inductor_ext.tuning.launch_settings import (
        autotuned_launch_log,
        force_launch_config,
        forced_launch_config,
        quick_first_launch_enabled,
        record_autotuned_launches,
        thorough_benchmarks,
    )

    seen = {}

    def settings():
        return threading.get_ident(), quick_first_launch_enabled(), forced_launch_config(), autotuned_launch_log()

    call_directions = routes.call_directions

    def timing_thread_directions(*args, **kwargs):
        seen["timing"] = settings()
        return call_directions(*args, **kwargs)

    def compile_math(math, args, options):
        seen.setdefault("inductor", settings())
        return lambda inputs: None

    monkeypatch.setattr(routes, "call_directions", timing_thread_directions)
    monkeypatch.setattr(routes, "compile_math", compile_math)
    monkeypatch.setattr(routes, "time_direct", lambda *args: (1.0, 0.0))
    monkeypatch.setattr(routes, "median_ms", lambda *args: (2.0, 0.0))
    forced = {"NOT_A_PARAMETER": 1}  # forced for no kernel: the launches go on as usual
    with thorough_benchmarks(), force_launch_config(forced), record_autotuned_launches() as launches:
        decisions = routes.measure_routes(
            cross_entropy_family, _ce_meta_call(6, 50), BackendOptions(), torch.device("cpu")
        )
    assert [d.route for d in decisions] == ["kernel", "kernel"]
    here = threading.get_ident()
    assert seen["timing"][0] not in (here, seen["inductor"][0]) and seen["inductor"][0] != here
    assert seen["timing"][1:] == seen["inductor"][1:] == (False, forced, launches)
    assert {kernel for kernel, _, _ in launches} >= {cross_entropy_fwd_kernel, cross_entropy_bwd_kernel}


@pytest.mark.parametrize("make,expect_weight", [(LlamaRMSNorm, True), (GemmaRMSNorm, True), (FunctionalRMSNorm, True),
                                                (lambda n: torch.nn.RMSNorm(n, elementwise_affine=False), False)])  # fmt: skip
def test_rewrite_folds_the_weight_into_the_op(make, expect_weight):
    """The weight multiply belongs to the match: a rewrite of the cast alone would leave an
    extra elementwise pass over y (twice the forward's memory traffic)."""
    from inductor_ext.inductor.rewrites import apply_rewrites
    from inductor_ext.ops.rms_norm import rms_norm_family

    calls = []

    def backend(gm, example_inputs):
        apply_rewrites(gm)
        calls.extend(n for n in gm.graph.nodes if n.target is rms_norm_family.fwd)
        assert not any(n.target in (torch.rsqrt, operator.mul, torch.mul) for n in gm.graph.nodes)
        return gm.forward

    module = make(32)
    torch.compile(module, backend=backend, fullgraph=True)(torch.randn(4, 32))
    assert len(calls) == 1
    weight = calls[0].args[1]
    assert (weight is not None) == expect_weight


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_glu_mlp_is_rewritten(act):
    module = LlamaMLP(32, 80, act)
    (y, dx, dws), (y_e, dx_e, dws_e) = _run(module, torch.randn(2, 7, 32))
    assert counters["inductor_ext"]["rewrite_glu"] == 1
    assert counters["inductor_ext"]["fastops::glu_bwd->inductor"] == 1
    tol = OUTPUT[torch.float32]
    assert rel_err(y, y_e) < tol and rel_err(dx, dx_e) < tol
    for dw, dw_e in zip(dws, dws_e):
        assert rel_err(dw, dw_e) < 10 * tol


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_is_rewritten_with_ignored_labels(reduction, dtype):
    module = CausalLMLoss(reduction)
    logits = torch.randn(2, 9, 50, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = -100
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True)
    loss = compiled(logits, labels)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    loss_ref = module(logits.double(), labels)
    (grad_ref,) = torch.autograd.grad(loss_ref.sum(), logits)
    assert counters["inductor_ext"]["rewrite_cross_entropy"] == 1
    assert counters["inductor_ext"]["fastops::cross_entropy_bwd->inductor"] == 1
    assert loss.dtype == torch.float32 and loss.shape == loss_ref.shape
    assert rel_err(loss, loss_ref) < 1e-5
    assert rel_err(grad, grad_ref) < OUTPUT[dtype]
    assert grad[0, :3].abs().max() == 0  # ignored rows get no gradient


class _UpcastLoss(torch.nn.Module):
    def __init__(self, flatten):
        super().__init__()
        self.flatten = flatten

    def forward(self, logits, labels):
        return torch.nn.functional.cross_entropy(self.flatten(logits.float()), labels.view(-1))


@pytest.mark.parametrize(
    ("flatten", "shape"),
    [
        (lambda z: z, (6, 50)),
        (lambda z: z.view(-1, z.shape[-1]), (2, 3, 50)),  # HF ForCausalLMLoss: upcast, then flatten
        (lambda z: z.reshape(-1, z.shape[-1]), (2, 3, 50)),
        (lambda z: torch.reshape(z, (-1, z.shape[-1])), (2, 3, 50)),
    ],
    ids=["2d", "view", "reshape", "torch.reshape"],
)
def test_cross_entropy_reads_16_bit_logits_through_the_upcast_and_flatten(flatten, shape):
    """The op reads the bf16 logits (a flatten of them), never an fp32 copy: the upcast would read
    the logits, write twice their bytes, and double what the op reads and writes."""
    logits = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    labels = torch.empty(shape[:-1], dtype=torch.int64, device="meta")
    (call,) = trace_calls(_UpcastLoss(flatten), (logits, labels), {})
    assert call.op == "fastops::cross_entropy_fwd"
    assert call.args[0].dtype == torch.bfloat16 and tuple(call.args[0].shape) == (6, 50)


def test_bit_reinterpreting_view_is_not_taken_for_a_flatten():
    """``z.view(dtype)`` after the upcast is no reshape: the op gets the fp32 tensor it names."""
    logits = torch.empty(6, 50, dtype=torch.bfloat16, device="meta")
    labels = torch.empty(6, dtype=torch.int64, device="meta")
    (call,) = trace_calls(_UpcastLoss(lambda z: z.view(torch.float32)), (logits, labels), {})
    assert call.args[0].dtype == torch.float32


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_hf_rope_is_rewritten_as_one_call_for_q_and_k(unsqueeze_dim):
    b, s, hq, hk, d = 2, 7, 4, 2, 16
    layout = (lambda h: (b, h, s, d)) if unsqueeze_dim == 1 else (lambda h: (b, s, h, d))
    q = torch.randn(layout(hq), requires_grad=True)
    k = torch.randn(layout(hk), requires_grad=True)
    angles = torch.randn(b, s, d // 2).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()

    def attn_inputs(q, k):
        q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return q_embed * 2, k_embed + 1  # consumers of both outputs

    compiled = torch.compile(attn_inputs, backend="fastops_inductor", fullgraph=True)
    outs = compiled(q, k)
    grads = torch.autograd.grad(sum(o.square().sum() for o in outs), (q, k))
    outs_ref = attn_inputs(q.double(), k.double())
    grads_ref = torch.autograd.grad(sum(o.square().sum() for o in outs_ref), (q, k))
    assert counters["inductor_ext"]["rewrite_rope_hf"] == 1
    assert counters["inductor_ext"]["fastops::rope_bwd->inductor"] == 1
    for got, ref in zip((*outs, *grads), (*outs_ref, *grads_ref)):
        assert rel_err(got, ref) < OUTPUT[torch.float32]


def test_lone_rotation_is_left_alone():
    q = torch.randn(1, 2, 5, 8)
    angles = torch.randn(1, 5, 4).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    compiled = torch.compile(lambda q: q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1),
                             backend="fastops_inductor", fullgraph=True)  # fmt: skip
    assert rel_err(compiled(q), q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)) < 1e-6
    assert counters["inductor_ext"]["rewrite_rope_hf"] == 0


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_rewritten(affine):
    module = torch.nn.LayerNorm(48, elementwise_affine=affine)
    if affine:
        torch.nn.init.normal_(module.weight, 1.0, 0.1)
        torch.nn.init.normal_(module.bias, 0.0, 0.1)
    (y, dx, dws), (y_e, dx_e, dws_e) = _run(module, torch.randn(3, 5, 48))
    assert counters["inductor_ext"]["rewrite_layer_norm"] == 1
    assert counters["inductor_ext"]["fastops::layer_norm_bwd->inductor"] == 1
    tol = OUTPUT[torch.float32]
    assert rel_err(y, y_e) < tol and rel_err(dx, dx_e) < tol
    for dw, dw_e in zip(dws, dws_e):
        assert rel_err(dw, dw_e) < reduced_grad(torch.float32, 15)


def test_hf_spelled_decoder_stack_is_rewritten_and_matches_the_fastops_spelling():
    """The model of ``python -m inductor_ext.bench backend``: every norm, RoPE and MLP of the
    unmodified (HF-spelled) stack becomes a fastops op, and it computes what the fastops spelling does."""
    from benchmarks.llama_style import LlamaStyleDecoder

    config = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 96, "layers": 2, "max_positions": 64}
    hf = LlamaStyleDecoder(**config, spelling="hf")
    ours = LlamaStyleDecoder(**config, spelling="fastops")
    with torch.no_grad():
        for p in hf.parameters():
            p.uniform_(-0.2, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 16, 64)
    (y, dx, dparams), (y_ref, dx_ref, dparams_ref) = _run(hf, x)
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] == 5  # 2 per layer and the final norm
    assert counters["inductor_ext"]["rewrite_add_rms_norm"] == 4  # every norm of a residual sum
    assert counters["inductor_ext"]["fastops::add_rms_norm_bwd->inductor"] == 4  # and their backwards
    assert counters["inductor_ext"]["rewrite_rope_hf"] == 2
    assert counters["inductor_ext"]["rewrite_glu"] == 2
    assert rel_err(y, y_ref) < OUTPUT[torch.float32] and rel_err(dx, dx_ref) < OUTPUT[torch.float32]
    for got, ref in zip(dparams, dparams_ref):
        assert rel_err(got, ref) < reduced_grad(torch.float32, 32)
    with torch.no_grad():
        assert rel_err(ours(x), y_ref) < OUTPUT[torch.float32]


def test_partial_rotary_hf_rope_is_rewritten_on_the_rotary_slices():
    """GPT-NeoX/Phi spelling (rotate the first ``rot`` dims, concatenate the rest back): the rotation
    of both slices becomes one op call; the concatenation stays Inductor's."""
    b, s, hq, hk, d, rot = 2, 7, 4, 2, 16, 8
    q = torch.randn(b, hq, s, d, requires_grad=True)
    k = torch.randn(b, hk, s, d, requires_grad=True)
    angles = torch.randn(b, s, rot // 2).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()

    def f(q, k):
        return apply_rotary_pos_emb_ref(q, k, cos, sin)  # HF's partial-rotary form (see its docstring)

    outs = torch.compile(f, backend="fastops_inductor", fullgraph=True)(q, k)
    grads = torch.autograd.grad(sum(o.square().sum() for o in outs), (q, k))
    outs_ref = f(q.double(), k.double())
    grads_ref = torch.autograd.grad(sum(o.square().sum() for o in outs_ref), (q, k))
    assert counters["inductor_ext"]["rewrite_rope_hf"] == 1
    for got, ref in zip((*outs, *grads), (*outs_ref, *grads_ref)):
        assert rel_err(got, ref) < OUTPUT[torch.float32]


class ResidualNorm(torch.nn.Module):
    """``h = x + f(x)``, ``norm(h)``, and h again in the next residual add (a pre-norm block);
    ``early_use`` also reads h before the norm, ``broadcast`` adds a row vector instead."""

    def __init__(self, n, early_use=False, broadcast=False):
        super().__init__()
        self.norm, self.proj = LlamaRMSNorm(n), torch.nn.Linear(n, n)
        self.bias = torch.nn.Parameter(torch.randn(n))
        self.early_use, self.broadcast = early_use, broadcast

    def forward(self, x):
        h = x + (self.bias if self.broadcast else self.proj(x))
        early = h.sum(-1, keepdim=True) if self.early_use else 0.0
        return h + self.proj(self.norm(h)) + early


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_residual_add_is_fused_into_the_norm_forward_and_backward(dtype):
    module = ResidualNorm(64).to(dtype)
    (y, dx, dparams), (y_e, dx_e, dparams_e) = _run(module, torch.randn(2, 7, 64, dtype=dtype))
    assert counters["inductor_ext"]["rewrite_add_rms_norm"] == 1
    assert counters["inductor_ext"]["fastops::add_rms_norm_bwd->inductor"] == 1
    assert "fastops::rms_norm_fwd->inductor" not in counters["inductor_ext"]
    assert sum(counters["graph_break"].values()) == 0
    tol = 2 * OUTPUT[dtype]  # eager rounds the residual branch's two gradients separately
    assert rel_err(y, y_e) < tol and rel_err(dx, dx_e) < tol
    for got, ref in zip(dparams, dparams_e):
        assert (got is None) == (ref is None)  # the unused bias gets none
        assert ref is None or rel_err(got, ref) < tol + reduced_grad(dtype, 14)


@pytest.mark.parametrize("variant", ["early_use", "broadcast"])
def test_residual_add_near_misses_keep_the_plain_norm(variant):
    module = ResidualNorm(64, **{variant: True})
    (y, dx, _), (y_e, dx_e, _) = _run(module, torch.randn(2, 7, 64))
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] == 1
    assert "rewrite_add_rms_norm" not in counters["inductor_ext"]
    assert rel_err(y, y_e) < OUTPUT[torch.float32] and rel_err(dx, dx_e) < OUTPUT[torch.float32]

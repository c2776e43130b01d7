"""cpp_wrapper training on CPU: the backward is compiled lazily, after ``compile_fx`` has returned,
and must still be compiled with the cpp-wrapper config (``triton.store_cubin``, compile-time
autotuning). Without it, on CUDA, the backward's kernels never reach ``CudaKernelParamCache`` and
the C++ codegen asserts ``CudaKernelParamCache not populated`` (torch 2.11; the workaround is in
inductor_ext/_compat/torch_fixes.py). The cubins themselves need a GPU: tests/gpu/test_cpp_wrapper_training_gpu.py.
"""

import pytest
import torch
import torch._inductor.compile_fx as compile_fx_module
from torch._inductor import config
from torch._inductor.debug import DebugContext
from torch._inductor.graph import GraphLowering

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext import _compat
from inductor_ext._compat import torch_fixes

# compile_fx_inner's own defaults for the graph kwargs (torch 2.11 and 2.13 alike)
_INNER_DEFAULTS = {
    "cudagraphs": None,
    "static_input_idxs": (),
    "is_backward": False,
    "graph_id": None,
    "cpp_wrapper": False,
    "fx_wrapper": False,
    "is_inference": False,
    "boxed_forward_device_index": None,
    "layout_opt": None,
    "extern_node_serializer": None,
}


def _compile_fx_inner_as_in_torch_2_11(gm, example_inputs, **kwargs):
    """torch 2.11's ``compile_fx_inner`` as far as config goes: it does not apply the cpp-wrapper
    config itself (torch 2.13's does), and reads ``_compile_fx_inner`` at call time."""
    for key, value in _INNER_DEFAULTS.items():
        kwargs.setdefault(key, value)
    with torch.utils._python_dispatch._disable_current_modes(), DebugContext():
        return compile_fx_module._compile_fx_inner(gm, example_inputs, **kwargs)


def _record_cpp_wrapper_codegen(monkeypatch) -> list[tuple[bool, bool]]:
    """``(is_backward, triton.store_cubin)`` of each graph generated as C++ from now on."""
    seen: list[tuple[bool, bool]] = []
    original = GraphLowering.codegen_with_cpp_wrapper

    def recording(self, *args, **kwargs):
        seen.append((self.is_backward, bool(config.triton.store_cubin)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GraphLowering, "codegen_with_cpp_wrapper", recording)
    return seen


def _train_step_seen(monkeypatch, backend) -> tuple[list, list]:
    """What the C++ codegen saw after the forward and after the backward of one step of a small
    MLP compiled with ``backend`` and cpp_wrapper passed per compile (not process-wide)."""
    seen = _record_cpp_wrapper_codegen(monkeypatch)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    assert not config.cpp_wrapper and not config.triton.store_cubin
    with config.patch(force_disable_caches=True):
        loss = torch.compile(model, backend=backend)(x).square().mean()
        after_forward = list(seen)
        loss.backward()
    return after_forward, seen


def _compile_fx_with_options_cpp_wrapper(gm, example_inputs):
    """The stock backend with ``options={"cpp_wrapper": True}``, on torch 2.11's compile_fx_inner."""
    return compile_fx_module.compile_fx(
        gm, example_inputs, inner_compile=_compile_fx_inner_as_in_torch_2_11, config_patches={"cpp_wrapper": True}
    )


def test_without_the_fix_the_lazy_backward_is_generated_without_store_cubin(monkeypatch):
    """The bug, reproduced on CPU with torch 2.11's compile_fx_inner: the forward is generated
    inside compile_fx's cpp-wrapper patch, the backward only at ``.backward()``, outside it."""
    after_forward, seen = _train_step_seen(monkeypatch, _compile_fx_with_options_cpp_wrapper)
    assert after_forward == [(False, True)]  # the backward is not compiled yet
    assert seen == [(False, True), (True, False)]


def test_with_the_fix_the_lazy_backward_gets_the_cpp_wrapper_config(monkeypatch):
    """The fix installed around each compile, as the backend's ``compile_fx_inner_patched`` does (forced
    on where torch has the upstream fix, to run torch 2.11's path)."""
    monkeypatch.setattr(torch_fixes, "compile_fx_inner_applies_cpp_wrapper_config", lambda: False)

    def inner_with_the_fix(gm, example_inputs, **kwargs):
        with _compat.applied(torch_fixes.PATCHES):
            return _compile_fx_inner_as_in_torch_2_11(gm, example_inputs, **kwargs)

    def backend(gm, example_inputs):
        return compile_fx_module.compile_fx(
            gm, example_inputs, inner_compile=inner_with_the_fix, config_patches={"cpp_wrapper": True}
        )

    after_forward, seen = _train_step_seen(monkeypatch, backend)
    assert after_forward == [(False, True)]
    assert seen == [(False, True), (True, True)]


def test_fastops_inductor_backward_gets_the_cpp_wrapper_config(monkeypatch):
    """Our backend with ``options={"cpp_wrapper": True}``, on the installed torch (with the upstream
    fix or ours), forward and backward."""
    seen = _record_cpp_wrapper_codegen(monkeypatch)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with config.patch(force_disable_caches=True):
        compiled = torch.compile(model, backend="fastops_inductor", options={"cpp_wrapper": True})
        loss = compiled(x).square().mean()
        loss.backward()
    assert seen == [(False, True), (True, True)]


def test_the_fix_patches_only_a_cpp_wrapper_graph_compiled_outside_compile_fx(monkeypatch):
    seen = []

    def compile_graph(gm, example_inputs, **graph_kwargs):
        seen.append((config.triton.store_cubin, config.triton.autotune_at_compile_time))
        return "compiled"

    wrapped = torch_fixes._with_cpp_wrapper_config(compile_graph)
    default_autotune = config.triton.autotune_at_compile_time
    # our backend's own patch (options), which compile_fx re-enters around inner_compile
    with config.patch({"triton.autotune_at_compile_time": True}):
        assert wrapped(None, [], cpp_wrapper=True, is_backward=True) == "compiled"
    wrapped(None, [], cpp_wrapper=False, is_backward=True)
    assert seen == [(True, True), (False, default_autotune)]
    assert not config.triton.store_cubin  # the patch ended with the compile

    def not_needed() -> dict:
        raise AssertionError("compile_fx's own patch is active: nothing to re-apply")

    monkeypatch.setattr(compile_fx_module, "get_cpp_wrapper_config", not_needed)
    with config.patch({"triton.store_cubin": True}):  # inside compile_fx (the forward)
        wrapped(None, [], cpp_wrapper=True)


def test_the_fix_is_installed_only_where_torch_lacks_it_and_only_while_compiling(monkeypatch):
    (patch,) = [p for p in torch_fixes.PATCHES if p.target.endswith(":_compile_fx_inner")]
    torchs = compile_fx_module._compile_fx_inner
    if torch.__version__ >= (2, 13):
        assert torch_fixes.compile_fx_inner_applies_cpp_wrapper_config()  # the upstream fix
        with _compat.applied([patch]):
            assert compile_fx_module._compile_fx_inner is torchs
    monkeypatch.setattr(torch_fixes, "compile_fx_inner_applies_cpp_wrapper_config", lambda: False)
    with _compat.applied([patch]):
        once = compile_fx_module._compile_fx_inner
        with _compat.applied([patch]):  # nested (a lazy backward inside a compile): installed once
            assert compile_fx_module._compile_fx_inner is once
        assert once is not torchs and once.__wrapped__ is torchs
    assert compile_fx_module._compile_fx_inner is torchs


@pytest.fixture(autouse=True)
def _no_process_wide_cpp_wrapper():
    # the bug needs cpp_wrapper per compile: a process-wide one survives into the lazy backward
    with config.patch({"cpp_wrapper": False, "triton.store_cubin": False}):
        yield

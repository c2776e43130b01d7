"""``inductor_ext.rms_norm`` / ``inductor_ext.nn.RMSNorm`` under ``torch.compile(fullgraph=True)`` on CPU.

On CPU the compiled graph runs the ops' CPU branch (aten math, which Inductor turns
into C++), while eager runs the Triton kernels under the interpreter: agreement
between the two checks both the CPU branch and the autograd wiring of the
registered ops. Compiles cost 5-20 s each on two cores, so shapes are small and
each test compiles once or twice.
"""

import pytest
import torch
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext
from tests.tolerances import OUTPUT, reduced_grad, rel_err

FP32_TOL = OUTPUT[torch.float32]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _graphs_compiled() -> int:
    """Graphs Dynamo produced (a recompile adds one; a restart of the analysis does not)."""
    return counters["stats"]["unique_graphs"]


def _fwd_bwd(fn, x, weight, dy):
    """Output and grads of ``fn(x, weight)`` for the cotangent ``dy`` (fresh leaves each call)."""
    x = x.detach().clone().requires_grad_()
    w = None if weight is None else weight.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, None if w is None else w.grad


def _assert_matches(got, expected, rows: int) -> None:
    (y, dx, dw), (y_e, dx_e, dw_e) = got, expected
    assert y.shape == y_e.shape and y.dtype == y_e.dtype
    assert rel_err(y, y_e) < FP32_TOL, ("y", rel_err(y, y_e))
    assert dx.shape == dx_e.shape
    assert rel_err(dx, dx_e) < FP32_TOL, ("dx", rel_err(dx, dx_e))
    assert (dw is None) == (dw_e is None)
    if dw is not None:
        assert dw.shape == dw_e.shape
        assert rel_err(dw, dw_e) < reduced_grad(torch.float32, rows), ("dw", rel_err(dw, dw_e))


def _inputs(shape, with_weight: bool):
    x = torch.randn(shape)
    w = (1 + 0.1 * torch.randn(shape[-1])) if with_weight else None
    return x, w, torch.randn(shape)


VARIANTS = [
    # (shape, weight?, offset, casting)
    pytest.param((3, 5, 96), True, 0.0, "llama", id="llama-weight"),
    pytest.param((3, 5, 96), False, 0.0, "llama", id="llama-no-weight"),
    pytest.param((2, 7, 123), True, 1.0, "gemma", id="gemma-offset1"),
    pytest.param((4, 77), True, 1.0, "llama", id="llama-offset1-2d"),
]


@pytest.mark.parametrize("shape, with_weight, offset, casting", VARIANTS)
def test_fullgraph_static_forward_backward_match_eager(shape, with_weight, offset, casting):
    x, w, dy = _inputs(shape, with_weight)

    def f(x, w):
        return inductor_ext.rms_norm(x, w, 1e-6, offset=offset, casting=casting)

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    got = _fwd_bwd(compiled, x, w, dy)
    expected = _fwd_bwd(f, x, w, dy)

    assert _graphs_compiled() == 1
    assert _graph_breaks() == 0
    _assert_matches(got, expected, rows=x.numel() // shape[-1])


class _Block(torch.nn.Module):
    """A small pre-norm MLP block: RMSNorm -> Linear -> SiLU -> Linear, residual."""

    def __init__(self, hidden: int, **norm_kwargs) -> None:
        super().__init__()
        self.norm = inductor_ext.nn.RMSNorm(hidden, eps=1e-6, **norm_kwargs)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _module_fwd_bwd(run, module, x, dy):
    """Output, input grad and parameter grads of ``run(x)``, where ``run`` is ``module`` or its compiled form."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = run(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("norm_kwargs", [{}, {"offset": 1.0, "casting": "gemma"}], ids=["llama", "gemma"])
def test_module_dynamic_batch_compiles_once_and_matches_eager(norm_kwargs):
    hidden = 96
    block = _Block(hidden, **norm_kwargs)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for batch in (2, 5):
        x, dy = torch.randn(batch, 3, hidden), torch.randn(batch, 3, hidden)
        y, dx, grads = _module_fwd_bwd(compiled, block, x, dy)
        y_e, dx_e, grads_e = _module_fwd_bwd(block, block, x, dy)
        assert y.shape == (batch, 3, hidden)
        assert rel_err(y, y_e) < FP32_TOL
        assert rel_err(dx, dx_e) < FP32_TOL
        assert grads.keys() == grads_e.keys() == {"norm.weight", "up.weight", "up.bias", "down.weight", "down.bias"}
        for name in grads:
            assert rel_err(grads[name], grads_e[name]) < reduced_grad(torch.float32, batch * 3), name
    # One graph for both batch sizes: the batch dim is symbolic, not re-specialised. (Dynamo
    # restarts its analysis once: with dynamic=True the float defaults of rms_norm become
    # SymFloats, which the op's float arguments cannot take, so they get specialised. That
    # is not a recompile and is not counted here.)
    assert _graphs_compiled() == 1
    assert _graph_breaks() == 0


def test_functional_dynamic_batch_matches_eager():
    def f(x, w):
        return inductor_ext.rms_norm(x, w, 1e-5)

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for batch in (3, 6):
        x, w, dy = _inputs((batch, 5, 96), True)
        _assert_matches(_fwd_bwd(compiled, x, w, dy), _fwd_bwd(f, x, w, dy), rows=batch * 5)
    assert _graphs_compiled() == 1
    assert _graph_breaks() == 0


def test_traced_graphs_contain_the_fastops_ops():
    from torch.export._trace import _disable_custom_triton_op_functional_decomposition

    x, w, dy = _inputs((3, 5, 96), True)

    def f(x, w):
        return inductor_ext.rms_norm(x, w, 1e-6, offset=1.0, casting="gemma")

    # Dynamo captures the registered forward op (the eager bypass is not taken while compiling).
    recorder = AotEagerAndRecordGraphs()
    _fwd_bwd(torch.compile(f, backend=recorder, fullgraph=True), x, w, dy)
    assert len(recorder.graphs) == 1
    dynamo_targets = {n.target for n in recorder.graphs[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.fastops.rms_norm_fwd.default in dynamo_targets
    # AOTAutograd then decomposes a triton_op into its body (so Inductor sees the kernels);
    # on CPU the body is the aten CPU branch, so no fastops call is left for the backend.
    assert "fastops" not in recorder.fw_graphs[0].code
    assert "fastops" not in recorder.bw_graphs[0].code
    assert "rsqrt" in recorder.fw_graphs[0].code

    # With that decomposition switched off (as torch.export does), the joint graph shows the
    # autograd wiring: the forward op in the forward graph, the backward op in the backward.
    torch._dynamo.reset()
    recorder = AotEagerAndRecordGraphs()
    with _disable_custom_triton_op_functional_decomposition():
        got = _fwd_bwd(torch.compile(f, backend=recorder, fullgraph=True), x, w, dy)
    fw_code, bw_code = recorder.fw_graphs[0].code, recorder.bw_graphs[0].code
    assert "torch.ops.fastops.rms_norm_fwd.default" in fw_code
    assert "rms_norm_bwd" not in fw_code
    assert "torch.ops.fastops.rms_norm_bwd.default" in bw_code
    assert "rms_norm_fwd" not in bw_code
    assert _graph_breaks() == 0
    _assert_matches(got, _fwd_bwd(f, x, w, dy), rows=15)


def test_cpp_wrapper_matches_eager():
    x, w, dy = _inputs((3, 5, 96), True)

    def f(x, w):
        return inductor_ext.rms_norm(x, w, 1e-6)

    compiled = torch.compile(f, fullgraph=True)
    with torch._inductor.config.patch(cpp_wrapper=True):
        got, codes = run_and_get_code(_fwd_bwd, compiled, x, w, dy)
    # forward and backward each get a C++ wrapper (no Python `call` function)
    assert len(codes) == 2
    for code in codes:
        assert "cpp_wrapper_src" in code and "inductor_entry_impl" in code
        assert 'extern "C"' in code
        assert "def call(" not in code
    assert _graph_breaks() == 0
    _assert_matches(got, _fwd_bwd(f, x, w, dy), rows=15)


def test_python_wrapper_emits_python_call():
    """Control for the cpp_wrapper test: the default wrapper is Python, with C++ kernels."""
    x = torch.randn(4, 96)

    def f(x):
        return inductor_ext.rms_norm(x, None)

    got, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
    assert len(codes) == 1
    assert "def call(" in codes[0] and "inductor_entry_impl" not in codes[0]
    assert rel_err(got, f(x)) < FP32_TOL


def test_fastops_inductor_backend_by_name_matches_eager():
    x, w, dy = _inputs((2, 7, 123), True)

    def f(x, w):
        return inductor_ext.rms_norm(x, w, 1e-6, offset=1.0, casting="gemma")

    compiled = torch.compile(f, backend="fastops_inductor", fullgraph=True)
    got, codes = run_and_get_code(_fwd_bwd, compiled, x, w, dy)
    # Inductor generated both graphs, with no call back into the fastops ops
    assert len(codes) == 2
    assert all("fastops" not in code for code in codes)
    assert _graph_breaks() == 0
    _assert_matches(got, _fwd_bwd(f, x, w, dy), rows=14)

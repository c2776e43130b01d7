"""LayerNorm: kernel numerics (every config, under the interpreter on CPU), op registration, bad input,
the nn module, and compile / cpp_wrapper / AOTInductor on CPU (the ops' CPU branch)."""

import zipfile

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext
from inductor_ext.kernels.layer_norm import layer_norm_fwd_kernel
from inductor_ext.ops.layer_norm import layer_norm, layer_norm_family, layer_norm_ref
from inductor_ext.tuning.launch_settings import force_launch_config
from inductor_ext.tuning.search_spaces.norm import MAX_PERSISTENT_BLOCK, NormConfig, search_space
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, reduced_grad, rel_err, shifted_mean_output

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _fwd_bwd(f, x, w, b, dy, **kw):
    """(y, dx, dw, db) of ``f(x, w, b)`` for the cotangent ``dy``; dw/db None for an absent parameter."""
    x = x.detach().clone().requires_grad_()
    params = [None if p is None else p.detach().clone().requires_grad_() for p in (w, b)]
    y = f(x, *params, **kw)
    leaves = [x] + [p for p in params if p is not None]
    grads = iter(torch.autograd.grad(y, leaves, dy))
    dx = next(grads)
    return (y, dx, *[None if p is None else next(grads) for p in params])


def _inputs(shape, dtype, with_weight=True, with_bias=True, param_dtype=None):
    n = shape[-1]
    param_dtype = param_dtype or dtype
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(param_dtype) if with_weight else None
    b = (0.1 * torch.randn(n, device=DEVICE)).to(param_dtype) if with_bias else None
    return x, w, b, torch.randn(shape, device=DEVICE, dtype=dtype)


def _double(t):
    return None if t is None else t.double()


def _check_against_float64(shape, dtype, with_weight=True, with_bias=True, param_dtype=None):
    x, w, b, dy = _inputs(shape, dtype, with_weight, with_bias, param_dtype)
    ours = _fwd_bwd(layer_norm, x, w, b, dy)
    ref = _fwd_bwd(layer_norm_ref, x.double(), _double(w), _double(b), dy.double())
    rows = x.numel() // shape[-1]
    param_bound = reduced_grad(param_dtype or dtype, rows)
    bounds = [OUTPUT[dtype], OUTPUT[dtype], param_bound, param_bound]
    for name, o, r, bound in zip(("y", "dx", "dw", "db"), ours, ref, bounds):
        assert (o is None) == (r is None), name
        if o is None:
            continue
        assert o.shape == r.shape, name
        assert torch.isfinite(o).all(), name
        assert rel_err(o, r) < bound, (name, rel_err(o, r), bound)
    assert ours[0].dtype == dtype
    assert ours[1].dtype == dtype
    for grad, param in zip(ours[2:], (w, b)):
        assert grad is None or grad.dtype == param.dtype
    return ours


def _all_configs(n: int) -> list[NormConfig]:
    """Every config either kernel may pick for rows of n elements. A forced config applies
    to both kernels (the forward ignores PREFETCH)."""
    return list(dict.fromkeys(search_space(n, forward=True) + search_space(n, forward=False)))


@pytest.mark.parametrize("n, rows", [(1, 5), (123, 37), (1000, 9), (5000, 5), (20000, 3)])
def test_every_config_matches_float64(n, rows):
    """Each persistent and looped variant the autotuner may pick, on an odd row count
    (the backward's 4 programs under the interpreter walk several row blocks)."""
    configs = _all_configs(n)
    assert any(c.persistent for c in configs) and any(c.prefetch for c in configs)
    assert any(not c.persistent for c in configs) == (n > 2048)  # chunks of 2048+ elements
    for config in configs:
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64((rows, n), torch.float32)


def test_every_long_row_config_matches_float64():
    """The configs of rows past MAX_PERSISTENT_BLOCK (looped only), forced on a shorter row:
    the same code with fewer chunks (a 70001-element row costs seconds per config here)."""
    configs = _all_configs(MAX_PERSISTENT_BLOCK + 1)
    assert configs and not any(c.persistent for c in configs)
    for config in configs:
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64((3, 4999), torch.float32)


@pytest.mark.parametrize(("n", "rows", "warps"), [(2048, 4, 8), (4096, 2, 8), (8192, 2, 16)])
def test_forward_ranks_two_rows_per_step_first(n, rows, warps):
    """The forward kernel's pruning (what a quick first launch takes the first configs of) puts the
    H200's full-timing winners first: two rows or more per step, 32 values per thread; the set
    of configs is the shared search space's."""
    pruned = layer_norm_fwd_kernel.early_config_prune(layer_norm_fwd_kernel.configs, {"N": n})
    first = NormConfig.from_triton(pruned[0])
    assert (first.persistent, first.block_m, first.num_warps) == (True, rows, warps)
    assert sorted(map(NormConfig.from_triton, pruned), key=repr) == sorted(search_space(n, forward=True), key=repr)


@pytest.mark.parametrize("n, rows", [(123, 300), (5000, 5)])
def test_two_pass_backward_every_config_matches_float64(n, rows, monkeypatch):
    """The two-pass backward (rows of TWO_PASS_BACKWARD_MIN_N or more), forced on short rows: every
    config of the dx kernel (no dw/db partials) and of the dw/db column-tile kernel, whose groups
    stride over several row blocks at 300 rows."""
    import importlib

    from inductor_ext.kernels.layer_norm import layer_norm_bwd_param_grads_kernel

    monkeypatch.setattr(importlib.import_module("inductor_ext.ops.layer_norm"), "TWO_PASS_BACKWARD_MIN_N", 1)
    for config in _all_configs(n):
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64((rows, n), torch.float32)
    for config in layer_norm_bwd_param_grads_kernel.configs:
        with force_launch_config(config.all_kwargs()):
            _check_against_float64((rows, n), torch.float32)


@pytest.mark.parametrize("with_weight, with_bias", [(True, True), (True, False), (False, True), (False, False)])
def test_two_pass_backward_takes_long_rows(with_weight, with_bias):
    """Rows of TWO_PASS_BACKWARD_MIN_N elements take the two-pass backward (the dx kernel, then the
    dw/db kernel when there is a parameter), with or without weight and bias, in bf16."""
    from inductor_ext.ops.layer_norm import TWO_PASS_BACKWARD_MIN_N
    from inductor_ext.tuning.launch_settings import record_autotuned_launches

    with record_autotuned_launches() as launches:
        _check_against_float64((3, TWO_PASS_BACKWARD_MIN_N), torch.bfloat16, with_weight, with_bias)
    kernels = {(kernel.fn.__name__, kwargs.get("PARAM_GRADS")) for kernel, _, kwargs in launches}
    assert ("layer_norm_bwd_kernel", False) in kernels and ("layer_norm_bwd_kernel", True) not in kernels
    assert (("layer_norm_bwd_param_grads_kernel", None) in kernels) == (with_weight or with_bias)


def test_large_row_uses_looped_kernel():
    """N > 65536: the looped path (the persistent search space stops at 32768)."""
    assert all(not c.persistent for c in search_space(70001))
    _check_against_float64((2, 70001), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 257), (1, 4096), (9, 1000), (300,)], ids=str)
def test_matches_float64(shape, dtype):
    _check_against_float64(shape, dtype)


@pytest.mark.parametrize("with_weight, with_bias", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_and_bias_are_optional(with_weight, with_bias, dtype):
    _check_against_float64((6, 333), dtype, with_weight, with_bias)


@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_parameter_dtype_may_differ(dtype, param_dtype):
    """fp32 parameters with bf16 activations (autocast-style): y and dx in x's dtype, dw and db in the parameters'."""
    _check_against_float64((7, 300), dtype, param_dtype=param_dtype)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "looped"])
def test_statistics_are_stable_when_mean_dominates(persistent):
    """|mean| >> std: the two-pass (persistent) and Welford (looped) statistics do not cancel.

    ``E[x**2] - mean**2`` would lose about ``(mean / std)**2 * 2**-24`` of the variance (6% here).
    """
    n, offset = 3000, 1000.0
    x = offset + torch.randn(5, n, device=DEVICE)
    w, b = 1 + 0.1 * torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    config = next(c for c in search_space(n) if c.persistent == persistent)
    with force_launch_config(config.to_triton().all_kwargs()):
        y, mean, rstd = layer_norm_family(x, w, b, 1e-5)
    xd = x.double()
    var, mean_ref = torch.var_mean(xd, dim=-1, correction=0)
    assert rel_err(mean, mean_ref) < OUTPUT[torch.float32]
    assert rel_err(rstd, torch.rsqrt(var + 1e-5)) < OUTPUT[torch.float32]
    bound = shifted_mean_output(offset)
    assert rel_err(y, layer_norm_ref(xd, w.double(), b.double())) < bound


def test_matches_torch_functional_layer_norm():
    """Same semantics as ``F.layer_norm(x, x.shape[-1:], w, b, eps)`` (forward and all three grads)."""
    x, w, b, dy = _inputs((4, 3, 200), torch.float32)
    ours = _fwd_bwd(layer_norm, x, w, b, dy, eps=1e-3)
    theirs = _fwd_bwd(lambda x, w, b, eps: torch.nn.functional.layer_norm(x, (200,), w, b, eps), x, w, b, dy, eps=1e-3)
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)


def test_every_output_element_written():
    """Poisoned outputs: any element the kernels skip would stay NaN."""
    x, w, b, dy = _inputs((13, 200), torch.float32)
    new_empty, empty_like = torch.Tensor.new_empty, torch.empty_like

    def poisoned_new_empty(self, *a, **k):
        return new_empty(self, *a, **k).fill_(float("nan"))

    def poisoned_empty_like(t, *a, **k):
        return empty_like(t, *a, **k).fill_(float("nan"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
        mp.setattr(torch, "empty_like", poisoned_empty_like)
        for config in (search_space(200)[0], NormConfig(False, 1, 128, 4)):
            with force_launch_config(config.to_triton().all_kwargs()):
                outputs = _fwd_bwd(layer_norm, x, w, b, dy)
                stats = layer_norm_family(x, w, b, 1e-5)[1:]
            assert torch.isnan(torch.empty_like(x)).all()  # the poison is in place
            for t in (*outputs, *stats):
                assert torch.isfinite(t).all(), config


def test_non_contiguous_inputs():
    w, b = torch.randn(300, device=DEVICE), torch.randn(300, device=DEVICE)
    x = torch.randn(300, 10, device=DEVICE).t()  # (10, 300), last dim has stride 10
    torch.testing.assert_close(layer_norm(x, w, b), layer_norm_ref(x, w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 600, device=DEVICE)[:, ::2]  # strided rows and columns
    w_strided = torch.randn(600, device=DEVICE)[::2]
    torch.testing.assert_close(layer_norm(x, w_strided, b), layer_norm_ref(x, w_strided, b), rtol=1e-5, atol=1e-5)


def test_broadcast_cotangent():
    """``y.sum().backward()`` hands the backward an expanded dy (stride 0): it is read correctly."""
    x, w, b, _ = _inputs((2, 5, 96), torch.float32)
    grads = []
    for f in (layer_norm, layer_norm_ref):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
        f(*leaves).sum().backward()
        grads.append([t.grad for t in leaves])
    for o, r in zip(*grads):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)], ids=str)
def test_zero_size(shape):
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    b = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
    assert (w.grad == 0).all() and (b.grad == 0).all()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"x": torch.ones(3, 4, dtype=torch.int32)}, TypeError, "x must be float32, bfloat16 or float16"),
        ({"x": torch.ones(3, 4, dtype=torch.float64)}, TypeError, "x must be float32"),
        ({"x": torch.tensor(1.0)}, ValueError, "at least 1 dimension"),
        ({"x": [1.0, 2.0]}, TypeError, "x must be a Tensor"),
        ({"weight": torch.ones(5)}, ValueError, r"weight must have shape \(4,\)"),
        ({"weight": torch.ones(2, 2)}, ValueError, r"weight must have shape \(4,\)"),
        ({"weight": torch.ones(4, dtype=torch.int64)}, TypeError, "weight must be float32"),
        ({"weight": [1.0] * 4}, TypeError, "weight must be a Tensor or None"),
        ({"weight": torch.ones(4, device="meta")}, ValueError, "weight is on meta but x is on"),
        ({"bias": torch.ones(3)}, ValueError, r"bias must have shape \(4,\)"),
        ({"bias": torch.ones(4, dtype=torch.float64)}, TypeError, "bias must be float32"),
        ({"bias": torch.ones(4, device="meta")}, ValueError, "bias is on meta but x is on"),
        ({"eps": -1.0}, ValueError, "eps must be >= 0"),
        ({"eps": float("nan")}, ValueError, "eps must be >= 0"),
        ({"eps": "1e-5"}, TypeError, "eps must be a real number, got '1e-5' \\(str\\)"),
        ({"eps": True}, TypeError, "eps must be a real number, got True"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {"x": torch.ones(3, 4), "weight": torch.ones(4), "bias": torch.zeros(4), "eps": 1e-5, **kwargs}
    with pytest.raises(error, match=match):
        layer_norm(args["x"], args["weight"], args["bias"], args["eps"])


def test_opcheck_both_ops():
    for x in (torch.randn(6, 40), torch.randn(40, 6).t()):  # contiguous and strided rows
        w = torch.randn(40, requires_grad=True)
        b = torch.randn(40, requires_grad=True)
        x = x.requires_grad_()
        fwd, bwd = torch.ops.fastops.layer_norm_fwd.default, torch.ops.fastops.layer_norm_bwd.default
        for params in ((w, b), (w, None), (None, b), (None, None)):
            torch.library.opcheck(fwd, (x, *params, 1e-5))
        y, mean, rstd = fwd(x.detach(), w.detach(), b.detach(), 1e-5)
        dy = torch.randn_like(y)
        for params in ((w, b), (None, None)):
            params = tuple(None if p is None else p.detach() for p in params)
            torch.library.opcheck(bwd, (dy, x.detach(), *params, mean, rstd))


def _profiled_op_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_eager_bypasses_the_dispatcher():
    """Plain eager calls launch kernels from an autograd.Function: the registered ops never run."""
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, device=DEVICE))
    b = torch.nn.Parameter(torch.randn(64, device=DEVICE))
    names = _profiled_op_names(lambda: layer_norm(x, w, b).sum().backward())
    assert not any(n.startswith("fastops::") for n in names), names
    assert any("layer_norm_eager" in n for n in names), names
    # the registered ops are what tracing sees, and the profiler does record them
    names = _profiled_op_names(lambda: torch.ops.fastops.layer_norm_fwd(x, w, b, 1e-5)[0].sum().backward())
    assert {"fastops::layer_norm_fwd", "fastops::layer_norm_bwd"} <= names, names


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}],
    ids=["affine", "no-bias", "plain", "eps"],
)
def test_nn_module_loads_torch_state_dicts(kwargs):
    theirs = torch.nn.LayerNorm(48, **kwargs)
    ours = inductor_ext.nn.LayerNorm(48, **kwargs)
    assert isinstance(ours, torch.nn.LayerNorm)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x, dy = torch.randn(2, 3, 48), torch.randn(2, 3, 48)
    got, expected = [], []
    for module, out in ((ours, got), (theirs, expected)):
        xl = x.clone().requires_grad_()
        y = module(xl)
        y.backward(dy)
        out += [y, xl.grad, *[p.grad for p in module.parameters()]]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_nn_module_normalizes_several_trailing_dims():
    theirs = torch.nn.LayerNorm((4, 24))
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = inductor_ext.nn.LayerNorm((4, 24))
    ours.load_state_dict(theirs.state_dict())
    for shape in ((3, 4, 24), (4, 24)):
        x = torch.randn(shape)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"trailing dims must be normalized_shape \(4, 24\)"):
        ours(torch.randn(2, 24, 4))


# ---- torch.compile / cpp_wrapper / AOTInductor on CPU ----------------------------------------------
# On CPU the compiled graph runs the ops' CPU branch (aten math, compiled to C++), while eager runs
# the Triton kernels under the interpreter: agreement checks the CPU branch and the autograd wiring.
# Compiles cost seconds each on two cores, so there are few and the shapes are small.

FP32_TOL = OUTPUT[torch.float32]


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _assert_close_fp32(got, expected, rows):
    for name, g, e in zip(("y", "dx", "dw", "db"), got, expected):
        assert (g is None) == (e is None), name
        if g is not None:
            assert g.shape == e.shape and g.dtype == e.dtype, name
            bound = FP32_TOL if name in ("y", "dx") else reduced_grad(torch.float32, rows)
            assert rel_err(g, e) < bound, (name, rel_err(g, e))


@pytest.mark.parametrize("with_bias", [True, False], ids=["weight-bias", "weight-only"])
def test_compile_fullgraph_static_matches_eager(fresh_dynamo, with_bias):
    x, w, b, dy = _inputs((3, 5, 96), torch.float32, with_bias=with_bias)
    compiled = torch.compile(layer_norm, fullgraph=True, dynamic=False)
    got, codes = run_and_get_code(_fwd_bwd, compiled, x, w, b, dy)
    assert len(codes) == 2  # forward and backward graphs, compiled by Inductor
    assert all("fastops" not in code for code in codes)  # the CPU branch became C++ kernels
    assert counters["stats"]["unique_graphs"] == 1
    assert _graph_breaks() == 0
    _assert_close_fp32(got, _fwd_bwd(layer_norm, x, w, b, dy), rows=15)


class _Block(torch.nn.Module):
    """A small pre-norm MLP block: LayerNorm -> Linear -> GELU -> Linear, residual."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = inductor_ext.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(hidden))
            self.norm.bias.add_(0.1 * torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _module_fwd_bwd(run, module, x, dy):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = run(x)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def test_compile_module_dynamic_batch_compiles_once_and_matches_eager(fresh_dynamo):
    hidden = 96
    block = _Block(hidden)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for batch in (2, 5):
        x, dy = torch.randn(batch, 3, hidden), torch.randn(batch, 3, hidden)
        y, dx, grads = _module_fwd_bwd(compiled, block, x, dy)
        y_e, dx_e, grads_e = _module_fwd_bwd(block, block, x, dy)
        assert y.shape == (batch, 3, hidden)
        assert rel_err(y, y_e) < FP32_TOL and rel_err(dx, dx_e) < FP32_TOL
        assert {"norm.weight", "norm.bias"} <= grads.keys() == grads_e.keys()
        for name in grads:
            assert rel_err(grads[name], grads_e[name]) < reduced_grad(torch.float32, batch * 3), name
    assert counters["stats"]["unique_graphs"] == 1  # the batch dim is symbolic
    assert _graph_breaks() == 0


def test_traced_graphs_hold_the_fastops_ops(fresh_dynamo):
    """With the triton_op decomposition off (as torch.export does), the joint graph shows the
    autograd wiring: the forward op in the forward graph, the backward op in the backward."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs
    from torch.export._trace import _disable_custom_triton_op_functional_decomposition

    x, w, b, dy = _inputs((3, 5, 96), torch.float32)
    recorder = AotEagerAndRecordGraphs()
    with _disable_custom_triton_op_functional_decomposition():
        got = _fwd_bwd(torch.compile(layer_norm, backend=recorder, fullgraph=True), x, w, b, dy)
    fw_code, bw_code = recorder.fw_graphs[0].code, recorder.bw_graphs[0].code
    assert "torch.ops.fastops.layer_norm_fwd.default" in fw_code and "layer_norm_bwd" not in fw_code
    assert "torch.ops.fastops.layer_norm_bwd.default" in bw_code and "layer_norm_fwd" not in bw_code
    assert _graph_breaks() == 0
    _assert_close_fp32(got, _fwd_bwd(layer_norm, x, w, b, dy), rows=15)


def test_cpp_wrapper_and_fastops_inductor_backend_match_eager(fresh_dynamo):
    x, w, b, dy = _inputs((2, 7, 123), torch.float32)
    expected = _fwd_bwd(layer_norm, x, w, b, dy)
    compiled = torch.compile(layer_norm, fullgraph=True)
    with torch._inductor.config.patch(cpp_wrapper=True):
        got, codes = run_and_get_code(_fwd_bwd, compiled, x, w, b, dy)
    assert len(codes) == 2
    for code in codes:  # a C++ wrapper (no Python `call` function) for each graph
        assert "inductor_entry_impl" in code and "def call(" not in code
    _assert_close_fp32(got, expected, rows=14)
    # the backend's route: both ops decomposed into Inductor's own code, no call back into fastops
    torch._dynamo.reset()
    compiled = torch.compile(layer_norm, backend="fastops_inductor", fullgraph=True)
    got, codes = run_and_get_code(_fwd_bwd, compiled, x, w, b, dy)
    assert len(codes) == 2 and all("fastops" not in code for code in codes)
    _assert_close_fp32(got, expected, rows=14)
    assert _graph_breaks() == 0


class _ExportBlock(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = inductor_ext.nn.LayerNorm(hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.out_norm = inductor_ext.nn.LayerNorm(hidden, bias=False)
        with torch.no_grad():  # non-trivial parameters, so a dropped one would show
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
            self.out_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_norm(x + self.proj(self.norm(x)))


def test_aoti_package_keeps_op_compiles_it_to_cpp_and_matches_eager(tmp_path):
    torch.manual_seed(0)
    model = _ExportBlock(64).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(3, 8, 64),), dynamic_shapes={"x": {0: batch}})
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fastops.layer_norm_fwd.default) == 2  # a real op in the exported graph
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "ln.pt2"))
    with zipfile.ZipFile(path) as z:
        sources = {n: z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith(".cpp")}
    assert sources and all("fastops" not in src for src in sources.values())  # no proxy call back into Python
    runner = torch._inductor.aoti_load_package(path)
    for b in (3, 5):
        x = torch.randn(b, 8, 64)
        with torch.no_grad():
            expected = model(x)
        out = runner(x)
        assert out.shape == x.shape
        assert rel_err(out, expected) < FP32_TOL

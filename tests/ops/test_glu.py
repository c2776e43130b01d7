"""SwiGLU / GeGLU: kernel numerics (every config and layout, under the interpreter on CPU), op
registration, bad input, and torch.compile / cpp_wrapper / AOTInductor through the CPU branch."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext
from inductor_ext.kernels.glu import search_space
from inductor_ext.ops.glu import (
    geglu,
    geglu_packed,
    geglu_ref,
    swiglu,
    swiglu_packed,
    swiglu_ref,
)
from inductor_ext.tuning.launch_settings import force_launch_config
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ACTIVATIONS = ["silu", "gelu", "gelu_tanh"]
LAYOUTS = ["flat", "rows", "packed"]


def _ours(activation: str, layout: str):
    """f(gate, up) for one activation, through the split ops or the packed one (inputs cat'ed)."""
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    if layout == "packed":
        if activation == "silu":
            return lambda g, u: swiglu_packed(torch.cat([g, u], -1))
        return lambda g, u: geglu_packed(torch.cat([g, u], -1), approximate)
    if activation == "silu":
        return swiglu
    return lambda g, u: geglu(g, u, approximate)


def _ref(activation: str):
    if activation == "silu":
        return swiglu_ref
    return lambda g, u: geglu_ref(g, u, "tanh" if activation == "gelu_tanh" else "none")


def _fwd_bwd(f, gate, up, dy):
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    y = f(gate, up)
    return (y, *torch.autograd.grad(y, (gate, up), dy))


def _inputs(shape, dtype, layout="flat"):
    """gate, up, dy; for "rows", gate and up are the two halves of one (…, 2I) tensor (strided rows)."""
    if layout == "rows":
        gate, up = torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE, dtype=dtype).chunk(2, -1)
        assert gate.stride(-2) == 2 * shape[-1]
    else:
        gate, up = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(2))
    return gate, up, torch.randn(shape, device=DEVICE, dtype=dtype)


def _check_against_float64(shape, dtype, activation="silu", layout="flat"):
    gate, up, dy = _inputs(shape, dtype, layout)
    ours = _fwd_bwd(_ours(activation, layout), gate, up, dy)
    ref = _fwd_bwd(_ref(activation), gate.double(), up.double(), dy.double())
    for name, o, r in zip(("y", "dgate", "dup"), ours, ref):
        assert o.shape == r.shape and o.dtype == dtype, name
        assert torch.isfinite(o).all(), name
        assert rel_err(o, r) < OUTPUT[dtype], (name, rel_err(o, r))


def test_search_space_heuristic_first_and_unique():
    configs = search_space()
    assert configs[0].block == 1024 and configs[0].num_warps == 4
    assert len(set(configs)) == len(configs) >= 8


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_config_matches_float64(activation, layout):
    """Each config the autotuner may pick, in each memory layout, on an odd shape (tails masked)."""
    for config in search_space():
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64((5, 123), torch.float32, activation, layout)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 257), (1, 4096), (1000,)], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_float64(shape, dtype, activation):
    _check_against_float64(shape, dtype, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_strided_and_packed_layouts_match_float64(layout, dtype):
    _check_against_float64((3, 7, 96), dtype, "gelu_tanh", layout)


def test_packed_gradient_is_one_tensor_matching_the_split_form():
    gate_up = torch.randn(6, 2 * 77, device=DEVICE, requires_grad=True)
    dy = torch.randn(6, 77, device=DEVICE)
    (grad,) = torch.autograd.grad(swiglu_packed(gate_up), gate_up, dy)
    assert grad.shape == gate_up.shape and grad.is_contiguous()
    gate, up = gate_up.detach().chunk(2, -1)
    _, dgate, dup = _fwd_bwd(swiglu, gate, up, dy)
    torch.testing.assert_close(grad, torch.cat([dgate, dup], -1), rtol=1e-6, atol=1e-6)


def test_every_output_element_written():
    """Poisoned outputs: any element the kernels skip would stay NaN (split and packed forms)."""
    new_empty = torch.Tensor.new_empty

    def poisoned_new_empty(self, *a, **k):
        return new_empty(self, *a, **k).fill_(float("nan"))

    gate, up, dy = _inputs((13, 200), torch.float32, "rows")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
        assert torch.isnan(gate.new_empty(3)).all()  # the poison is in place
        outputs = _fwd_bwd(swiglu, gate, up, dy)
        outputs += _fwd_bwd(_ours("gelu", "packed"), gate, up, dy)
        outputs += _fwd_bwd(swiglu, gate.contiguous(), up.contiguous(), dy)
    for t in outputs:
        assert torch.isfinite(t).all()


def test_non_contiguous_inputs():
    """Rows with any stride run in place (rows layout); a non-unit last dim is copied first."""
    gate = torch.randn(40, 9, device=DEVICE).t()  # (9, 40), column stride 9
    up = torch.randn(9, 80, device=DEVICE)[:, ::2]  # strided rows and columns
    torch.testing.assert_close(swiglu(gate, up), swiglu_ref(gate, up), rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(4, 5, 3, 60, device=DEVICE).transpose(0, 1)  # leading dims not flattenable
    torch.testing.assert_close(swiglu_packed(gate_up), swiglu_ref(*gate_up.chunk(2, -1)), rtol=1e-5, atol=1e-5)
    # a non-contiguous incoming gradient (dy of a transposed output)
    g = torch.randn(30, 8, device=DEVICE, requires_grad=True)
    u = torch.randn(30, 8, device=DEVICE, requires_grad=True)
    dy = torch.randn(8, 30, device=DEVICE)
    ours = torch.autograd.grad(geglu(g, u).t(), (g, u), dy)
    ref = torch.autograd.grad(geglu_ref(g, u).t(), (g, u), dy)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)], ids=str)
def test_zero_size(shape):
    gate = torch.randn(shape, device=DEVICE, requires_grad=True)
    up = torch.randn(shape, device=DEVICE, requires_grad=True)
    y = swiglu(gate, up)
    assert y.shape == shape
    y.sum().backward()
    assert gate.grad.shape == shape and up.grad.shape == shape
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1], device=DEVICE, requires_grad=True)
    geglu_packed(gate_up).sum().backward()
    assert gate_up.grad.shape == gate_up.shape


@pytest.mark.parametrize(
    "fn,args,error,match",
    [
        (swiglu, (torch.ones(3, 4, dtype=torch.int32), torch.ones(3, 4)), TypeError, "gate must be float32"),
        (swiglu, (torch.ones(3, 4), torch.ones(3, 4, dtype=torch.float64)), TypeError, "up must be float32"),
        (swiglu, (torch.ones(3, 4), torch.ones(3, 4, dtype=torch.bfloat16)), TypeError, "up must have gate's dtype"),
        (swiglu, (torch.ones(3, 4), torch.ones(3, 5)), ValueError, r"up must have gate's shape \(3, 4\)"),
        (swiglu, (torch.ones(3, 4), torch.ones(3, 4, device="meta")), ValueError, "up is on meta but gate is on"),
        (swiglu, ([1.0], torch.ones(1)), TypeError, "gate must be a Tensor"),
        (swiglu, (torch.tensor(1.0), torch.tensor(1.0)), ValueError, "gate must have at least 1 dimension"),
        (geglu, (torch.ones(3, 4), torch.ones(3, 4), "exact"), ValueError,
         r"approximate must be one of \('none', 'tanh'\)"),
        (swiglu_packed, (torch.ones(3, 5),), ValueError, "gate_up's last dimension must be even"),
        (geglu_packed, (torch.ones(3, 4, dtype=torch.int64),), TypeError, "gate_up must be float32"),
        (geglu_packed, (torch.ones(3, 4), "sigmoid"), ValueError, "approximate must be one of"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(fn, args, error, match):
    with pytest.raises(error, match=match):
        fn(*args)


def test_opcheck_all_ops():
    ops = torch.ops.fastops
    # contiguous and strided rows
    for activation, gate_up in (("silu", torch.randn(6, 80)), ("gelu_tanh", torch.randn(80, 6).t())):
        gate, up = gate_up.chunk(2, -1)
        dy = torch.randn(6, 40)
        torch.library.opcheck(ops.glu_fwd.default, (gate.requires_grad_(), up.requires_grad_(), activation))
        torch.library.opcheck(ops.glu_bwd.default, (dy, gate.detach(), up.detach(), activation))
        torch.library.opcheck(ops.glu_packed_fwd.default, (gate_up.requires_grad_(), activation))
        torch.library.opcheck(ops.glu_packed_bwd.default, (dy, gate_up.detach(), activation))


def _profiled_op_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_eager_bypasses_the_dispatcher():
    gate = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    up = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    names = _profiled_op_names(lambda: swiglu(gate, up).sum().backward())
    assert not any(n.startswith("fastops::") for n in names), names
    assert any("glu_eager" in n for n in names), names
    names = _profiled_op_names(lambda: torch.ops.fastops.glu_fwd(gate, up, "silu").sum().backward())
    assert {"fastops::glu_fwd", "fastops::glu_bwd"} <= names, names


def _activations(x: torch.Tensor, packed: bool) -> tuple[torch.Tensor, ...]:
    """Activations computed from ``x`` (outputs of an op, as a projection's, not leaves)."""
    x = x.detach().requires_grad_()
    return (x * 1.0,) if packed else (x * 1.0, x * 0.5 + 1.0)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_overwriting_backward_writes_the_gradients_over_the_inputs(packed):
    """``overwrite_inputs_in_backward``: the eager backward's input gradients are the inputs' own
    buffers, with the values of the ordinary backward, from the first call on: the launch that tunes
    the kernel (on a GPU it times every config, each writing over the inputs) restores them."""
    from inductor_ext.tuning.first_launch import clear_tuned_launch_configs
    from inductor_ext.tuning.launch_settings import record_autotuned_launches

    f = (lambda g: swiglu_packed(g, overwrite_inputs_in_backward=True)) if packed else (
        lambda g, u: swiglu(g, u, overwrite_inputs_in_backward=True))  # fmt: skip
    plain = swiglu_packed if packed else swiglu
    dy = torch.randn(5, 48, device=DEVICE)
    x = torch.randn(5, 96 if packed else 48, device=DEVICE)
    clear_tuned_launch_configs()  # nothing tuned yet: the overwriting launch tunes
    inputs = _activations(x, packed)
    pointers = [t.data_ptr() for t in inputs]
    with record_autotuned_launches() as launches:
        grads = torch.autograd.grad(f(*inputs), inputs, dy)
    assert [g.data_ptr() for g in grads] == pointers
    # the backward's launch: its DGATE (argument 3) is the gate's own buffer
    (backward,) = [
        k for k, args, _ in launches if isinstance(args[3], torch.Tensor) and args[3].data_ptr() == pointers[0]
    ]
    assert set(backward.restore_value) >= ({"GATE"} if packed else {"GATE", "UP"})
    inputs = _activations(x, packed)
    expected = torch.autograd.grad(plain(*inputs), inputs, dy)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_overwriting_backward_keeps_inputs_that_must_survive():
    """No overwrite for a retained graph (a second backward reads the inputs) or for leaves (a
    parameter must not become its own gradient); a backward that saved an overwritten input raises."""
    dy = torch.randn(5, 48, device=DEVICE)
    x = torch.randn(5, 48, device=DEVICE)
    gate, up = _activations(x, False)
    y = swiglu(gate, up, overwrite_inputs_in_backward=True)
    first = torch.autograd.grad(y, (gate, up), dy, retain_graph=True)
    second = torch.autograd.grad(y, (gate, up), dy)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert first[0].data_ptr() != gate.data_ptr()

    leaf_gate = torch.randn(5, 48, device=DEVICE, requires_grad=True)
    before = leaf_gate.detach().clone()
    swiglu(leaf_gate, up.detach(), overwrite_inputs_in_backward=True).backward(dy)
    assert torch.equal(leaf_gate.detach(), before)

    gate, up = _activations(x, False)
    saved_by_another_op = gate.sin()  # saves gate; its backward runs after swiglu's
    y = swiglu(gate, up, overwrite_inputs_in_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved_by_another_op.sum() + (y * dy).sum()).backward()


# torch.compile, cpp_wrapper and AOTInductor on CPU: the compiled graphs run the ops' CPU
# branch (aten math compiled to C++) while eager runs the interpreted kernels, so agreement
# checks both the CPU branch and the autograd wiring. Each compile costs seconds: few, small.


def _compiled_matches_eager(f, compiled, shapes, dtype=torch.float32):
    for shape in shapes:
        gate, up, dy = _inputs(shape, dtype, "rows")
        got = _fwd_bwd(compiled, gate, up, dy)
        expected = _fwd_bwd(f, gate, up, dy)
        for name, o, e in zip(("y", "dgate", "dup"), got, expected):
            assert o.shape == e.shape and o.dtype == e.dtype, name
            assert rel_err(o, e) < OUTPUT[dtype], (name, rel_err(o, e))


def test_fullgraph_static_compile_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    f = _ours("gelu", "rows")
    _compiled_matches_eager(f, torch.compile(f, fullgraph=True, dynamic=False), [(3, 5, 96)])
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_fullgraph_dynamic_compile_one_graph_for_two_batches():
    torch._dynamo.reset()
    counters.clear()
    f = _ours("gelu_tanh", "packed")
    _compiled_matches_eager(f, torch.compile(f, fullgraph=True, dynamic=True), [(3, 5, 96), (6, 5, 96)])
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_cpp_wrapper_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    gate, up, dy = _inputs((3, 5, 64), torch.float32, "rows")
    compiled = torch.compile(swiglu, fullgraph=True)
    with torch._inductor.config.patch(cpp_wrapper=True):
        got, codes = run_and_get_code(_fwd_bwd, compiled, gate, up, dy)
    assert len(codes) == 2 and all("cpp_wrapper_src" in code and "def call(" not in code for code in codes)
    assert sum(counters["graph_break"].values()) == 0
    for o, e in zip(got, _fwd_bwd(swiglu, gate, up, dy)):
        assert rel_err(o, e) < OUTPUT[torch.float32]


class _GatedMLP(torch.nn.Module):
    """Llama MLP (gate/up/down) and a Phi-3 style MLP (one gate_up projection), summed."""

    def __init__(self, hidden: int = 32, inter: int = 48) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inter, bias=False)
        self.up = torch.nn.Linear(hidden, inter, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = inductor_ext.swiglu(self.gate(x), self.up(x)) + inductor_ext.geglu_packed(self.gate_up(x), "tanh")
        return self.down(h)


def test_aoti_package_keeps_the_ops_and_matches_eager(tmp_path):
    model = _GatedMLP().eval()
    x = torch.randn(2, 8, 32)
    ep = torch.export.export(model, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.fastops.glu_fwd.default in targets
    assert torch.ops.fastops.glu_packed_fwd.default in targets
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "mlp.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        for inputs in (x, torch.randn_like(x)):
            assert rel_err(runner(inputs), model(inputs)) < OUTPUT[torch.float32]

"""RMSNorm with a fused residual add (``add_rms_norm``): kernel numerics against float64 (every
config, under the interpreter on CPU), the gradient of the sum's other uses, op registration, bad input."""

import pytest
import torch

from inductor_ext import add_rms_norm
from inductor_ext.reference import add_rms_norm_ref, rms_norm_ref
from inductor_ext.tuning.launch_settings import force_launch_config
from inductor_ext.tuning.search_spaces.norm import search_space
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, reduced_grad, rel_err


def _residual_block(norm, x, r, w, dy, dh_out, **kw):
    """A pre-norm residual step: ``y, h = norm(x + r)``; the loss reaches h through y and directly
    (h feeds the next residual add); returns y, h and the gradients of x, r and w."""
    leaves = [x, r] + ([w] if w is not None else [])
    y, h = norm(x, r, w, **kw)
    loss = (y.double() * dy.double()).sum() + (h.double() * dh_out.double()).sum()
    return (y, h, *torch.autograd.grad(loss, leaves))


def _check_against_float64(shape, dtype, with_weight=True, **kw):
    n = shape[-1]
    x, r, dy, dh_out = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(4))
    w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype) if with_weight else None

    def leaves(cast):
        return [None if t is None else cast(t).detach().requires_grad_() for t in (x, r, w)]

    ours = _residual_block(add_rms_norm, *leaves(lambda t: t), dy, dh_out, **kw)
    ref = _residual_block(add_rms_norm_ref, *leaves(torch.Tensor.double), dy, dh_out, **kw)
    rows = x.numel() // n
    bounds = [OUTPUT[dtype]] * 4 + [reduced_grad(dtype, rows)]
    for name, o, expected, bound in zip(("y", "h", "dx", "dr", "dw"), ours, ref, bounds):
        assert o.shape == expected.shape, name
        assert torch.isfinite(o).all(), name
        assert rel_err(o, expected) < bound, (name, rel_err(o, expected), bound)
    assert ours[1].dtype == dtype and torch.equal(ours[2], ours[3])  # x and residual: one gradient
    return ours


@pytest.mark.parametrize("n", [123, 5000])
def test_every_config_matches_float64(n):
    """Each persistent and looped variant (a forced config applies to the forward and the backward)."""
    configs = list(dict.fromkeys(search_space(n, forward=True) + search_space(n, forward=False)))
    assert any(c.persistent for c in configs) and any(not c.persistent for c in configs) == (n > 2048)
    for config in configs:
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64((5, n), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 257)], ids=str)
def test_matches_float64(shape, dtype):
    _check_against_float64(shape, dtype)


@pytest.mark.parametrize("casting,offset", [("gemma", 1.0), ("llama", 0.5)])
def test_casting_offset_and_no_weight(casting, offset):
    _check_against_float64((7, 300), torch.bfloat16, casting=casting, offset=offset)
    _check_against_float64((6, 333), torch.bfloat16, with_weight=False)


def test_sum_in_the_input_dtype():
    """h is x + r rounded to bf16 (bitwise the eager add on the GPU: tests/gpu; the interpreter's
    casts truncate instead of rounding), and y normalises that rounded h."""
    x, r = (torch.randn(9, 1000, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(1000, device=DEVICE, dtype=torch.bfloat16)
    y, h = add_rms_norm(x, r, w)
    assert h.dtype == torch.bfloat16 and rel_err(h, x.double() + r.double()) < OUTPUT[torch.bfloat16]
    assert rel_err(y, rms_norm_ref(h, w)) < OUTPUT[torch.bfloat16]


def test_gradient_through_one_output_only():
    """The normalised rows alone (the sum unused: no dh), or the sum alone (no dy: dx = dh)."""
    x, r = (torch.randn(4, 200, device=DEVICE, requires_grad=True) for _ in range(2))
    y, _ = add_rms_norm(x, r)
    dx_y = torch.autograd.grad(y.sum(), x)[0]
    x64 = x.detach().double().requires_grad_()
    expected = torch.autograd.grad(rms_norm_ref(x64 + r.detach().double()).sum(), x64)[0]
    assert rel_err(dx_y, expected) < OUTPUT[torch.float32]
    _, h = add_rms_norm(x, r)
    dh = torch.randn_like(h)
    assert torch.equal(torch.autograd.grad(h, r, dh)[0], dh)


def test_strided_and_zero_size_inputs():
    x = torch.randn(64, 6, device=DEVICE).t()  # last dim not unit-stride: copied by the public function
    r = torch.randn(6, 128, device=DEVICE)[:, ::2]
    w = torch.randn(64, device=DEVICE)
    y, h = add_rms_norm(x, r, w)
    assert rel_err(h, x.double() + r.double()) < OUTPUT[torch.float32]
    assert rel_err(y, rms_norm_ref((x + r).double(), w.double())) < OUTPUT[torch.float32]
    empty = torch.empty(0, 64, device=DEVICE, requires_grad=True)
    y, h = add_rms_norm(empty, torch.empty(0, 64, device=DEVICE), w)
    assert y.shape == h.shape == (0, 64)
    assert torch.autograd.grad((y.sum() + h.sum()), empty)[0].shape == (0, 64)


def test_opcheck_both_ops():
    x, r = (torch.randn(6, 40, requires_grad=True) for _ in range(2))
    w = torch.randn(40, requires_grad=True)
    torch.library.opcheck(torch.ops.fastops.add_rms_norm_fwd.default, (x, r, w, 1e-6, 0.0, "llama"))
    torch.library.opcheck(torch.ops.fastops.add_rms_norm_fwd.default, (x, r, None, 1e-6, 1.0, "gemma"))
    y, rstd, h = torch.ops.fastops.add_rms_norm_fwd(x.detach(), r.detach(), w.detach(), 1e-6, 0.0, "llama")
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    bwd = torch.ops.fastops.add_rms_norm_bwd.default
    torch.library.opcheck(bwd, (dy, dh, h, w.detach(), rstd, 0.0, "llama"))
    torch.library.opcheck(bwd, (dy, None, h, None, rstd, 0.0, "llama"))


@pytest.mark.parametrize(
    "residual,error,match",
    [
        (torch.ones(3, 5), ValueError, r"residual must match x \(shape \(3, 4\)"),
        (torch.ones(3, 4, dtype=torch.bfloat16), ValueError, "residual must match x"),
        ([1.0], TypeError, "residual must be a Tensor"),
    ],
)
def test_bad_input_names_the_argument(residual, error, match):
    with pytest.raises(error, match=match):
        add_rms_norm(torch.ones(3, 4), residual, torch.ones(4))


def test_nn_module_takes_a_residual():
    """``inductor_ext.nn.RMSNorm(x, residual)`` returns ``(norm(x + residual), x + residual)``, vLLM's convention."""
    import inductor_ext

    norm = inductor_ext.nn.RMSNorm(64, eps=1e-5)
    x, r = torch.randn(3, 5, 64, device=DEVICE), torch.randn(3, 5, 64, device=DEVICE)
    y, h = norm.to(DEVICE)(x, r)
    assert h.shape == x.shape and rel_err(h, x.double() + r.double()) < OUTPUT[torch.float32]
    assert rel_err(y, norm(x + r)) < OUTPUT[torch.float32]


# torch.compile, cpp_wrapper and AOTInductor on CPU: the compiled graphs run the ops' CPU branch
# (aten math compiled to C++) while eager runs the interpreted kernels. Few, small compiles.


def _compiled_matches_eager(compiled, shape=(3, 5, 64)):
    x, r, dy, dh = (torch.randn(shape) for _ in range(4))
    w = 1 + 0.1 * torch.randn(shape[-1])

    def leaves():
        return [t.detach().clone().requires_grad_() for t in (x, r, w)]

    got = _residual_block(compiled, *leaves(), dy, dh)
    expected = _residual_block(add_rms_norm, *leaves(), dy, dh)
    for name, o, e in zip(("y", "h", "dx", "dr", "dw"), got, expected):
        assert o.shape == e.shape and o.dtype == e.dtype, name
        assert rel_err(o, e) < OUTPUT[torch.float32] + reduced_grad(torch.float32, 15), (name, rel_err(o, e))


def test_fullgraph_compile_and_cpp_wrapper_match_eager():
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    _compiled_matches_eager(torch.compile(add_rms_norm, fullgraph=True, dynamic=False))
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    with torch._inductor.config.patch(cpp_wrapper=True):
        _, codes = run_and_get_code(_compiled_matches_eager, torch.compile(add_rms_norm, fullgraph=True))
    assert codes and all("cpp_wrapper_src" in code and "def call(" not in code for code in codes)


def test_aoti_package_keeps_the_op_and_matches_eager(tmp_path):
    import inductor_ext

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.norm = torch.nn.Linear(32, 32), inductor_ext.nn.RMSNorm(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y, h = self.norm(x, self.proj(x))
            return h + self.proj(y)

    model = Block().eval()
    x = torch.randn(2, 8, 32)
    ep = torch.export.export(model, (x,))
    assert torch.ops.fastops.add_rms_norm_fwd.default in [n.target for n in ep.graph.nodes]
    runner = torch._inductor.aoti_load_package(
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block.pt2"))
    )
    with torch.no_grad():
        for inputs in (x, torch.randn_like(x)):
            assert rel_err(runner(inputs), model(inputs)) < OUTPUT[torch.float32]

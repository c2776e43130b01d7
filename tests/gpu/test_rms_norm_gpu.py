"""RMSNorm on a real GPU: numerics on real shapes, compiled-graph contents, cpp_wrapper compile-time autotuning."""

import pytest
import torch

import inductor_ext
from inductor_ext.ops.rms_norm import rms_norm
from inductor_ext.reference import add_rms_norm_ref, rms_norm_ref
from tests.gpu.compile_checks import compile_with_cpp_wrapper_counting_tuning, run_and_get_joined_code
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(4096, 4096), (1000, 8192), (77, 70000), (17, 123), (2, 3, 5, 2048)]


def _grads(f, x, w, dy):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    y = f(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


CASES = [(shape, torch.bfloat16, casting) for shape in SHAPES for casting in ("llama", "gemma")] + [
    (shape, dtype, "llama") for shape in ((4096, 4096), (77, 70000)) for dtype in (torch.float16, torch.float32)
]


@pytest.mark.parametrize("shape,dtype,casting", CASES, ids=str)
def test_matches_float64_as_closely_as_compiled_reference(shape, dtype, casting):
    torch._dynamo.reset()
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    offset = 1.0 if casting == "gemma" else 0.0
    kw = {"eps": 1e-6, "offset": offset, "casting": casting}
    ref = _grads(lambda x, w: rms_norm_ref(x, w, **kw), x.double(), w.double(), dy.double())
    ours = _grads(lambda x, w: rms_norm(x, w, **kw), x, w, dy)
    compiled = _grads(torch.compile(lambda x, w: rms_norm_ref(x, w, **kw)), x, w, dy)
    eager = _grads(lambda x, w: rms_norm_ref(x, w, **kw), x, w, dy)
    for name, o, c, e, r in zip(("y", "dx", "dw"), ours, compiled, eager, ref):
        assert torch.isfinite(o).all(), name
        # As close as the reference implementations (plus fp32 rounding slack). For y under
        # "llama" casting that is HF eager: it rounds x_hat to x's dtype before the weight
        # multiply, as we do; Inductor drops that intermediate rounding, so torch.compile's
        # y is closer to float64 than the HF module it compiles.
        bound = rel_err(c, r) if not (name == "y" and casting == "llama") else max(rel_err(c, r), rel_err(e, r))
        assert rel_err(o, r) <= 1.1 * bound + 2e-6, (name, rel_err(o, r), rel_err(c, r), rel_err(e, r))


def test_every_config_is_correct():
    from inductor_ext.tuning.launch_settings import force_launch_config
    from inductor_ext.tuning.search_spaces.norm import search_space

    for n in (4096, 12288, 16384, 70000):  # 12288: padded to a 16384-wide block
        x = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        ref = _grads(rms_norm_ref, x.double(), w.double(), dy.double())
        for config in dict.fromkeys(search_space(n, forward=True) + search_space(n, forward=False)):
            with force_launch_config(config.to_triton().all_kwargs()):
                ours = _grads(rms_norm, x, w, dy)
            for name, o, r in zip(("y", "dx", "dw"), ours, ref):
                assert rel_err(o, r) < 1e-2, (config, name)


def test_compiled_graph_launches_our_kernel_as_user_defined_triton_kernel():
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: inductor_ext.rms_norm(x, w), fullgraph=True)

    def train_step():
        compiled(x, w).float().square().sum().backward()

    _, code = run_and_get_joined_code(train_step)  # forward and (lazily compiled) backward graphs
    assert "rms_norm_fwd_kernel" in code and "rms_norm_bwd_kernel" in code
    # launched as user-defined Triton kernels, with no fallback call into the ops
    assert "fastops.rms_norm_fwd" not in code and "fastops.rms_norm_bwd" not in code
    assert x.grad is not None and torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_cpp_wrapper_autotunes_our_kernel_at_compile_time(monkeypatch):
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y, y2 = compile_with_cpp_wrapper_counting_tuning(
        monkeypatch, lambda x, w: inductor_ext.rms_norm(x, w), (x, w), "rms_norm_fwd_kernel"
    )
    # eager may tune to another config (another summation order): bf16 tolerance there, bitwise vs itself
    torch.testing.assert_close(y, rms_norm(x, w), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y2, y, atol=0, rtol=0)


# ---------------------------------------------------------------- fused residual add (add_rms_norm)


def _residual_grads(f, x, r, w, dy, dh_out):
    """y, h and the gradients of x, r, w when the loss reaches h through y and directly."""
    x, r, w = (t.detach().requires_grad_() for t in (x, r, w))
    y, h = f(x, r, w)
    dx, dr, dw = torch.autograd.grad((y, h), (x, r, w), (dy, dh_out))
    return y, h, dx, dr, dw


@pytest.mark.parametrize("shape", [(4096, 4096), (77, 70000), (17, 123)], ids=str)
def test_add_rms_norm_matches_float64_as_closely_as_compiled_reference(shape):
    torch._dynamo.reset()
    x, r, dy, dh_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16)
    ours = _residual_grads(inductor_ext.add_rms_norm, x, r, w, dy, dh_out)
    assert torch.equal(ours[1], x + r)  # the sum rounded like the eager add
    ref = _residual_grads(add_rms_norm_ref, x.double(), r.double(), w.double(), dy.double(), dh_out.double())
    compiled = _residual_grads(torch.compile(add_rms_norm_ref), x, r, w, dy, dh_out)
    eager = _residual_grads(add_rms_norm_ref, x, r, w, dy, dh_out)
    for name, o, c, e, ref_ in zip(("y", "h", "dx", "dr", "dw"), ours, compiled, eager, ref):
        bound = max(rel_err(c, ref_), rel_err(e, ref_))  # y: HF's rounding of x_hat, as in the test above
        assert rel_err(o, ref_) <= 1.1 * bound + 2e-6, (name, rel_err(o, ref_), rel_err(c, ref_), rel_err(e, ref_))


def test_residual_add_runs_in_our_kernels_under_the_backend():
    """The HF-spelled residual block under ``fastops_inductor`` with the kernel route: the add is
    rewritten into ``add_rms_norm``, whose graph launches our norm kernels forward and backward
    (no call back to the op); with ``cpp_wrapper`` too."""
    from torch._dynamo.utils import counters

    from tests.inductor.test_backend import ResidualNorm

    torch._dynamo.reset()
    counters.clear()
    module = ResidualNorm(4096).cuda().to(torch.bfloat16)
    x = torch.randn(8, 512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(module, backend="fastops_inductor", options={"fastops.route": "kernel"})

    def train_step():
        y = compiled(x)
        y.float().square().sum().backward()
        return y

    y, code = run_and_get_joined_code(train_step)
    assert "rms_norm_fwd_kernel" in code and "rms_norm_bwd_kernel" in code
    assert "fastops.add_rms_norm" not in code and counters["inductor_ext"]["rewrite_add_rms_norm"] == 1
    torch.testing.assert_close(y, module(x), atol=5e-2, rtol=2e-2)
    with torch.no_grad():
        y_cpp = torch.compile(
            module, backend="fastops_inductor", options={"fastops.route": "kernel", "cpp_wrapper": True}
        )(x)
        torch.testing.assert_close(y_cpp, module(x), atol=5e-2, rtol=2e-2)

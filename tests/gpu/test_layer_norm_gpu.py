"""LayerNorm on a real GPU: numerics on real shapes, compiled-graph contents, cpp_wrapper compile-time autotuning."""

import pytest
import torch

import inductor_ext
from inductor_ext.ops.layer_norm import layer_norm, layer_norm_ref
from tests.gpu.compile_checks import compile_with_cpp_wrapper_counting_tuning, run_and_get_joined_code
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(4096, 4096), (1000, 8192), (77, 70000), (17, 123), (2, 3, 5, 2048)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-5


def _grads(f, x, w, b, dy):
    """(y, dx, dw, db) with b possibly None (then db is left out)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    y = f(x, w, b)
    grads = torch.autograd.grad(y, (x, w) if b is None else (x, w, b), dy)
    return (y, *grads)


def _aten(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS)


# every shape and dtype with weight and bias; weight only in bf16 on the larger shapes
CASES = [(s, d, True) for d in DTYPES for s in SHAPES] + [(s, torch.bfloat16, False) for s in SHAPES[:3]]


@pytest.mark.parametrize("shape, dtype, with_bias", CASES, ids=str)
def test_matches_float64_as_closely_as_reference_implementations(shape, dtype, with_bias):
    torch._dynamo.reset()
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(n, device="cuda")).to(dtype) if with_bias else None
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    ref = _grads(layer_norm_ref, x.double(), w.double(), None if b is None else b.double(), dy.double())
    ours = _grads(layer_norm, x, w, b, dy)
    compiled = _grads(torch.compile(layer_norm_ref), x, w, b, dy)
    aten = _grads(_aten, x, w, b, dy)
    for name, o, c, a, r in zip(("y", "dx", "dw", "db"), ours, compiled, aten, ref):
        assert torch.isfinite(o).all(), name
        # as close as torch.compile of the reference or ATen's fused kernel (plus fp32 rounding slack)
        bound = max(rel_err(c, r), rel_err(a, r))
        assert rel_err(o, r) <= 1.1 * bound + 2e-6, (name, rel_err(o, r), rel_err(c, r), rel_err(a, r))


def test_no_affine_and_mixed_parameter_dtype():
    x = torch.randn(3000, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(layer_norm(x), _aten(x, None, None), rtol=1.6e-2, atol=1e-2)
    w = 1 + 0.1 * torch.randn(4096, device="cuda")
    b = 0.1 * torch.randn(4096, device="cuda")
    y = layer_norm(x, w, b)  # fp32 parameters, bf16 activations: y in bf16
    assert y.dtype == torch.bfloat16
    assert rel_err(y, layer_norm_ref(x.double(), w.double(), b.double())) < 1e-2


def test_statistics_are_stable_when_mean_dominates():
    """|mean| = 1000 std: both the persistent and the looped (Welford) statistics stay exact to fp32."""
    from inductor_ext.ops.layer_norm import layer_norm_family
    from inductor_ext.tuning.launch_settings import force_launch_config
    from inductor_ext.tuning.search_spaces.norm import search_space

    for n in (4096, 70000):
        x = 1000 + torch.randn(512, n, device="cuda")
        var, mean_ref = torch.var_mean(x.double(), dim=-1, correction=0)
        for persistent in (True, False):
            config = next((c for c in search_space(n) if c.persistent == persistent), None)
            if config is None:
                continue
            with force_launch_config(config.to_triton().all_kwargs()):
                _, mean, rstd = layer_norm_family(x, None, None, EPS)
            assert rel_err(mean, mean_ref) < 1e-6, (n, config)
            assert rel_err(rstd, torch.rsqrt(var + EPS)) < 1e-5, (n, config)


def test_every_config_is_correct():
    from inductor_ext.tuning.launch_settings import force_launch_config
    from inductor_ext.tuning.search_spaces.norm import search_space

    for n in (4096, 70000):
        x = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        ref = _grads(layer_norm_ref, x.double(), w.double(), b.double(), dy.double())
        configs = dict.fromkeys(search_space(n, forward=True) + search_space(n, forward=False))
        for config in configs:
            with force_launch_config(config.to_triton().all_kwargs()):
                ours = _grads(layer_norm, x, w, b, dy)
            for name, o, r in zip(("y", "dx", "dw", "db"), ours, ref):
                assert rel_err(o, r) < 1e-2, (config, name)


def test_compiled_graph_launches_our_kernels_as_user_defined_triton_kernels():
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: inductor_ext.layer_norm(x, w, b), fullgraph=True)

    def train_step():
        compiled(x, w, b).float().square().sum().backward()

    _, code = run_and_get_joined_code(train_step)  # forward and (lazily compiled) backward graphs
    assert "layer_norm_fwd_kernel" in code and "layer_norm_bwd_kernel" in code and "sum_rows_kernel" in code
    # launched as user-defined Triton kernels, with no fallback call into the ops
    assert "fastops.layer_norm_fwd" not in code and "fastops.layer_norm_bwd" not in code
    for t in (x, w, b):
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_cpp_wrapper_autotunes_our_kernel_at_compile_time(monkeypatch):
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y, y2 = compile_with_cpp_wrapper_counting_tuning(
        monkeypatch, lambda x, w, b: inductor_ext.layer_norm(x, w, b), (x, w, b), "layer_norm_fwd_kernel"
    )
    torch.testing.assert_close(y2, y, atol=0, rtol=0)
    # eager may tune to another config, whose reductions round differently (by an ulp of bf16)
    torch.testing.assert_close(y, layer_norm(x, w, b))


def test_two_pass_backward_every_config_and_compiled():
    """Rows of TWO_PASS_BACKWARD_MIN_N take the two-pass backward: every config of its dw/db kernel
    against float64 (a bf16 train step at 300 x N), and a compiled train step launches the dx
    kernel and the dw/db kernel as user-defined Triton kernels."""
    from inductor_ext.kernels.layer_norm import layer_norm_bwd_param_grads_kernel
    from inductor_ext.ops.layer_norm import TWO_PASS_BACKWARD_MIN_N
    from inductor_ext.tuning.launch_settings import force_launch_config

    n = TWO_PASS_BACKWARD_MIN_N
    x = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    ref = _grads(layer_norm_ref, x.double(), w.double(), b.double(), dy.double())
    for config in layer_norm_bwd_param_grads_kernel.configs:
        with force_launch_config(config.all_kwargs()):
            ours = _grads(layer_norm, x, w, b, dy)
        for name, o, r in zip(("y", "dx", "dw", "db"), ours, ref):
            assert rel_err(o, r) < 1e-2, (config, name)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: inductor_ext.layer_norm(x, w, b), fullgraph=True)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    _, code = run_and_get_joined_code(lambda: compiled(*leaves).float().square().sum().backward())
    assert "layer_norm_bwd_param_grads_kernel" in code and "layer_norm_bwd_kernel" in code

"""SwiGLU / GeGLU on a real GPU: numerics on real shapes, every config, int64 offsets past 2**31
elements, compiled-graph contents, cpp_wrapper compile-time autotuning."""

import pytest
import torch

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
from tests.gpu.compile_checks import compile_with_cpp_wrapper_counting_tuning, run_and_get_joined_code
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# bf16 (what models train in) at every shape; fp16 and fp32 at a large odd shape and a tiny one
# (each case compiles the reference and tunes our kernels at its shape: the whole matrix took > 8 min)
CASES = [(shape, torch.bfloat16) for shape in [(4096, 14336), (1000, 11008), (17, 123), (2, 3, 5, 2048)]]
CASES += [(shape, dtype) for dtype in (torch.float16, torch.float32) for shape in [(1000, 11008), (17, 123)]]
ACTIVATIONS = {
    "silu": (swiglu, swiglu_ref, swiglu_packed),
    "gelu": (geglu, geglu_ref, geglu_packed),
    "gelu_tanh": (
        lambda g, u: geglu(g, u, "tanh"),
        lambda g, u: geglu_ref(g, u, "tanh"),
        lambda gu: geglu_packed(gu, "tanh"),
    ),
}


def _grads(f, gate, up, dy):
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    y = f(gate, up)
    return (y, *torch.autograd.grad(y, (gate, up), dy))


def _packed_as_split(f_packed):
    return lambda g, u: f_packed(torch.cat([g, u], -1))


@pytest.mark.parametrize(("shape", "dtype"), CASES, ids=str)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_matches_float64_as_closely_as_compiled_reference(shape, dtype, activation):
    torch._dynamo.reset()
    ours_f, ref_f, packed_f = ACTIVATIONS[activation]
    gate, up, dy = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    ref = _grads(ref_f, gate.double(), up.double(), dy.double())
    compiled = _grads(torch.compile(ref_f), gate, up, dy)
    for f in (ours_f, _packed_as_split(packed_f)):
        ours = _grads(f, gate, up, dy)
        for name, o, c, r in zip(("y", "dgate", "dup"), ours, compiled, ref):
            assert o.dtype == dtype and torch.isfinite(o).all(), name
            # as close as torch.compile of the reference (plus fp32 rounding slack)
            assert rel_err(o, r) <= 1.1 * rel_err(c, r) + 2e-6, (name, rel_err(o, r), rel_err(c, r))


def test_strided_halves_of_one_projection():
    gate_up = torch.randn(3000, 2 * 4096, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, -1)
    dy = torch.randn(3000, 4096, device="cuda", dtype=torch.bfloat16)
    ref = _grads(swiglu_ref, gate.double(), up.double(), dy.double())
    for o, r in zip(_grads(swiglu, gate, up, dy), ref):
        assert rel_err(o, r) < 1e-2


def test_every_config_is_correct():
    m, n = 300, 5000
    gate_up = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16)
    strided = gate_up.chunk(2, -1)
    contiguous = [t.contiguous() for t in strided]
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for activation, (ours_f, ref_f, packed_f) in ACTIVATIONS.items():
        ref = _grads(ref_f, contiguous[0].double(), contiguous[1].double(), dy.double())
        for config in search_space():
            with force_launch_config(config.to_triton().all_kwargs()):
                runs = {
                    "flat": _grads(ours_f, *contiguous, dy),
                    "rows": _grads(ours_f, *strided, dy),
                    "packed": _grads(_packed_as_split(packed_f), *contiguous, dy),
                }
            for layout, ours in runs.items():
                for name, o, r in zip(("y", "dgate", "dup"), ours, ref):
                    assert rel_err(o, r) < 1e-2, (activation, config, layout, name)


@pytest.mark.parametrize("packed", [False, True], ids=["flat", "packed"])
def test_int64_offsets_past_2_pow_31_elements(packed):
    """M * I > 2**31: element offsets (flat) and row offsets (packed) must not wrap around."""
    m, n = 149_800, 14_336
    assert m * n > 2**31
    torch.cuda.empty_cache()
    if packed:
        gate_up = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gate, up = gate_up.detach()[:, :n], gate_up.detach()[:, n:]
    else:
        gate = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        up = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    with force_launch_config(search_space()[0].to_triton().all_kwargs()):
        if packed:
            y = swiglu_packed(gate_up)
            (dgate_up,) = torch.autograd.grad(y, gate_up, dy)
            dgate, dup = dgate_up[:, :n], dgate_up[:, n:]
        else:
            y = swiglu(gate, up)
            dgate, dup = torch.autograd.grad(y, (gate, up), dy)
    for rows in (slice(0, 4), slice(m // 2, m // 2 + 4), slice(m - 4, m)):  # the last rows are past 2**31
        g, u, d = gate[rows].detach().float(), up[rows].detach().float(), dy[rows].float()
        s = torch.sigmoid(g)
        expected = {"y": g * s * u, "dgate": d * u * s * (1 + g * (1 - s)), "dup": d * g * s}
        for name, out in (("y", y), ("dgate", dgate), ("dup", dup)):
            torch.testing.assert_close(out[rows].float(), expected[name], rtol=2e-2, atol=2e-2, msg=name)
    del y, dgate, dup, dy, gate, up
    torch.cuda.empty_cache()


def test_compiled_graph_launches_our_kernels_as_user_defined_triton_kernels():
    gate = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda g, u, gu: inductor_ext.swiglu(g, u) + inductor_ext.geglu_packed(gu, "tanh"), fullgraph=True
    )

    def train_step():
        compiled(gate, up, gate_up).float().square().sum().backward()

    _, code = run_and_get_joined_code(train_step)
    assert "glu_fwd_kernel" in code and "glu_bwd_kernel" in code
    assert "fastops.glu" not in code
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (gate, up, gate_up))


def test_cpp_wrapper_autotunes_our_kernel_at_compile_time(monkeypatch):
    gate = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    y, y2 = compile_with_cpp_wrapper_counting_tuning(
        monkeypatch, lambda g, u: inductor_ext.swiglu(g, u), (gate, up), "glu_fwd_kernel"
    )
    torch.testing.assert_close(y, swiglu(gate, up))  # configs may differ from eager's pick
    torch.testing.assert_close(y2, y, atol=0, rtol=0)

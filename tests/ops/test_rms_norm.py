"""RMSNorm: kernel numerics (every config, under the interpreter on CPU), op registration, bad input."""

import pytest
import torch

import inductor_ext
from inductor_ext.ops.rms_norm import rms_norm, rms_norm_ref
from inductor_ext.tuning.launch_settings import force_launch_config
from inductor_ext.tuning.search_spaces.norm import search_space
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, reduced_grad, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _fwd_bwd(f, x, w, dy, **kw):
    x = x.detach().clone().requires_grad_()
    w = None if w is None else w.detach().clone().requires_grad_()
    y = f(x, w, **kw)
    grads = torch.autograd.grad(y, [x] + ([w] if w is not None else []), dy)
    return (y, *grads)


def _check_against_float64(shape, dtype, with_weight=True, **kw):
    n = shape[-1]
    x = torch.randn(shape, device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype) if with_weight else None
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    ours = _fwd_bwd(rms_norm, x, w, dy, **kw)
    ref = _fwd_bwd(rms_norm_ref, x.double(), None if w is None else w.double(), dy.double(), **kw)
    rows = x.numel() // n
    bounds = [OUTPUT[dtype], OUTPUT[dtype], reduced_grad(dtype, rows)]
    for name, o, r, bound in zip(("y", "dx", "dw"), ours, ref, bounds):
        assert o.shape == r.shape, name
        assert torch.isfinite(o).all(), name
        assert rel_err(o, r) < bound, (name, rel_err(o, r), bound)
    expected_y_dtype = dtype if w is None or kw.get("casting") == "gemma" else torch.promote_types(dtype, w.dtype)
    assert ours[0].dtype == expected_y_dtype
    return ours


@pytest.mark.parametrize("n", [123, 5000, 70000])
def test_every_config_matches_float64(n):
    """Each persistent and looped variant the autotuner may pick, on an odd row count.

    A forced config applies to both kernels (the forward ignores PREFETCH).
    """
    configs = list(dict.fromkeys(search_space(n, forward=True) + search_space(n, forward=False)))
    assert any(c.persistent for c in configs) == (n <= 32768)
    assert any(not c.persistent for c in configs) == (n > 2048)  # chunks of 2048+ elements
    assert any(c.prefetch for c in configs) == (n <= 32768)
    for config in configs if n < 70000 else configs[:2]:
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64((5, n), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 257), (1, 4096), (9, 1000)], ids=str)
def test_matches_float64(shape, dtype):
    _check_against_float64(shape, dtype)


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("llama", 0.5), ("gemma", 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_casting_and_offset(casting, offset, dtype):
    _check_against_float64((7, 300), dtype, casting=casting, offset=offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_without_weight(dtype):
    _check_against_float64((6, 333), dtype, with_weight=False)


def test_large_row_uses_looped_kernel():
    """N > 65536 needs the looped path (the persistent search space stops at 32768)."""
    assert all(not c.persistent for c in search_space(70001))
    _check_against_float64((3, 70001), torch.float32)


def test_llama_casting_matches_hf_eager_bitwise():
    """Forward reproduces HF LlamaRMSNorm's rounding: fp32 normalise, round to x dtype, multiply by w."""
    x = torch.randn(8, 256, device=DEVICE, dtype=torch.float32)
    w = torch.randn(256, device=DEVICE, dtype=torch.float32)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_ref(x, w), rtol=1e-6, atol=1e-6)


def test_every_output_element_written():
    """Poisoned outputs: any element the kernels skip would stay NaN."""
    x = torch.randn(13, 200, device=DEVICE)
    w = torch.randn(200, device=DEVICE)
    dy = torch.randn_like(x)
    new_empty, empty_like = torch.Tensor.new_empty, torch.empty_like

    def poisoned_new_empty(self, *a, **k):
        return new_empty(self, *a, **k).fill_(float("nan"))

    def poisoned_empty_like(t, *a, **k):
        return empty_like(t, *a, **k).fill_(float("nan"))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
        mp.setattr(torch, "empty_like", poisoned_empty_like)
        outputs = _fwd_bwd(rms_norm, x, w, dy)
        assert torch.isnan(torch.empty_like(x)).all()  # the poison is in place
    for t in outputs:
        assert torch.isfinite(t).all()


def test_non_contiguous_input():
    base = torch.randn(300, 10, device=DEVICE)
    x = base.t()  # (10, 300), last dim has stride 10
    w = torch.randn(300, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_ref(x, w), rtol=1e-5, atol=1e-5)
    x = torch.randn(4, 600, device=DEVICE)[:, ::2]  # strided rows and columns
    torch.testing.assert_close(rms_norm(x, w), rms_norm_ref(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)], ids=str)
def test_zero_size(shape):
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert (w.grad == 0).all()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"x": torch.ones(3, 4, dtype=torch.int32)}, TypeError, "x must be float32, bfloat16 or float16"),
        ({"x": torch.ones(3, 4, dtype=torch.float64)}, TypeError, "x must be float32"),
        ({"weight": torch.ones(5)}, ValueError, r"weight must have shape \(4,\)"),
        ({"weight": torch.ones(2, 2)}, ValueError, r"weight must have shape \(4,\)"),
        ({"weight": torch.ones(4, dtype=torch.int64)}, TypeError, "weight must be float32"),
        ({"weight": torch.ones(4, device="meta")}, ValueError, "weight is on meta but x is on"),
        ({"casting": "mistral"}, ValueError, r"casting must be one of \('llama', 'gemma'\)"),
        ({"eps": -1.0}, ValueError, "eps must be >= 0"),
        ({"eps": "1e-6"}, TypeError, "eps must be a real number, got '1e-6'"),
        ({"eps": torch.tensor(1e-6)}, TypeError, r"eps must be a real number, got tensor\(1.0000e-06\) \(Tensor\)"),
        ({"offset": "1"}, TypeError, "offset must be a real number"),
        ({"x": torch.tensor(1.0)}, ValueError, "at least 1 dimension"),
        ({"x": [1.0, 2.0]}, TypeError, "x must be a Tensor"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {"x": torch.ones(3, 4), "weight": torch.ones(4), "eps": 1e-6, "offset": 0.0, "casting": "llama", **kwargs}
    with pytest.raises(error, match=match):
        rms_norm(args["x"], args["weight"], args["eps"], offset=args["offset"], casting=args["casting"])


def test_opcheck_both_ops():
    for x in (torch.randn(6, 40), torch.randn(40, 6).t()):  # contiguous and strided rows
        w = torch.randn(40, requires_grad=True)
        x = x.requires_grad_()
        torch.library.opcheck(torch.ops.fastops.rms_norm_fwd.default, (x, w, 1e-6, 0.0, "llama"))
        torch.library.opcheck(torch.ops.fastops.rms_norm_fwd.default, (x, None, 1e-6, 1.0, "gemma"))
        y, rstd = torch.ops.fastops.rms_norm_fwd(x.detach(), w.detach(), 1e-6, 0.0, "llama")
        dy = torch.randn_like(y)
        torch.library.opcheck(torch.ops.fastops.rms_norm_bwd.default, (dy, x.detach(), w.detach(), rstd, 0.0, "llama"))
        torch.library.opcheck(torch.ops.fastops.rms_norm_bwd.default, (dy, x.detach(), None, rstd, 0.0, "llama"))


def _profiled_op_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_eager_bypasses_the_dispatcher():
    """Plain eager calls launch kernels from an autograd.Function: the registered ops never run."""
    x = torch.randn(4, 64, device=DEVICE, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, device=DEVICE))
    names = _profiled_op_names(lambda: rms_norm(x, w).sum().backward())
    assert not any(n.startswith("fastops::") for n in names), names
    assert "rms_norm_eager" in names or any("rms_norm_eager" in n for n in names)
    # the registered ops are what tracing sees, and the profiler does record them
    names = _profiled_op_names(lambda: torch.ops.fastops.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")[0].sum().backward())
    assert {"fastops::rms_norm_fwd", "fastops::rms_norm_bwd"} <= names, names


def test_nn_module_loads_torch_and_hf_state_dicts():
    ours = inductor_ext.nn.RMSNorm(48, eps=1e-5)
    theirs = torch.nn.RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        theirs.weight.normal_()
    ours.load_state_dict(theirs.state_dict())
    ours.load_state_dict({"weight": theirs.weight.detach().clone()})  # HF LlamaRMSNorm's single key
    x = torch.randn(2, 3, 48)
    torch.testing.assert_close(ours(x), rms_norm_ref(x, theirs.weight, 1e-5))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    gemma = inductor_ext.nn.RMSNorm(48, offset=1.0, casting="gemma")
    assert "casting='gemma'" in repr(gemma)


@pytest.mark.parametrize("n", [123, 4096, 16384, 70000])
def test_autotuner_sees_the_whole_search_space(n):
    """The autotuners' config lists, pruned for N, are exactly the forward/backward search spaces."""
    from inductor_ext.kernels.rms_norm import rms_norm_bwd_kernel, rms_norm_fwd_kernel
    from inductor_ext.tuning.search_spaces import norm

    for kernel, forward in ((rms_norm_fwd_kernel, True), (rms_norm_bwd_kernel, False)):
        pruned = [norm.NormConfig.from_triton(c) for c in kernel.early_config_prune(kernel.configs, {"N": n})]
        assert sorted(map(str, pruned)) == sorted(map(str, search_space(n, forward)))

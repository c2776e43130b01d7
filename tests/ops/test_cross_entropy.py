"""Cross-entropy: kernel numerics (every config, under the interpreter on CPU), options, in-place
variant, label handling, op registration, compile (CPU branch), cpp_wrapper and AOTInductor on CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext
from inductor_ext.kernels.cross_entropy import (
    MAX_PERSISTENT_BLOCK,
    CrossEntropyConfig,
    bwd_search_space,
    search_space,
)
from inductor_ext.ops.cross_entropy import cross_entropy, cross_entropy_family, cross_entropy_ref
from inductor_ext.tuning.launch_settings import force_launch_config
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LOSS_TOL = OUTPUT[torch.float32]  # the loss is fp32 whatever the logits' dtype


def _logits_labels(shape, dtype, ignore_every=4, scale=3.0):
    """Random logits (spread like a trained LM's) and labels with every ``ignore_every``-th row ignored."""
    logits = (scale * torch.randn(shape, device=DEVICE)).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], device=DEVICE)
    if ignore_every:
        labels.view(-1)[ignore_every - 1 :: ignore_every] = -100
    return logits, labels


def _loss_and_grad(f, logits, labels, grad_out, **kw):
    x = logits.detach().clone().requires_grad_()
    loss = f(x, labels, **kw)
    (dx,) = torch.autograd.grad(loss, x, grad_out)
    return loss, dx


def _check_against_float64(shape, dtype, **kw):
    logits, labels = _logits_labels(shape, dtype)
    ref_loss = cross_entropy_ref(logits.double(), labels, **kw)
    grad_out = torch.rand_like(ref_loss) + 0.5
    ref = _loss_and_grad(cross_entropy_ref, logits.double(), labels, grad_out, **kw)
    loss, dx = _loss_and_grad(cross_entropy, logits, labels, grad_out.float(), **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref[0].shape
    assert dx.dtype == dtype and dx.shape == logits.shape
    assert torch.isfinite(loss).all() and torch.isfinite(dx).all()
    assert rel_err(loss, ref[0]) < LOSS_TOL, ("loss", rel_err(loss, ref[0]))
    assert rel_err(dx, ref[1]) < OUTPUT[dtype], ("dlogits", rel_err(dx, ref[1]))
    return loss, dx


@pytest.mark.parametrize("v", [123, 5000, 20000])
def test_every_config_matches_float64(v):
    """Each persistent and looped variant the autotuner may pick, with every option switched on."""
    configs = search_space(v)
    assert any(c.persistent for c in configs) == (v <= MAX_PERSISTENT_BLOCK)
    assert any(not c.persistent for c in configs) == (v > 2048)
    for config in configs:
        with force_launch_config(config.to_triton().all_kwargs()):
            if v <= MAX_PERSISTENT_BLOCK:  # (the interpreter is slow on long rows)
                _check_against_float64((4, v), torch.float32)
            _check_against_float64(
                (3, v), torch.float32, reduction="none", label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0
            )


@pytest.mark.parametrize("v", [123, 5000])
def test_every_backward_config_matches_float64(v):
    configs = bwd_search_space(v)
    assert (len(configs) == 1) == (v <= 1024)
    for config in configs:
        with force_launch_config(config.all_kwargs()):
            _check_against_float64(
                (3, v), torch.float32, reduction="none", label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 257), (1, 4096), (9, 1000), (123,)], ids=str)
def test_matches_float64(shape, dtype):
    _check_against_float64(shape, dtype)


OPTIONS = [
    {"label_smoothing": 0.1},
    {"lse_square_scale": 1e-4},
    {"softcap": 30.0},
    {"softcap": 2.0},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"reduction": "sum", "label_smoothing": 0.25, "lse_square_scale": 1e-2, "softcap": 4.0},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", OPTIONS, ids=str)
def test_options_match_float64(kw, dtype):
    _check_against_float64((7, 3000), dtype, **kw)


def test_quick_first_launch_includes_the_full_timing_pick():
    """At V = 128256 (and 32000) a quick first launch's configs include the looped 2048-class chunks
    on 8 warps, the config the H200 picked timing every one."""
    from inductor_ext.tuning.launch_settings import QUICK_FIRST_LAUNCH_CONFIGS

    for v in (32000, 128256):
        quick = search_space(v)[:QUICK_FIRST_LAUNCH_CONFIGS]
        assert CrossEntropyConfig(False, 2048, 8) in quick, quick


def test_vocab_262144():
    """The largest vocabulary we support (Gemma 3's 262144), looped kernel."""
    config = search_space(262144)[0]
    assert not config.persistent
    with force_launch_config(config.to_triton().all_kwargs()):
        _check_against_float64((2, 262144), torch.bfloat16, label_smoothing=0.1)


def test_reference_is_pytorch_cross_entropy():
    """The reference's mean is F.cross_entropy's (with ignore_index and label smoothing)."""
    logits, labels = _logits_labels((11, 37), torch.float64)
    for eps in (0.0, 0.3):
        expected = F.cross_entropy(logits, labels, label_smoothing=eps)
        torch.testing.assert_close(cross_entropy_ref(logits, labels, label_smoothing=eps), expected)
        torch.testing.assert_close(cross_entropy(logits.float(), labels, label_smoothing=eps), expected.float())


@pytest.mark.parametrize("v", [300, 5000])
def test_minus_inf_logits_like_pytorch(v):
    """Masked classes (-inf logits) give PyTorch's finite loss and zero gradient there, in both kernels."""
    logits, labels = _logits_labels((4, v), torch.float32, ignore_every=0)
    logits[:, 7::5] = float("-inf")
    labels[labels % 5 == 2] = 0  # targets are never masked
    for config in (search_space(v)[0], search_space(v)[-1]):
        with force_launch_config(config.to_triton().all_kwargs()):
            loss, dx = _loss_and_grad(cross_entropy, logits, labels, None)
        expected, expected_dx = _loss_and_grad(F.cross_entropy, logits, labels, None)
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(dx, expected_dx)


def test_int32_labels():
    logits, labels = _logits_labels((6, 300), torch.float32)
    torch.testing.assert_close(cross_entropy(logits, labels.int()), cross_entropy(logits, labels))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_labels_ignored(reduction):
    """Mean over zero tokens is NaN, exactly as PyTorch; the gradient is zero, never NaN."""
    logits = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    labels = torch.full((4,), -100, device=DEVICE)
    loss = cross_entropy(logits, labels, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2)
    expected = F.cross_entropy(logits.detach(), labels, reduction=reduction)
    torch.testing.assert_close(loss, expected, equal_nan=True)
    assert torch.isnan(loss).all() if reduction == "mean" else (loss == 0).all()
    loss.sum().backward()
    assert (logits.grad == 0).all()


def test_custom_ignore_index():
    logits, labels = _logits_labels((9, 40), torch.float32, ignore_every=0)
    labels[::2] = 7  # a valid class used as ignore_index
    torch.testing.assert_close(
        cross_entropy(logits, labels, ignore_index=7), F.cross_entropy(logits, labels, ignore_index=7)
    )


@pytest.mark.parametrize("bad", [50, 1000, -1, -101])
def test_out_of_range_label_raises_on_cpu(bad):
    logits, labels = _logits_labels((6, 50), torch.float32)
    labels[4] = bad
    with pytest.raises(
        ValueError, match=rf"labels must be in \[0, 50\) or equal ignore_index \(-100\); got {bad} at position 4"
    ):
        cross_entropy(logits, labels)


def test_out_of_range_label_in_the_kernel_gives_nan_loss_and_no_out_of_bounds_read():
    """What the GPU does (no check there, it would sync): the row's loss is NaN, the gradient finite."""
    logits, labels = _logits_labels((6, 50), torch.float32, ignore_every=0)
    labels[1], labels[4] = 50, -7
    x = logits.clone().requires_grad_()
    loss, _lse = cross_entropy_family(x, labels, -100, 0.0, 0.0, 0.0, "none")  # the op: no CPU label check
    (dlogits,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    assert torch.isnan(loss[[1, 4]]).all() and torch.isfinite(loss[[0, 2, 3, 5]]).all()
    assert torch.isfinite(dlogits).all()
    # the other rows are unaffected
    good = torch.tensor([0, 2, 3, 5])
    torch.testing.assert_close(loss[good], F.cross_entropy(logits[good], labels[good], reduction="none"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_inplace_backward(reduction, grad_scale):
    """Same loss and gradient as the default; the logits hold the gradient; a second backward is refused."""
    logits, labels = _logits_labels((5, 3000), torch.bfloat16)
    kw = {"reduction": reduction, "label_smoothing": 0.1, "softcap": 20.0}
    row_weight = torch.rand(5, device=DEVICE) if reduction == "none" else 1.0

    def run(inplace):
        leaf = logits.clone().requires_grad_()
        produced = leaf * 1  # a non-leaf, like the lm_head's output
        loss = cross_entropy(produced, labels, inplace_backward=inplace, **kw)
        (loss * row_weight * grad_scale).sum().backward(retain_graph=True)
        return loss, produced, leaf.grad

    loss_ref, produced_ref, grad_ref = run(False)
    loss, produced, grad = run(True)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=0)
    assert torch.equal(produced_ref, logits) and not torch.equal(produced, logits)  # overwritten
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


@pytest.mark.parametrize("leaf", ["requires_grad", "parameter"])
def test_inplace_backward_leaves_a_leaf_alone(leaf):
    """A leaf's values must survive its backward (an optimizer steps from them): the option is ignored."""
    logits, labels = _logits_labels((4, 300), torch.float32)
    x = logits.clone().requires_grad_() if leaf == "requires_grad" else torch.nn.Parameter(logits.clone())
    cross_entropy(x, labels, inplace_backward=True).backward()
    assert torch.equal(x.detach(), logits)
    reference = logits.clone().requires_grad_()
    cross_entropy(reference, labels).backward()
    torch.testing.assert_close(x.grad, reference.grad, rtol=0, atol=0)


def test_inplace_backward_without_grad_does_not_mutate():
    logits, labels = _logits_labels((4, 300), torch.float32)
    before = logits.clone()
    cross_entropy(logits, labels, inplace_backward=True)
    assert torch.equal(logits, before)


def test_default_does_not_mutate_logits():
    logits, labels = _logits_labels((4, 300), torch.float32)
    x = logits.clone().requires_grad_()
    cross_entropy(x, labels).backward()
    assert torch.equal(x.detach(), logits)


def test_no_grad_forward_matches():
    logits, labels = _logits_labels((5, 3000), torch.bfloat16)
    with torch.no_grad():
        loss = cross_entropy(logits, labels)
    torch.testing.assert_close(loss, cross_entropy_ref(logits.double(), labels).float(), rtol=LOSS_TOL, atol=0)


def _poisoned_allocations(mp):
    empty, new_empty = torch.empty, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    mp.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    mp.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(new_empty(self, *a, **k)))


def test_every_output_element_written():
    """Poisoned outputs: any element the kernels skip would stay NaN (ignored rows included)."""
    logits, labels = _logits_labels((13, 3000), torch.float32)
    for config in (search_space(3000)[0], search_space(3000)[-1]):
        with pytest.MonkeyPatch.context() as mp, force_launch_config(config.to_triton().all_kwargs()):
            _poisoned_allocations(mp)
            assert torch.isnan(torch.empty(3)).all()  # the poison is in place
            for reduction, grad_out in (("mean", None), ("none", torch.ones(13))):
                loss, dx = _loss_and_grad(cross_entropy, logits, labels, grad_out, reduction=reduction)
                assert torch.isfinite(loss).all() and torch.isfinite(dx).all()


def test_non_contiguous_inputs():
    base = torch.randn(300, 10, device=DEVICE)
    logits = base.t()  # (10, 300), classes not unit-stride
    labels = torch.randint(0, 300, (20,), device=DEVICE)[::2]  # strided labels
    torch.testing.assert_close(cross_entropy(logits, labels), cross_entropy_ref(logits, labels))
    logits = torch.randn(6, 700, device=DEVICE)[:, ::2]  # strided rows and classes
    labels = torch.randint(0, 350, (6,), device=DEVICE)
    torch.testing.assert_close(cross_entropy(logits, labels), cross_entropy_ref(logits, labels))
    logits = torch.randn(6, 700, device=DEVICE)[:, :350]  # row stride 700, unit class stride
    x = logits.clone().requires_grad_()
    x_view = x[:, :]
    loss, dx = _loss_and_grad(cross_entropy, x_view, labels, None)
    ref_loss, ref_dx = _loss_and_grad(cross_entropy_ref, logits.double(), labels, None)
    assert rel_err(loss, ref_loss) < LOSS_TOL and rel_err(dx, ref_dx) < OUTPUT[torch.float32]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_zero_rows(reduction):
    logits = torch.randn(0, 64, device=DEVICE, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long, device=DEVICE)
    loss = cross_entropy(logits, labels, reduction=reduction)
    torch.testing.assert_close(loss, F.cross_entropy(logits.detach(), labels, reduction=reduction), equal_nan=True)
    loss.sum().backward()
    assert logits.grad.shape == (0, 64)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"logits": torch.ones(3, 4, dtype=torch.int32)}, TypeError, "logits must be float32, bfloat16 or float16"),
        ({"logits": torch.ones(3, 4, dtype=torch.float64)}, TypeError, "logits must be float32"),
        ({"logits": [1.0]}, TypeError, "logits must be a Tensor"),
        ({"logits": torch.tensor(1.0)}, ValueError, "logits must have at least 1 dimension"),
        ({"logits": torch.ones(3, 0)}, ValueError, "logits must have at least one class"),
        ({"labels": torch.zeros(3)}, TypeError, "labels must be int64 or int32, got torch.float32"),
        ({"labels": torch.zeros(4, dtype=torch.long)}, ValueError, r"labels must have shape \(3,\)"),
        ({"labels": [0, 1, 2]}, TypeError, "labels must be a Tensor"),
        ({"labels": torch.zeros(3, dtype=torch.long, device="meta")}, ValueError, "labels are on meta"),
        ({"reduction": "avg"}, ValueError, r"reduction must be one of \('mean', 'sum', 'none'\)"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ({"label_smoothing": "0.1"}, TypeError, "label_smoothing must be a real number, got '0.1'"),
        ({"lse_square_scale": None}, TypeError, "lse_square_scale must be a real number"),
        ({"softcap": "30"}, TypeError, "softcap must be a real number"),
        ({"lse_square_scale": -1.0}, ValueError, "lse_square_scale must be finite and >= 0"),
        ({"softcap": 0.0}, ValueError, "softcap must be None or a finite number > 0"),
        ({"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        ({"inplace_backward": 1}, TypeError, "inplace_backward must be a bool"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {"logits": torch.ones(3, 4), "labels": torch.zeros(3, dtype=torch.long), **kwargs}
    logits, labels = args.pop("logits"), args.pop("labels")
    with pytest.raises(error, match=match):
        cross_entropy(logits, labels, **args)


def test_opcheck_all_ops():
    ops = torch.ops.fastops
    labels = torch.randint(0, 40, (6,))
    labels[0] = -100
    for logits, reduction in ((torch.randn(6, 40), "mean"), (torch.randn(6, 80)[:, 5:45], "none")):
        options = (-100, 0.1, 1e-3, 5.0, reduction)
        torch.library.opcheck(ops.cross_entropy_fwd.default, (logits.clone().requires_grad_(), labels, *options))
        torch.library.opcheck(ops.cross_entropy_fwd.default, (logits, labels, *options))
        loss, lse = ops.cross_entropy_fwd(logits, labels, *options)
        grad_out = torch.rand_like(loss)
        torch.library.opcheck(ops.cross_entropy_bwd.default, (grad_out, logits, labels, lse, *options))
        torch.library.opcheck(ops.cross_entropy_bwd_inplace.default, (grad_out, logits.clone(), labels, lse, *options))


def _profiled_op_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_eager_bypasses_the_dispatcher():
    logits, labels = _logits_labels((4, 64), torch.float32)
    x = logits.requires_grad_()
    for inplace in (False, True):

        def step(inplace: bool = inplace) -> None:
            cross_entropy(x * 1, labels, inplace_backward=inplace).backward()

        names = _profiled_op_names(step)
        assert not any(n.startswith("fastops::") for n in names), names


def test_nn_module():
    loss_fn = inductor_ext.nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)
    logits, labels = _logits_labels((2, 3, 50), torch.float32, ignore_every=0)
    labels[0, 1] = -1
    torch.testing.assert_close(
        loss_fn(logits, labels), cross_entropy_ref(logits, labels, ignore_index=-1, label_smoothing=0.1)
    )
    assert "label_smoothing=0.1" in repr(loss_fn)


# --- torch.compile / cpp_wrapper / AOTInductor on CPU (the ops' CPU branch) ----------------------


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("inplace", [False, True], ids=["default", "inplace_backward"])
def test_compile_fullgraph_matches_eager(fresh_dynamo, inplace):
    """fwd+bwd through a linear layer (so the in-place variant overwrites an intermediate), static shapes."""
    hidden, weight = torch.randn(12, 16), torch.randn(300, 16)
    labels = torch.randint(0, 300, (12,))
    labels[::3] = -100

    def f(h, w, y):
        return cross_entropy(h @ w.t(), y, label_smoothing=0.1, lse_square_scale=1e-3, softcap=10.0,
                             inplace_backward=inplace)  # fmt: skip

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w, labels)
        (loss * 0.7).backward()
        return loss.detach(), h.grad, w.grad

    got, expected = run(torch.compile(f, fullgraph=True, dynamic=False)), run(f)
    assert _graph_breaks() == 0
    for name, g, e in zip(("loss", "dh", "dw"), got, expected):
        assert rel_err(g, e) < 1e-5, (name, rel_err(g, e))


def test_compile_dynamic_rows_one_graph(fresh_dynamo):
    def f(x, y):
        return cross_entropy(x, y, reduction="none")

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for rows in (5, 9):
        logits, labels = _logits_labels((rows, 3, 70), torch.float32)
        got = _loss_and_grad(compiled, logits, labels, torch.ones(rows, 3))
        expected = _loss_and_grad(f, logits, labels, torch.ones(rows, 3))
        assert rel_err(got[0], expected[0]) < 1e-5 and rel_err(got[1], expected[1]) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1
    assert _graph_breaks() == 0


def test_cpp_wrapper(fresh_dynamo):
    logits, labels = _logits_labels((6, 90), torch.float32)

    def f(x, y):
        return cross_entropy(x, y, label_smoothing=0.1)

    with torch._inductor.config.patch(cpp_wrapper=True):
        got, codes = run_and_get_code(_loss_and_grad, torch.compile(f, fullgraph=True), logits, labels, None)
    assert len(codes) == 2 and all("inductor_entry_impl" in c and "def call(" not in c for c in codes)
    expected = _loss_and_grad(f, logits, labels, None)
    assert rel_err(got[0], expected[0]) < 1e-5 and rel_err(got[1], expected[1]) < 1e-5


class _LMHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 200, bias=False)
        self.loss = inductor_ext.nn.CrossEntropyLoss(label_smoothing=0.05)

    def forward(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(self.proj(h), labels)


def test_aoti_export_and_load(tmp_path, fresh_dynamo):
    model = _LMHead().eval()
    h = torch.randn(2, 7, 16)
    labels = torch.randint(0, 200, (2, 7))
    labels[0, :3] = -100
    ep = torch.export.export(model, (h, labels))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.fastops.cross_entropy_fwd.default in targets
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "ce.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        expected = model(h, labels)
        labels2 = torch.randint(0, 200, (2, 7))
        assert rel_err(runner(h, labels), expected) < 1e-5
        assert rel_err(runner(h, labels2), model(h, labels2)) < 1e-5

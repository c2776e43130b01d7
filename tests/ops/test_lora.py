"""Fused LoRA linear / QKV / MLP: forward and gradients against float64 and against PEFT's unfused
layers (eager: the GLU kernels under the interpreter on CPU), dropout (PEFT's own masks), op
registration (opcheck), bad input, and fullgraph torch.compile through the ops' CPU branch."""

from typing import ClassVar

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch._dynamo.utils import counters

import inductor_ext
from inductor_ext.ops.lora import (
    LoraProjection,
    lora_linear,
    lora_linear_family,
    lora_linear_ref,
    lora_mlp,
    lora_mlp_family,
    lora_mlp_ref,
    lora_qkv,
    lora_qkv_family,
    lora_qkv_ref,
)
from inductor_ext.ops.nf4 import Nf4Weight
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, reduced_grad, rel_err

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN, KV, INTERMEDIATE, RANK = 48, 16, 80, 8
BATCH, SEQ = 2, 11  # N = 22 rows: not a power of two
ADAPTER = "default"


class _Attention(torch.nn.Module):
    """The projections of an attention block (Qwen2-like: biased q/k/v, unbiased o; Llama: no biases)."""

    def __init__(self, hidden: int = HIDDEN, kv: int = KV, qkv_bias: bool = True) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=qkv_bias)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=qkv_bias)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=qkv_bias)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)


class _Mlp(torch.nn.Module):
    """HF's LlamaMLP / GemmaMLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, activation: str, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act = {"silu": torch.nn.SiLU(), "gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU("tanh")}[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _peft(
    module: torch.nn.Module, targets: list[str], dtype: torch.dtype, dropout_p: float, rank: int = RANK
) -> torch.nn.Module:
    """``module`` with PEFT LoRA adapters (alpha twice the rank: scaling 2) on ``targets``; B random, not
    zero (PEFT's initial B = 0 would make every A gradient zero)."""
    module = module.to(device=DEVICE, dtype=dtype)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout_p, target_modules=targets)
    module = inject_adapter_in_model(config, module)
    for name in targets:
        lora_b = getattr(module, name).lora_B[ADAPTER].weight
        with torch.no_grad():
            lora_b.copy_(torch.randn_like(lora_b) / rank**0.5)
    return module


def _projection(layer: torch.nn.Module) -> LoraProjection:
    """A PEFT ``lora.Linear``'s parameters (the tensors themselves)."""
    base = layer.base_layer
    return LoraProjection(
        base.weight, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER], base.bias
    )


def _leaves(layers: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [t for layer in layers for t in (layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight)]


class _RecordingDropout(torch.nn.Module):
    """nn.Dropout's inverted dropout that keeps the mask it drew: put in place of PEFT's dropout modules,
    so that ours is given the masks PEFT's layers used."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mask = torch.rand(x.shape, device=x.device) >= self.p
        return x * self.mask / (1 - self.p)


def _record_dropout(layers: list[torch.nn.Module], dropout_p: float) -> list[_RecordingDropout]:
    recorders = [_RecordingDropout(dropout_p) for _ in layers]
    for layer, recorder in zip(layers, recorders):
        assert isinstance(layer.lora_dropout[ADAPTER], torch.nn.Dropout)
        layer.lora_dropout[ADAPTER] = recorder
    return recorders


def _recorded_masks(recorders: list[_RecordingDropout]) -> tuple[torch.Tensor, ...] | None:
    """The masks of PEFT's last forward; None without dropout."""
    return tuple(r.mask for r in recorders) if recorders else None


def _outputs_and_grads(f, x: torch.Tensor, params: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """``f(x)``'s outputs, then the gradients of ``x`` and ``params`` for fixed random cotangents."""
    x = x.detach().clone().requires_grad_()
    outputs = f(x)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    cotangents = [torch.randn(o.shape, device=DEVICE, generator=generator).to(o.dtype) for o in outputs]
    return [o.detach() for o in outputs] + list(torch.autograd.grad(outputs, [x, *params], cotangents))


def _float64(proj: LoraProjection) -> LoraProjection:
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().double().requires_grad_(t.requires_grad)

    return LoraProjection(
        leaf(proj.weight), leaf(proj.lora_a), leaf(proj.lora_b), proj.scaling,
        None if proj.bias is None else leaf(proj.bias),
    )  # fmt: skip


def _ours_and_float64(fused, ref, projs, x: torch.Tensor, params: list[torch.Tensor], **kw) -> tuple[list, list]:
    """Outputs and gradients (``x``'s and ``params``') of ``fused(x, *projs, **kw)``, and of
    ``ref(x, *projs, **kw)`` on float64 copies of ``x`` and ``projs`` (gradients of their adapters)."""
    ours = _outputs_and_grads(lambda x: fused(x, *projs, **kw), x, params)
    projs64 = [_float64(p) for p in projs]
    params64 = [t for p in projs64 for t in (p.lora_a, p.lora_b)]
    return ours, _outputs_and_grads(lambda x: ref(x, *projs64, **kw), x.double(), params64)


def _compare(name: str, ours, ref, n_outputs: int, dtype: torch.dtype, rows: int, peft=None) -> None:
    """Each of ours within its bound of float64 (outputs and dx: a few roundings; dA and dB: sums over
    ``rows``) and in PEFT's dtype; against PEFT: tight in float32, within both bounds in bf16 (each is
    near the truth)."""
    for i, (o, r) in enumerate(zip(ours, ref)):
        what = f"{name}[{i}]"
        assert o.shape == r.shape and torch.isfinite(o).all(), what
        bound = OUTPUT[dtype] if i <= n_outputs else reduced_grad(dtype, rows)
        assert rel_err(o, r) < bound, (what, rel_err(o, r), bound)
        if peft is not None:
            assert o.dtype == peft[i].dtype, what
            peft_bound = bound if dtype == torch.float32 else 2 * bound
            assert rel_err(o, peft[i]) < peft_bound, (what, "against PEFT", rel_err(o, peft[i]), peft_bound)


def _x(dtype: torch.dtype, features: int = HIDDEN) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, features, device=DEVICE).to(dtype)


def _check_linear_layer(layer: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, dropout_p: float) -> None:
    params = _leaves([layer])
    recorders = _record_dropout([layer], dropout_p) if dropout_p > 0 else []
    peft = _outputs_and_grads(layer, x, params)
    mask = masks[0] if (masks := _recorded_masks(recorders)) else None
    proj = _projection(layer)
    kw = {"dropout_p": dropout_p, "dropout_mask": mask}
    ours, ref = _ours_and_float64(lora_linear, lora_linear_ref, [proj], x, params, **kw)
    _compare("linear", ours, ref, 1, dtype, BATCH * SEQ, peft)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_matches_peft_and_float64(dtype, dropout_p):
    model = _peft(_Attention(), ["q_proj", "o_proj"], dtype, dropout_p)
    x = _x(dtype)
    _check_linear_layer(model.q_proj, x, dtype, dropout_p)  # biased
    _check_linear_layer(model.o_proj, x, dtype, dropout_p)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qkv_matches_peft_and_float64(dtype, dropout_p):
    model = _peft(_Attention(), ["q_proj", "k_proj", "v_proj"], dtype, dropout_p)
    layers = [model.q_proj, model.k_proj, model.v_proj]
    x = _x(dtype)
    params = _leaves(layers)
    recorders = _record_dropout(layers, dropout_p) if dropout_p > 0 else []
    peft = _outputs_and_grads(lambda x: tuple(layer(x) for layer in layers), x, params)
    masks = _recorded_masks(recorders)
    q, k, v = (_projection(layer) for layer in layers)
    kw = {"dropout_p": dropout_p, "dropout_masks": masks}
    ours, ref = _ours_and_float64(lora_qkv, lora_qkv_ref, [q, k, v], x, params, **kw)
    _compare("qkv", ours, ref, 3, dtype, BATCH * SEQ, peft)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_matches_peft_and_float64(dtype, dropout_p, activation):
    model = _peft(_Mlp(activation), ["gate_proj", "up_proj", "down_proj"], dtype, dropout_p)
    layers = [model.gate_proj, model.up_proj, model.down_proj]
    x = _x(dtype)
    params = _leaves(layers)
    recorders = _record_dropout(layers, dropout_p) if dropout_p > 0 else []
    peft = _outputs_and_grads(model, x, params)
    masks = _recorded_masks(recorders)
    gate, up, down = (_projection(layer) for layer in layers)
    kw = {"activation": activation, "dropout_p": dropout_p, "dropout_masks": masks}
    ours, ref = _ours_and_float64(lora_mlp, lora_mlp_ref, [gate, up, down], x, params, **kw)
    _compare("mlp", ours, ref, 1, dtype, BATCH * SEQ, peft)


def test_mlp_gelu_with_biases_matches_float64():
    """The erf GELU, and biased projections (as LoraProjection allows), against float64 only."""
    projs = [
        LoraProjection(torch.randn(o, i) / i**0.5, torch.randn(RANK, i) / i**0.5, torch.randn(o, RANK), 0.5,
                       torch.randn(o))
        for i, o in ((HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN))
    ]  # fmt: skip
    params = [t.requires_grad_() for p in projs for t in (p.lora_a, p.lora_b)]
    x = _x(torch.float32)
    ours, ref = _ours_and_float64(lora_mlp, lora_mlp_ref, projs, x, params, activation="gelu")
    assert all(t.dtype == torch.float32 for t in ours)
    _compare("mlp", ours, ref, 1, torch.float32, BATCH * SEQ)


def _float32_adapters(layers: list[torch.nn.Module]) -> None:
    for layer in layers:
        layer.lora_A[ADAPTER].float()
        layer.lora_B[ADAPTER].float()


def _errors(results: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    return [rel_err(r, e) for r, e in zip(results, ref)]


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_float32_adapters_over_bf16_base_are_as_close_to_float64_as_peft(dropout_p):
    """PEFT's default (``autocast_adapter_dtype``) keeps adapters in float32 over a bf16 base and runs
    the low-rank GEMMs in float32: ours too, so the adapters' gradients are float32-accurate (PEFT's
    are), not bf16-rounded. Outputs and dx are bf16 either way."""
    model = _peft(_Mlp("silu"), ["gate_proj", "up_proj", "down_proj"], torch.bfloat16, dropout_p)
    layers = [model.gate_proj, model.up_proj, model.down_proj]
    _float32_adapters(layers)
    recorders = _record_dropout(layers, dropout_p) if dropout_p > 0 else []
    params = _leaves(layers)
    x = _x(torch.bfloat16)
    peft = _outputs_and_grads(model, x, params)
    kw = {"dropout_p": dropout_p, "dropout_masks": _recorded_masks(recorders)}
    projs = [_projection(layer) for layer in layers]
    ours, ref = _ours_and_float64(lora_mlp, lora_mlp_ref, projs, x, params, **kw)
    assert [t.dtype for t in ours] == [torch.bfloat16] * 2 + [torch.float32] * 6
    # the GLU kernel's bf16 stores truncate under the interpreter (tests/tolerances.py): twice the rounding
    factor = 2.0 if DEVICE == "cpu" else 1.5
    for i, (mine, theirs) in enumerate(zip(_errors(ours, ref), _errors(peft, ref))):
        assert mine <= factor * theirs + 1e-6, (i, mine, theirs)
    # one projection, from the same bf16 inputs and cotangent: the adapters' gradients are PEFT's float32
    # ones up to float32 rounding (bf16 GEMMs would be ~4e-3 from them)
    layer = _peft(_Attention(), ["o_proj"], torch.bfloat16, 0.0).o_proj
    _float32_adapters([layer])
    params = _leaves([layer])
    peft = _outputs_and_grads(layer, x, params)
    ours = _outputs_and_grads(lambda x: lora_linear(x, _projection(layer)), x, params)
    assert max(_errors(ours[2:], peft[2:])) < 1e-5


def test_float32_adapters_under_autocast_run_in_bf16_as_peft_does():
    layer = _peft(_Attention(), ["o_proj"], torch.bfloat16, 0.0).o_proj
    _float32_adapters([layer])
    params = _leaves([layer])
    x = _x(torch.bfloat16)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        peft = _outputs_and_grads(layer, x, params)
        ours, ref = _ours_and_float64(lora_linear, lora_linear_ref, [_projection(layer)], x, params)
    assert [t.dtype for t in ours] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    _compare("linear", ours, ref, 1, torch.bfloat16, BATCH * SEQ, peft)


def _events(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def _random_projection(i: int, o: int, dtype: torch.dtype = torch.float32) -> LoraProjection:
    return LoraProjection(
        (torch.randn(o, i, device=DEVICE) / i**0.5).to(dtype),
        (torch.randn(RANK, i, device=DEVICE) / i**0.5).to(dtype).requires_grad_(),
        (torch.randn(o, RANK, device=DEVICE) / RANK**0.5).to(dtype).requires_grad_(),
        2.0,
    )


def test_no_dropout_adds_no_work_and_dropout_draws_a_mask():
    proj = _random_projection(HIDDEN, KV)
    x = _x(torch.float32)
    without = _events(lambda: lora_linear(x, proj))
    assert not {"aten::bernoulli_", "aten::mul"} & without, without
    assert "aten::bernoulli_" in _events(lambda: lora_linear(x, proj, dropout_p=0.1))


def test_drawn_masks_keep_with_probability_one_minus_p():
    """Without given masks, each projection draws ``bernoulli(1 - p)`` keep-masks from the global generator,
    in order (gate, up, down): the same draws given explicitly give the same output."""
    gate, up, down = (_random_projection(i, o) for i, o in ((HIDDEN, INTERMEDIATE),) * 2 + ((INTERMEDIATE, HIDDEN),))
    x, p = _x(torch.float32), 0.75
    torch.manual_seed(1)
    y = lora_mlp(x, gate, up, down, dropout_p=p)
    torch.manual_seed(1)
    shapes = [x.shape, x.shape, (*x.shape[:-1], INTERMEDIATE)]
    masks = tuple(torch.empty(shape, dtype=torch.bool).bernoulli_(1 - p) for shape in shapes)
    assert 0.15 < masks[0].float().mean() < 0.35
    torch.testing.assert_close(y, lora_mlp(x, gate, up, down, dropout_p=p, dropout_masks=masks), rtol=0, atol=0)


def test_backward_skips_dx_when_the_input_needs_no_gradient():
    """The first layer's input (frozen embeddings) needs no gradient: no ``dy W`` GEMM then."""
    proj = _random_projection(HIDDEN, KV)
    x = _x(torch.float32)
    y = lora_linear(x, proj)
    names = _events(lambda: y.sum().backward())
    assert "aten::addmm_" not in names, names
    assert proj.lora_a.grad is not None and proj.lora_b.grad is not None
    x.requires_grad_()
    y = lora_linear(x, proj)
    assert "aten::addmm_" in _events(lambda: y.sum().backward())
    assert x.grad is not None


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_mlp_keeps_gate_up_and_the_rank_r_products_only(dropout_p):
    """Beside x, the weights and the adapters (kept as they are, never copied), the MLP keeps G and U,
    the three (N, r) products and, with dropout, the three bool masks: no h, no weight copy."""
    gate, up, down = (_random_projection(i, o) for i, o in ((HIDDEN, INTERMEDIATE),) * 2 + ((INTERMEDIATE, HIDDEN),))
    x = _x(torch.float32).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lora_mlp(x, gate, up, down, dropout_p=dropout_p)
    given = {t.untyped_storage().data_ptr() for p in (gate, up, down) for t in (p.weight, p.lora_a, p.lora_b)}
    given.add(x.untyped_storage().data_ptr())
    kept = sorted((tuple(t.shape), str(t.dtype)) for t in saved if t.untyped_storage().data_ptr() not in given)
    n, f32, bool_ = BATCH * SEQ, str(torch.float32), str(torch.bool)
    expected = [((n, INTERMEDIATE), f32)] * 2 + [((n, RANK), f32)] * 3
    if dropout_p > 0:
        expected += [((n, HIDDEN), bool_)] * 2 + [((n, INTERMEDIATE), bool_)]
    assert kept == sorted(expected)


def test_eager_bypasses_the_dispatcher():
    gate, up, down = (_random_projection(i, o) for i, o in ((HIDDEN, INTERMEDIATE),) * 2 + ((INTERMEDIATE, HIDDEN),))
    x = _x(torch.float32).requires_grad_()
    names = _events(lambda: lora_mlp(x, gate, up, down, dropout_p=0.1).sum().backward())
    assert not any(n.startswith("fastops::") for n in names), names
    assert any("lora_mlp_eager" in n for n in names), names


def test_zero_rows():
    proj = _random_projection(HIDDEN, KV)
    x = torch.randn(0, HIDDEN, device=DEVICE, requires_grad=True)
    y = lora_linear(x, proj, dropout_p=0.5)
    assert y.shape == (0, KV)
    y.sum().backward()
    assert x.grad.shape == x.shape and not proj.lora_a.grad.any()


# --- opcheck --------------------------------------------------------------------------------------


def _weight_args(proj: LoraProjection) -> list:
    """``weight, weight_quant`` as the ops take them (a 4-bit weight: its codes and its scales)."""
    return list(proj.weight.op_arguments()) if isinstance(proj.weight, Nf4Weight) else [proj.weight, []]


def _fwd_args(proj: LoraProjection, mask: torch.Tensor | None) -> list:
    return [*_weight_args(proj), proj.bias, proj.lora_a, proj.lora_b, proj.scaling, mask]


def _bwd_args(proj: LoraProjection, xa: torch.Tensor, mask: torch.Tensor | None) -> list:
    return [*_weight_args(proj), proj.lora_a.detach(), proj.lora_b.detach(), xa, proj.scaling, mask]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
def test_opcheck_all_ops(dropout, dtype):
    n, p = 6, 0.25
    x = torch.randn(HIDDEN, n, device=DEVICE).to(dtype).t()  # non-contiguous rows
    dy = torch.randn(n, KV, device=DEVICE).to(dtype)

    def mask(features: int) -> torch.Tensor | None:
        return torch.rand(n, features, device=DEVICE) > p if dropout else None

    ops = torch.ops.fastops
    proj = _random_projection(HIDDEN, KV, dtype)._replace(bias=torch.randn(KV, device=DEVICE).to(dtype))
    m = mask(HIDDEN)
    torch.library.opcheck(ops.lora_linear_fwd.default, (x.requires_grad_(), *_fwd_args(proj, m), p))
    _, xa = ops.lora_linear_fwd(x.detach(), *_fwd_args(proj, m), p)
    for compute_dx in (True, False):
        torch.library.opcheck(ops.lora_linear_bwd.default, (dy, x.detach(), *_bwd_args(proj, xa, m), p, compute_dx))

    qkv = [proj, _random_projection(HIDDEN, KV, dtype), _random_projection(HIDDEN, KV, dtype)]
    masks = [mask(HIDDEN) for _ in qkv]
    fwd = [a for pr, mk in zip(qkv, masks) for a in _fwd_args(pr, mk)]
    torch.library.opcheck(ops.lora_qkv_fwd.default, (x, *fwd, p))
    *_, q_xa, k_xa, v_xa = ops.lora_qkv_fwd(x.detach(), *fwd, p)
    bwd = [a for pr, xa_, mk in zip(qkv, (q_xa, k_xa, v_xa), masks) for a in _bwd_args(pr, xa_, mk)]
    torch.library.opcheck(ops.lora_qkv_bwd.default, (dy, dy.clone(), dy.clone(), x.detach(), *bwd, p, True))

    mlp = [_random_projection(HIDDEN, INTERMEDIATE, dtype), _random_projection(HIDDEN, INTERMEDIATE, dtype),
           _random_projection(INTERMEDIATE, KV, dtype)]  # fmt: skip
    masks = [mask(HIDDEN), mask(HIDDEN), mask(INTERMEDIATE)]
    fwd = [a for pr, mk in zip(mlp, masks) for a in _fwd_args(pr, mk)]
    torch.library.opcheck(ops.lora_mlp_fwd.default, (x, *fwd, "gelu_tanh", p))
    _, gate_out, up_out, *xas = ops.lora_mlp_fwd(x.detach(), *fwd, "gelu_tanh", p)
    bwd = [a for pr, xa_, mk in zip(mlp, xas, masks) for a in _bwd_args(pr, xa_, mk)]
    torch.library.opcheck(ops.lora_mlp_bwd.default, (dy, x.detach(), gate_out, up_out, *bwd, "gelu_tanh", p, True))


def test_families_are_registered():
    assert inductor_ext.lora_mlp is lora_mlp
    for family, name in ((lora_linear_family, "lora_linear"), (lora_qkv_family, "lora_qkv"),
                         (lora_mlp_family, "lora_mlp")):  # fmt: skip
        assert family.fwd._name == f"fastops::{name}_fwd" and family.bwd._name == f"fastops::{name}_bwd"


# --- bad input ------------------------------------------------------------------------------------


def _bad(**changes) -> LoraProjection:
    return LoraProjection(torch.ones(6, 4), torch.ones(2, 4), torch.ones(6, 2), 1.0)._replace(**changes)


_GOOD = _bad()


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: lora_linear(torch.ones(3, 4, dtype=torch.int32), _GOOD), TypeError, "x must be float32"),
        (lambda: lora_linear(torch.tensor(1.0), _GOOD), ValueError, "x must have at least 1 dimension"),
        (lambda: lora_linear(torch.ones(3, 4), (1, 2)), TypeError, "proj must be a LoraProjection"),
        (lambda: lora_linear(torch.ones(3, 5), _GOOD), ValueError, r"proj.weight must have shape \(out, 5\)"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(weight=torch.ones(6, 4, dtype=torch.bfloat16))), TypeError,
         r"proj.weight must have x's dtype \(torch.float32\)"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(weight=torch.ones(6, 4, requires_grad=True))), ValueError,
         "proj.weight must be frozen"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(lora_a=torch.ones(2, 3))), ValueError,
         r"proj.lora_a must have shape \(r, 4\)"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(lora_b=torch.ones(6, 3))), ValueError,
         r"proj.lora_b must have shape \(out, r\) = \(6, 2\) for proj.weight's 6 outputs and proj.lora_a's rank 2"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(lora_b=torch.ones(5, 2))), ValueError,
         r"proj.lora_b must have shape \(out, r\) = \(6, 2\)"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(lora_a=torch.ones(2))), ValueError, "proj.lora_a must be 2-D"),
        (lambda: lora_linear(torch.ones(3, 4, dtype=torch.bfloat16), _bad(
            weight=torch.ones(6, 4, dtype=torch.bfloat16), lora_a=torch.ones(2, 4, dtype=torch.float16))),
         TypeError, r"proj.lora_a must have x's dtype \(torch.bfloat16\) or float32"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(lora_b=torch.ones(6, 2, device="meta"))), ValueError,
         "proj.lora_b is on meta but x is on cpu"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(bias=torch.ones(5))), ValueError,
         r"proj.bias must have shape \(6,\)"),
        (lambda: lora_linear(torch.ones(3, 4), _bad(scaling=torch.tensor(2.0))), TypeError,
         "proj.scaling must be a float"),
        (lambda: lora_linear(torch.ones(3, 4), _GOOD, dropout_p=1.0), ValueError,
         r"dropout_p must be a float in \[0, 1\)"),
        (lambda: lora_linear(torch.ones(3, 4), _GOOD, dropout_p=0.1, dropout_mask=torch.ones(3, 4)), TypeError,
         "dropout_mask must be a bool keep-mask"),
        (lambda: lora_linear(torch.ones(3, 4), _GOOD, dropout_p=0.1, dropout_mask=torch.ones(4, 3, dtype=torch.bool)),
         ValueError, r"must have its projection input's shape \(3, 4\)"),
        (lambda: lora_qkv(torch.ones(3, 4), _GOOD, _bad(weight=torch.ones(6, 5)), _GOOD), ValueError,
         r"k.weight must have shape \(out, 4\)"),
        (lambda: lora_qkv(torch.ones(3, 4), _GOOD, _GOOD, _GOOD, dropout_masks=(None, None)), TypeError,
         r"dropout_masks must be None or a tuple of 3 bool masks \(q, k, v\)"),
        (lambda: lora_mlp(torch.ones(3, 4), _GOOD, _GOOD, _GOOD, activation="relu"), ValueError,
         r"activation must be one of \('silu', 'gelu', 'gelu_tanh'\)"),
        (lambda: lora_mlp(torch.ones(3, 4), _GOOD, _bad(weight=torch.ones(5, 4), lora_b=torch.ones(5, 2)),
                          _bad(weight=torch.ones(4, 6), lora_a=torch.ones(2, 6), lora_b=torch.ones(4, 2))),
         ValueError, r"up.weight must have gate.weight's shape \(6, 4\)"),
        (lambda: lora_mlp(torch.ones(3, 4), _GOOD, _GOOD, _GOOD), ValueError,
         r"down.weight must have shape \(out, 6\)"),
        (lambda: lora_mlp(torch.ones(3, 4), _GOOD, _GOOD,
                          _bad(weight=torch.ones(4, 6), lora_a=torch.ones(2, 6), lora_b=torch.ones(4, 2)),
                          dropout_p=0.5, dropout_masks=(None, None, torch.ones(3, 4, dtype=torch.bool))),
         ValueError, r"dropout_masks\[down\] must have its projection input's shape \(3, 6\)"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- torch.compile (the ops' CPU branch) --------------------------------------------------------


class _Block(torch.nn.Module):
    """Attention projections and an MLP through the fused ops (no attention itself: not what is tested)."""

    SHAPES: ClassVar[dict[str, tuple[int, int]]] = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (KV, HIDDEN),
              "gate": (HIDDEN, INTERMEDIATE), "up": (HIDDEN, INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN)}  # fmt: skip

    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.dropout_p = dropout_p
        for name, (i, o) in self.SHAPES.items():
            self.register_buffer(f"{name}_weight", torch.randn(o, i, device=DEVICE) / i**0.5)
            setattr(self, f"{name}_a", torch.nn.Parameter(torch.randn(RANK, i, device=DEVICE) / i**0.5))
            setattr(self, f"{name}_b", torch.nn.Parameter(torch.randn(o, RANK, device=DEVICE) / RANK**0.5))

    def proj(self, name: str) -> LoraProjection:
        return LoraProjection(
            getattr(self, f"{name}_weight"), getattr(self, f"{name}_a"), getattr(self, f"{name}_b"), 2.0
        )

    def forward(self, x: torch.Tensor, masks: tuple | None = None) -> torch.Tensor:
        qkv_masks, o_mask, mlp_masks = masks if masks is not None else (None, None, None)
        q, k, v = lora_qkv(x, self.proj("q"), self.proj("k"), self.proj("v"), dropout_p=self.dropout_p,
                           dropout_masks=qkv_masks)  # fmt: skip
        h = x + q + lora_linear(k * v, self.proj("o"), dropout_p=self.dropout_p, dropout_mask=o_mask)
        mlp = lora_mlp(h, self.proj("gate"), self.proj("up"), self.proj("down"), activation="silu",
                       dropout_p=self.dropout_p, dropout_masks=mlp_masks)  # fmt: skip
        return (h + mlp).float().pow(2).mean()


def _masks(x: torch.Tensor, p: float) -> tuple:
    def keep(features: int) -> torch.Tensor:
        return torch.rand(*x.shape[:-1], features, device=DEVICE) >= p

    return (keep(HIDDEN), keep(HIDDEN), keep(HIDDEN)), keep(KV), (keep(HIDDEN), keep(HIDDEN), keep(INTERMEDIATE))


def _loss_and_grads(block: _Block, x: torch.Tensor, masks: tuple | None, f=None) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    loss = (block if f is None else f)(x, masks)
    return [loss.detach(), *torch.autograd.grad(loss, [x, *block.parameters()])]


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_fullgraph_compile_matches_eager(dropout_p, fresh_dynamo):
    """Given masks (the same on both sides) or none; loss and every gradient as in eager."""
    block = _Block(dropout_p)
    x = _x(torch.float32)
    masks = _masks(x, dropout_p) if dropout_p > 0 else None
    compiled = torch.compile(block, fullgraph=True)
    got = _loss_and_grads(block, x, masks, compiled)
    expected = _loss_and_grads(block, x, masks)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    for i, (g, e) in enumerate(zip(got, expected)):
        assert rel_err(g, e) < OUTPUT[torch.float32], (i, rel_err(g, e))


def test_fullgraph_compile_draws_dropout_masks(fresh_dynamo):
    """Masks drawn inside the compiled graph: no graph break, and each call draws new ones."""
    block = _Block(0.5)
    x = _x(torch.float32)
    compiled = torch.compile(block, fullgraph=True)
    first, second = (_loss_and_grads(block, x, None, compiled) for _ in range(2))
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    assert not torch.equal(first[0], second[0])
    assert all(torch.isfinite(t).all() for t in first + second)


def test_fastops_inductor_backend_matches_eager(fresh_dynamo):
    """Under our backend (which on CPU compiles each op's aten math with Inductor): no graph break, eager's
    loss and gradients."""
    block = _Block(0.25)
    x = _x(torch.float32)
    masks = _masks(x, 0.25)
    got = _loss_and_grads(block, x, masks, torch.compile(block, backend="fastops_inductor", fullgraph=True))
    expected = _loss_and_grads(block, x, masks)
    assert sum(counters["graph_break"].values()) == 0
    for i, (g, e) in enumerate(zip(got, expected)):
        assert rel_err(g, e) < OUTPUT[torch.float32], (i, rel_err(g, e))

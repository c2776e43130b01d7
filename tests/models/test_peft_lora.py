"""inductor_ext.models.apply on PEFT LoRA models (CPU; the fused LoRA ops' eager path, the GLU kernels
under the Triton interpreter): the LoRA layers run lora_linear, the MLPs lora_mlp, the loss and the
adapter gradients are PEFT's, training converges with the unpatched model, and what cannot be fused
is named."""

import copy
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.models import PatchWarning
from inductor_ext.ops.lora import LoraProjection, lora_linear
from tests.models.test_patch import COMMON, _batches, tiny_model, train_losses

peft = pytest.importorskip("peft")

LAYERS = COMMON["num_hidden_layers"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]
"""Every linear layer of the families (Phi-3 packs q/k/v and gate/up)."""
PROJECTIONS_PER_LAYER = {"phi3": 4}  # qkv_proj, o_proj, gate_up_proj, down_proj; 7 elsewhere


def lora_model(model_type: str, dropout: float = 0.0, targets: list[str] = ALL_LINEAR, **config) -> torch.nn.Module:
    """A tiny family model with rank-4 LoRA adapters; B random, not PEFT's zeros (which would give A no gradient)."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, **config)
    wrapped = peft.get_peft_model(tiny_model(model_type), lora)
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return wrapped


def _adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "phi3"])
def test_fused_lora_gives_peft_loss_and_adapter_gradients(model_type):
    """fp32, no dropout: the fused ops differ from PEFT's layers by GEMM rounding only."""
    model = lora_model(model_type)
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = models.apply(model)
    messages = [str(w.message) for w in caught if issubclass(w.category, PatchWarning)]
    assert len(report.lora) == PROJECTIONS_PER_LAYER.get(model_type, 7) * LAYERS
    if model_type == "phi3":  # lora_mlp takes separate gate and up projections
        assert report.lora_mlps == [] and len(messages) == LAYERS
        assert all("packed gate_up_proj is not a lora_mlp input" in m for m in messages)
    else:
        assert report.lora_mlps == [f"model.layers.{i}.mlp" for i in range(LAYERS)] and not messages
    ours = model(input_ids=ids, labels=ids).loss
    ours.backward()
    theirs = reference(input_ids=ids, labels=ids).loss
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    grads, expected = _adapter_grads(model), _adapter_grads(reference)
    assert list(grads) == list(expected) and all("lora_" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    models.unapply(model)


def test_dropout_eval_is_deterministic_and_peft_training_draws_masks():
    """Dropout 0.1: evaluation applies none (equal to PEFT, call after call); training draws masks
    (two calls differ) and gives finite gradients to the adapters only."""
    model = lora_model("llama", dropout=0.1)
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    with models.patched(model) as report:
        assert len(report.lora) == 7 * LAYERS and len(report.lora_mlps) == LAYERS
        model.eval()
        reference.eval()
        with torch.no_grad():
            first, second = (model(input_ids=ids, labels=ids).loss for _ in range(2))
            expected = reference(input_ids=ids, labels=ids).loss
        assert torch.equal(first, second)
        torch.testing.assert_close(first, expected, rtol=1e-6, atol=1e-6)

        model.train()
        losses = [model(input_ids=ids, labels=ids).loss for _ in range(2)]
        assert losses[0].item() != losses[1].item()
        losses[0].backward()
    for name, p in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name


def test_lora_training_converges_with_the_unpatched_peft_model():
    """20 fp32 AdamW steps on the adapters (lr 5e-3, two batches in turn, so the adapters can fit them).
    As tests/models/test_patch.py: the fused ops differ from PEFT's unfused layers by rounding only
    (≈1e-7 relative per op), so the losses stay within 1e-5 of each other at every step and each
    adapter's difference under 1% of how far training moved it."""
    reference = lora_model("llama")
    model = copy.deepcopy(reference)
    initial = {name: p.detach().clone() for name, p in reference.named_parameters() if p.requires_grad}
    data = _batches(2, seq=8) * 10

    with models.patched(model) as report:
        assert len(report.lora_mlps) == LAYERS
        actual = train_losses(model, data, lr=5e-3)
    expected = train_losses(reference, data, lr=5e-3)
    assert expected[-1] < 0.95 * expected[0]  # the adapters fit the batches
    for step, (a, b) in enumerate(zip(actual, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if p.requires_grad:
            moved = (q - initial[name]).norm().item()
            assert (p - q).norm().item() <= 1e-2 * moved + 1e-9, name


def test_patched_peft_training_step_compiles_with_no_graph_break():
    model = lora_model("llama", dropout=0.1)
    ids = _batches(1)[0]
    with models.patched(model):
        model.eval()
        with torch.no_grad():
            expected = model(input_ids=ids, labels=ids).loss
        model.train()
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        model.eval()
        with torch.no_grad():
            evaluated = compiled(input_ids=ids, labels=ids).loss
    assert not counters["graph_break"]
    assert all(torch.isfinite(g).all() for g in _adapter_grads(model).values())
    torch.testing.assert_close(evaluated, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("setup", "module", "reason"),
    [
        ({"use_dora": True}, r"model\.layers\.0\.self_attn\.q_proj", "DoRA"),
        ({"lora_bias": True}, r"model\.layers\.0\.mlp\.down_proj", "a bias on lora_B"),
        ({"merged": True}, r"model\.layers\.1\.self_attn\.o_proj", "merged into the base weight"),
        ({"targets": ["embed_tokens", "q_proj"]}, r"model\.embed_tokens", "Embedding is not PEFT's lora.Linear"),
    ],
)
def test_what_cannot_be_fused_is_left_to_peft_and_named(setup, module, reason):
    setup = dict(setup)
    merged = setup.pop("merged", False)
    model = lora_model("llama", **setup)
    if merged:
        model.merge_adapter()
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    with pytest.warns(PatchWarning, match=rf"{module}: .*{reason}.*left as PEFT's"):
        report = models.apply(model)
    assert module.replace("\\", "") in report.skipped
    assert not any(name.replace("\\", "") == module.replace("\\", "") for name in report.lora)
    assert "forward" not in vars(model.get_submodule("base_model.model." + module.replace("\\", "")))
    torch.testing.assert_close(
        model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6
    )
    models.unapply(model)


def test_mlp_with_some_projections_wrapped_runs_them_one_by_one():
    model = lora_model("llama", targets=["gate_proj", "down_proj"])
    with pytest.warns(PatchWarning, match=r"model\.layers\.0\.mlp: not one lora_mlp \(up_proj without LoRA\)"):
        report = models.apply(model)
    assert report.lora_mlps == [] and len(report.lora) == 2 * LAYERS
    models.unapply(model)


def test_mlp_with_an_activation_lora_mlp_does_not_fuse_runs_its_projections_one_by_one():
    model = peft.get_peft_model(tiny_model("llama", hidden_act="relu"), peft.LoraConfig(r=4, target_modules=ALL_LINEAR))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    with pytest.warns(PatchWarning, match=r"model\.layers\.0\.mlp: not one lora_mlp \(activation 'relu'"):
        report = models.apply(model)
    assert report.lora_mlps == [] and len(report.lora) == 7 * LAYERS
    torch.testing.assert_close(
        model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss, rtol=1e-6, atol=1e-6
    )
    models.unapply(model)


def test_an_mlp_whose_layer_no_longer_fits_runs_its_own_forward(monkeypatch):
    """After ``apply``, one projection's adapter is merged: the MLP runs its class's forward, the other two
    projections their fused ``lora_linear``, the merged one PEFT's; the loss and gradients are PEFT's."""
    from inductor_ext.models import peft_lora

    calls: list[str] = []

    def counting(op: str, real):
        def counted(*args, **kwargs):
            calls.append(op)
            return real(*args, **kwargs)

        return counted

    for op in ("lora_mlp", "lora_linear"):
        monkeypatch.setattr(peft_lora, op, counting(op, getattr(peft_lora, op)))
    model = lora_model("llama")
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    with models.patched(model) as report:
        assert len(report.lora_mlps) == LAYERS
        for mlp in (layer.mlp for m in (model, reference) for layer in m.base_model.model.model.layers):
            mlp.up_proj.merge()
        ours = model(input_ids=ids, labels=ids).loss
        ours.backward()
    assert calls == ["lora_linear"] * 6 * LAYERS  # q, k, v, o, gate and down
    theirs = reference(input_ids=ids, labels=ids).loss
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    grads, expected = _adapter_grads(model), _adapter_grads(reference)
    assert list(grads) == list(expected)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_disabled_adapters_and_the_lora_switch_run_peft():
    model = lora_model("llama")
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    # the layers' state is read at each call
    with models.patched(model), model.disable_adapter(), reference.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchWarning)
        with models.patched(model, lora=False) as report:
            assert report.lora == [] and report.lora_mlps == [] and report.loss
            assert not any("_fastops_adapter" in vars(m) for m in model.modules())


def test_unapply_restores_peft_forwards():
    model = lora_model("llama").eval()
    ids = _batches(1)[0]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with models.patched(model) as report:
            assert report.lora
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert not any(attribute.startswith(("forward", "_fastops_")) for m in model.modules() for attribute in vars(m))


@pytest.mark.parametrize("lora_dtype", ["adapters", "input"])
def test_lora_dtype_picks_the_low_rank_gemms_dtype_of_float32_adapters(lora_dtype):
    """PEFT's default over a bf16 model: float32 adapters. ``"adapters"`` runs the low-rank GEMMs in
    float32 (PEFT's numerics), ``"input"`` in bf16 (the adapters cast per call); gradients reach the
    float32 adapters either way."""
    model = peft.get_peft_model(tiny_model("llama").to(torch.bfloat16), peft.LoraConfig(r=4, target_modules=["o_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.o_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.nn.init.normal_(b, std=0.02)
    assert a.dtype == b.dtype == torch.float32
    x = torch.randn(2, 5, COMMON["hidden_size"]).to(torch.bfloat16)
    cast = lora_dtype == "input"
    projection = LoraProjection(
        layer.base_layer.weight, a.bfloat16() if cast else a, b.bfloat16() if cast else b, layer.scaling["default"]
    )
    expected = lora_linear(x, projection)
    with models.patched(model, lora_dtype=lora_dtype):
        y = layer(x)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        y.float().square().sum().backward()
    assert a.grad is not None and a.grad.dtype == b.grad.dtype == torch.float32


def test_bad_lora_dtype_is_named():
    with pytest.raises(ValueError, match=r"lora_dtype must be one of \('adapters', 'input'\), got 'bf16'"):
        models.apply(lora_model("llama"), lora_dtype="bf16")

"""inductor_ext.models.apply on a QLoRA model: transformers' 4-bit loading (bitsandbytes NF4, double
quantisation) wrapped by PEFT, on CPU. Every LoRA layer runs the fused ops over its 4-bit base, the loss
and adapter gradients are PEFT's, the state dict, saved adapters and ``merge_and_unload`` are untouched,
and ``torch.compile`` traces the patched model whole."""

import copy
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.models import PatchWarning
from tests.models.test_patch import COMMON, _batches, tiny_model

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

LAYERS = COMMON["num_hidden_layers"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama saved once (its linear layers' inputs are whole blocks of 64: bitsandbytes' CPU
    dequantisation is wrong otherwise, see tests/ops/test_lora_nf4.py)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def qlora_model(checkpoint: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """What a QLoRA user builds: the checkpoint loaded in NF4 with double quantisation, computing in
    ``dtype``, and PEFT LoRA adapters (rank 4, B random so that A gets gradients, adapters float32)."""
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=quantization, device_map="cpu", dtype=dtype
    )
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model.train()


def _adapter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def test_every_4bit_lora_layer_runs_fused_with_peft_loss_and_gradients(checkpoint):
    model = qlora_model(checkpoint)
    reference = copy.deepcopy(model)
    assert type(model.base_model.model.model.layers[0].mlp.gate_proj.base_layer) is bnb.nn.Linear4bit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = models.apply(model)
    assert not [w for w in caught if issubclass(w.category, PatchWarning)]
    assert len(report.lora) == 7 * LAYERS
    assert report.lora_mlps == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    ids = _batches(1)[0]
    ours = model(input_ids=ids, labels=ids).loss
    ours.backward()
    theirs = reference(input_ids=ids, labels=ids).loss
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    grads, expected = _adapter_grads(model), _adapter_grads(reference)
    assert list(grads) == list(expected) and len(grads) == 2 * 7 * LAYERS
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    models.unapply(model)


def test_state_dict_saved_adapters_and_merge_are_untouched(checkpoint, tmp_path):
    model = qlora_model(checkpoint)
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("weight.absmax") for k in before)  # bitsandbytes' quantisation state
    with models.patched(model) as report:
        assert len(report.lora) == 7 * LAYERS
        after = model.state_dict()
        assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
        model.save_pretrained(tmp_path / "patched")
    reference.save_pretrained(tmp_path / "reference")
    saved = peft.utils.load_peft_weights(str(tmp_path / "patched"))
    expected = peft.utils.load_peft_weights(str(tmp_path / "reference"))
    assert list(saved) == list(expected) and all(torch.equal(saved[k], expected[k]) for k in expected)
    ids = _batches(1)[0]
    merged, merged_reference = model.merge_and_unload(), reference.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, merged_reference(input_ids=ids).logits, rtol=0, atol=0)


def test_patched_qlora_step_compiles_whole_under_fastops_inductor(checkpoint, fresh_dynamo):
    model = qlora_model(checkpoint)
    reference = copy.deepcopy(model)
    ids = _batches(1)[0]
    with models.patched(model):
        compiled = torch.compile(model, backend="fastops_inductor", fullgraph=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    assert not counters["graph_break"]
    expected = reference(input_ids=ids, labels=ids).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    grads, reference_grads = _adapter_grads(model), _adapter_grads(reference)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-3, atol=1e-5, msg=name)


def test_a_base_in_another_compute_dtype_runs_peft(checkpoint):
    """bitsandbytes casts the input to the base's compute dtype and back: the fused op would not; the
    layer's own forward runs (the same call, PEFT's result)."""
    model = qlora_model(checkpoint)
    layer = model.base_model.model.model.layers[0].self_attn.o_proj
    layer.base_layer.compute_dtype = torch.bfloat16
    reference = copy.deepcopy(model)
    x = torch.randn(3, COMMON["hidden_size"])
    with models.patched(model) as report:
        assert "model.layers.0.self_attn.o_proj" in report.lora
        torch.testing.assert_close(layer(x), reference.base_model.model.model.layers[0].self_attn.o_proj(x))

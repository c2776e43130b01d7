"""Packed documents on CUDA: transformers' document mask becomes FlexAttention on a block mask under
``fastops_inductor``; loss and gradients within bf16 noise of eager HF for the same call, one graph for
every packing, and the attention op against a float64 reference as close as bf16 SDPA is."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_ext
from inductor_ext.bench.train import build_model
from inductor_ext.ops.document_attention import document_causal_attention, document_causal_mask_ref
from tests.packed_positions import random_packed_positions
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")


def _positions(batch: int, length: int, seed: int) -> torch.Tensor:
    return random_packed_positions(batch, length, torch.Generator().manual_seed(seed), longest=300).cuda()


def _step(model, **kwargs):
    model.zero_grad(set_to_none=True)
    output = model(**kwargs)
    output.loss.backward()
    return output.loss.detach().double(), [p.grad.double() for p in model.parameters()]


def _packed_call(vocab: int, length: int, seed: int) -> dict:
    """A training call on two packed rows, documents separated (``use_cache=False``)."""
    positions = torch.cat([_positions(1, length, 2 * seed + row) for row in range(2)])
    ids = torch.randint(0, vocab, positions.shape, device="cuda")
    return {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}


def _assert_within_noise(ours: tuple, baseline: tuple, reference: tuple) -> None:
    """``ours`` (loss, gradients) at most twice as far from ``reference`` as ``baseline`` is, plus 1%."""
    (loss, grads), (base_loss, base_grads), (ref_loss, ref_grads) = ours, baseline, reference
    assert abs(loss - ref_loss) <= 2 * abs(base_loss - ref_loss) + 1e-2 * abs(ref_loss)
    for got, base, want in zip(grads, base_grads, ref_grads, strict=True):
        assert rel_err(got, want) <= 2 * rel_err(base, want) + 1e-2


def test_packed_training_step_runs_flex_attention_as_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    model = build_model("tiny-llama", "cuda", torch.bfloat16)
    stock = torch.compile(model, backend="inductor", fullgraph=True)
    ours = torch.compile(model, backend="fastops_inductor", fullgraph=True)
    for seed in range(5):
        kwargs = _packed_call(model.config.vocab_size, 1000, seed)
        eager = _step(model, **kwargs)
        _assert_within_noise(_step(ours, **kwargs), _step(stock, **kwargs), eager)
    assert counters["inductor_ext"]["rewrite_document_mask"] == model.config.num_hidden_layers
    assert not counters["recompiles"]


def test_patched_model_on_packed_rows_is_rewritten_as_hf(tmp_path, monkeypatch):
    """A model patched by ``models.apply`` (the fused loss) on two packed rows: eager it runs transformers'
    masked SDPA; under the backend the document mask is rewritten in every layer, as for the unpatched
    model; each within bf16 noise of transformers'."""
    from inductor_ext import models

    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    reference = build_model("tiny-llama", "cuda", torch.bfloat16)
    exact = build_model("tiny-llama", "cuda", torch.float32)
    exact.load_state_dict(reference.state_dict())
    patched = build_model("tiny-llama", "cuda", torch.bfloat16)
    patched.load_state_dict(reference.state_dict())
    assert models.apply(patched).loss
    compiled = torch.compile(patched, backend="fastops_inductor", fullgraph=True)
    for seed in range(2):
        kwargs = _packed_call(reference.config.vocab_size, 1024, seed)
        exact_result, hf_result = _step(exact, **kwargs), _step(reference, **kwargs)
        for model in (patched, compiled):
            _assert_within_noise(_step(model, **kwargs), hf_result, exact_result)
    assert counters["inductor_ext"]["rewrite_document_mask"] == reference.config.num_hidden_layers
    assert not counters["recompiles"]


@pytest.mark.parametrize(("batch", "length"), [(2, 777), (4, 512), (1, 4096)])
def test_document_attention_matches_float64(batch, length):
    positions = torch.cat([_positions(1, length, seed) for seed in range(batch)])
    q = torch.randn(batch, 8, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, 2, length, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    grad = torch.randn_like(q)
    out = document_causal_attention(q, k, v, positions, enable_gqa=True)
    got = torch.autograd.grad(out, (q, k, v), grad)
    mask = document_causal_mask_ref(positions)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, attn_mask=mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, exact, grad.double())
    plain = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*plain, attn_mask=mask, enable_gqa=True)
    sdpa_grads = torch.autograd.grad(sdpa, plain, grad)
    assert rel_err(out, ref) <= 2 * rel_err(sdpa, ref) + 1e-3
    for ours, bf16, exact_grad in zip(got, sdpa_grads, ref_grads, strict=True):
        assert rel_err(ours, exact_grad) <= 2 * rel_err(bf16, exact_grad) + 1e-3


def test_exported_packed_model_gives_hf_logits_for_other_packings(tmp_path, monkeypatch):
    """``inductor_ext.export`` of packed rows on CUDA: the rewrite fires, the exported (forward-only) graph
    keeps SDPA on the document mask (``flex_is_trusted``), and the package's logits for other packings of
    the row shape are within bf16 noise of eager HF's (float32 HF as the reference)."""
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    model = build_model("tiny-llama", "cuda", torch.bfloat16).eval()
    exact = build_model("tiny-llama", "cuda", torch.float32).eval()
    exact.load_state_dict(model.state_dict())
    call = _packed_call(model.config.vocab_size, 1000, seed=0)
    ids, kwargs = call["input_ids"], {"position_ids": call["position_ids"], "use_cache": False}
    package = inductor_ext.load(inductor_ext.export(model, (ids,), tmp_path / "packed.pt2", kwargs=kwargs))
    assert counters["inductor_ext"]["rewrite_document_mask"] == model.config.num_hidden_layers
    for seed in range(1, 4):
        kwargs["position_ids"] = _packed_call(model.config.vocab_size, 1000, seed)["position_ids"]
        with torch.no_grad():
            want, hf = (m(ids, **kwargs).logits.double() for m in (exact, model))
        got = package(ids, **kwargs).logits
        assert rel_err(got, want) <= 2 * rel_err(hf, want) + 1e-3


def test_forward_only_document_attention_matches_float64():
    """No gradient (eval, export): the materialised mask, not FlexAttention (``flex_is_trusted``), at the
    4 x 2048 packing where compiled FlexAttention on our block tables was 81% off."""
    from inductor_ext.bench import packing

    positions = packing.packed_batches(1, 4, 2048, 2, seed=1)[0].position_ids.cuda()
    q = torch.randn(4, 2048, 32, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(4, 2048, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in "kv")
    with torch.no_grad():
        out = torch.compile(document_causal_attention, fullgraph=True)(q, k, v, positions, enable_gqa=True)
        mask = document_causal_mask_ref(positions)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert rel_err(out, ref) <= 2 * rel_err(bf16, ref) + 1e-3

"""Packed documents on CUDA: transformers' document mask becomes FlexAttention on a block mask under
``fastops_inductor``; loss and gradients within bf16 noise of eager HF for the same call, one graph for
every packing, and the attention op against a float64 reference as close as bf16 SDPA is."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_ext  # noqa: F401
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


def test_packed_training_step_runs_flex_attention_as_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    model = build_model("tiny-llama", "cuda", torch.bfloat16)
    stock = torch.compile(model, backend="inductor", fullgraph=True)
    ours = torch.compile(model, backend="fastops_inductor", fullgraph=True)
    for seed in range(5):
        positions = torch.cat([_positions(1, 1000, 2 * seed + row) for row in range(2)])
        ids = torch.randint(0, model.config.vocab_size, positions.shape, device="cuda")
        kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}
        eager_loss, eager_grads = _step(model, **kwargs)
        stock_loss, stock_grads = _step(stock, **kwargs)
        ours_loss, ours_grads = _step(ours, **kwargs)
        assert abs(ours_loss - eager_loss) <= 2 * abs(stock_loss - eager_loss) + 1e-2 * abs(eager_loss)
        for got, base, eager in zip(ours_grads, stock_grads, eager_grads, strict=True):
            assert rel_err(got, eager) <= 2 * rel_err(base, eager) + 1e-2
    assert counters["inductor_ext"]["rewrite_document_mask"] == model.config.num_hidden_layers
    assert not counters["recompiles"]


def test_patched_model_on_packed_rows_runs_document_attention_as_hf(tmp_path, monkeypatch):
    """``models.apply``'s attention on two packed rows: eager (compiled FlexAttention) and under the
    backend (Dynamo traces FlexAttention), each within bf16 noise of transformers' masked SDPA."""
    from inductor_ext import models

    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    reference = build_model("tiny-llama", "cuda", torch.bfloat16)
    exact = build_model("tiny-llama", "cuda", torch.float32)
    exact.load_state_dict(reference.state_dict())
    patched = build_model("tiny-llama", "cuda", torch.bfloat16)
    patched.load_state_dict(reference.state_dict())
    assert models.apply(patched).attention
    compiled = torch.compile(patched, backend="fastops_inductor", fullgraph=True)
    for seed in range(2):
        positions = torch.cat([_positions(1, 1024, 2 * seed + row) for row in range(2)])
        ids = torch.randint(0, reference.config.vocab_size, positions.shape, device="cuda")
        kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}
        exact_loss, exact_grads = _step(exact, **kwargs)
        hf_loss, hf_grads = _step(reference, **kwargs)
        for model in (patched, compiled):
            loss, grads = _step(model, **kwargs)
            assert abs(loss - exact_loss) <= 2 * abs(hf_loss - exact_loss) + 1e-2 * abs(exact_loss)
            for got, base, want in zip(grads, hf_grads, exact_grads, strict=True):
                assert rel_err(got, want) <= 2 * rel_err(base, want) + 1e-2


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

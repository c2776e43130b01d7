"""The causal-mask rewrite on CUDA: transformers materialises its causal mask under Dynamo there
(torch < 2.14), and ``fastops_inductor`` turns it back into ``is_causal=True`` with grouped key/value
heads, as eager HF calls SDPA; loss and gradients stay within bf16 noise of eager."""

import pytest
import torch
from torch._dynamo.utils import counters

import inductor_ext  # noqa: F401
from inductor_ext.bench.train import build_model
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")


def _loss_and_grads(model, ids, **compile_args):
    forward = torch.compile(model, fullgraph=True, **compile_args) if compile_args else model
    loss = forward(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return loss.detach(), grads


def test_hf_llama_training_step_runs_causal_sdpa(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    model = build_model("tiny-llama", "cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda")
    eager_loss, eager_grads = _loss_and_grads(model, ids)
    stock_loss, stock_grads = _loss_and_grads(model, ids, backend="inductor")
    ours_loss, ours_grads = _loss_and_grads(model, ids, backend="fastops_inductor")

    assert counters["inductor_ext"]["rewrite_causal_mask"] == model.config.num_hidden_layers
    assert abs(ours_loss - eager_loss) <= 2 * abs(stock_loss - eager_loss) + 1e-2 * abs(eager_loss)
    for ours, stock, eager in zip(ours_grads, stock_grads, eager_grads):
        assert rel_err(ours, eager.double()) <= 2 * rel_err(stock, eager.double()) + 1e-2

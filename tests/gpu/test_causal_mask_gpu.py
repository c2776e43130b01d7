"""The causal-mask rewrite on CUDA: transformers materialises its causal mask under Dynamo there
(torch < 2.14), and ``fastops_inductor`` turns it back into ``is_causal=True`` with grouped key/value
heads, as eager HF calls SDPA; loss and gradients stay within bf16 noise of eager."""

import pytest
import torch
from torch._dynamo.utils import counters

import inductor_ext  # noqa: F401
from inductor_ext.bench.train import build_model
from tests.gpu.compile_checks import lm_step
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")


def test_hf_llama_training_step_runs_causal_sdpa(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    model = build_model("tiny-llama", "cuda", torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), device="cuda")
    eager, eager_grads = lm_step(model, ids)
    stock, stock_grads = lm_step(model, ids, backend="inductor")
    ours, ours_grads = lm_step(model, ids, backend="fastops_inductor")
    eager_loss, stock_loss, ours_loss = eager.loss.detach(), stock.loss.detach(), ours.loss.detach()

    assert counters["inductor_ext"]["rewrite_causal_mask"] == model.config.num_hidden_layers
    assert abs(ours_loss - eager_loss) <= 2 * abs(stock_loss - eager_loss) + 1e-2 * abs(eager_loss)
    for ours, stock, eager in zip(ours_grads, stock_grads, eager_grads):
        assert rel_err(ours, eager.double()) <= 2 * rel_err(stock, eager.double()) + 1e-2

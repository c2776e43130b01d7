"""inductor_ext.models.apply on CUDA in bf16: a patched HF model's loss and gradients stay within the
bf16 noise of HF eager (as close as torch.compile of the unpatched model is), eagerly and under
fastops_inductor, in both weight-gradient memory modes."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.bench.train import build_model
from tests.gpu.compile_checks import lm_step
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("transformers")


@pytest.mark.parametrize("accumulation", ["fp32", "weight_dtype"])
@pytest.mark.parametrize("backend", [None, "fastops_inductor"])
def test_patched_llama_matches_eager_within_compile_noise(tmp_path, monkeypatch, accumulation, backend):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
    reference = build_model("tiny-llama", "cuda", torch.bfloat16)
    ids = torch.randint(0, reference.config.vocab_size, (2, 512), device="cuda")
    eager, eager_grads = lm_step(reference, ids)
    stock, stock_grads = lm_step(reference, ids, backend="inductor")  # torch.compile's own noise

    model = copy.deepcopy(reference)
    with models.patched(model, weight_grad_accumulation=accumulation):
        ours, ours_grads = lm_step(model, ids, **({"backend": backend} if backend else {}))
    assert ours.logits is None
    assert not counters["graph_break"]
    noise = abs(stock.loss - eager.loss).item()
    assert abs(ours.loss - eager.loss).item() <= 2 * noise + 1e-2 * abs(eager.loss).item()
    for name, mine, theirs, truth in zip(
        (n for n, _ in model.named_parameters()), ours_grads, stock_grads, eager_grads
    ):
        assert rel_err(mine, truth.double()) <= 2 * rel_err(theirs, truth.double()) + 2e-2, name

"""``fastops.recompute_norms`` and ``fastops.recompute_glu`` on CUDA, on our kernel route (a Triton kernel's node
recomputed by torch's partitioner; the Inductor route's aten math is checked on CPU): a patched Llama-shaped
model saves exactly the recomputed outputs less, the compiled step's peak falls by about that much (the
backward recomputes one output at a time, just before its projection reads it), and the gradients are those
of the step that saves them, to the bit."""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

import inductor_ext  # noqa: F401
from inductor_ext import models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, LAYERS, BATCH, SEQ = 1024, 4, 2, 2048


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(scope="module")
def patched_llama():
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=4 * H, num_hidden_layers=LAYERS, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=SEQ, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()
    with models.patched(model):  # unapplied after the module's tests: the RoPE patch is process-wide
        yield model


def _step(model, ids, norms: bool, glu: bool = False):
    """Saved bytes, peak bytes above the step's start, loss and gradients of the second compiled step."""
    torch._dynamo.reset()
    options = {"fastops.route": "kernel", "fastops.recompute_norms": norms, "fastops.recompute_glu": glu}
    compiled = torch.compile(model, backend="fastops_inductor", options=options)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        saved.clear()
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return sum(saved), peak, loss.detach(), grads


@pytest.mark.parametrize("glu", [False, True])
def test_outputs_are_recomputed_not_saved(patched_llama, glu):
    model = patched_llama
    ids = torch.randint(0, 32000, (BATCH, SEQ), device="cuda")
    kept_bytes, kept_peak, kept_loss, kept_grads = _step(model, ids, norms=False)
    saved_bytes, peak, loss, grads = _step(model, ids, norms=True, glu=glu)
    tokens = BATCH * SEQ
    recomputed = 2 * LAYERS * (tokens * H * 2 + tokens * 4)  # y (bf16) and rstd (fp32) of two norms a layer
    if glu:
        recomputed += LAYERS * tokens * 4 * H * 2  # the GLU's output (bf16)
    assert kept_bytes - saved_bytes == recomputed
    assert kept_peak - peak >= 0.9 * recomputed, (kept_peak, peak, recomputed)
    assert torch.equal(loss, kept_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name

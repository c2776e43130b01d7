"""``fastops.recompute_norms`` on CPU: which norm calls are marked, what the compiled training step then
saves for the backward (exactly the norm outputs less), and that its gradients are unchanged to the bit."""

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import transformers

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext import models
from inductor_ext.inductor import backend
from inductor_ext.inductor.graph_queries import is_call
from inductor_ext.inductor.options import parse_options
from inductor_ext.inductor.recompute import RECOMPUTED_NORMS
from tests.hf_spellings import LlamaRMSNorm

H, TOKENS, LAYERS = 64, 32, 2


@pytest.fixture(autouse=True)
def _fresh_compiles():
    """Every compile traced and partitioned (no FX-graph or AOTAutograd cache hit)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def test_option_defaults_on_and_is_set_by_option_or_environment():
    assert parse_options(None, env={})[0].recompute_norms is True
    assert parse_options({"fastops.recompute_norms": False}, env={})[0].recompute_norms is False
    assert parse_options(None, env={"INDUCTOR_EXT_RECOMPUTE_NORMS": "0"})[0].recompute_norms is False


class NormsBlock(torch.nn.Module):
    """A pre-norm projection (its norm output feeds a matmul: marked) and a per-head-style norm whose output
    feeds only an elementwise op (as Qwen3's q/k norms feed RoPE: not marked)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head_norm = LlamaRMSNorm(H), LlamaRMSNorm(H)
        self.proj = torch.nn.Linear(H, H, bias=False)

    def forward(self, x):
        return torch.sin(self.head_norm(self.proj(self.norm(x))))


def test_only_norms_whose_output_reaches_a_matmul_are_marked(monkeypatch):
    marked, mark = [], backend.mark_norm_recompute

    def spy(gm):
        count = mark(gm)
        norms = [n for n in gm.graph.nodes if is_call(n, RECOMPUTED_NORMS)]
        marked.append((count, [n.meta.get("recompute") is not None for n in norms]))
        return count

    monkeypatch.setattr(backend, "mark_norm_recompute", spy)
    torch.manual_seed(0)
    block = NormsBlock()
    x = torch.randn(TOKENS, H, requires_grad=True)
    torch.compile(block, backend="fastops_inductor", fullgraph=True)(x).sum().backward()
    # both HF norms were rewritten into our op; the first (feeding the Linear) is marked, the second is not
    assert marked == [(1, [True, False])]


def _saved_bytes_and_grads(model, ids, recompute: bool):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fastops_inductor", options={"fastops.recompute_norms": recompute})
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return sum(saved), loss.detach(), grads


def test_patched_llama_saves_no_norm_output_and_gets_the_same_gradients():
    """Each decoder layer's two norms feed projections: with the option their outputs (``TOKENS x H`` bf16)
    and their rstd (``TOKENS`` fp32) are recomputed in the backward instead of saved; the final norm feeds
    the fused loss, which saves its gradients rather than its input, so it stays as it was. The recompute
    runs the same kernel on the same input, so the gradients are equal to the bit."""
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=4 * H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    models.apply(model)
    ids = torch.randint(0, 256, (2, TOKENS // 2))
    kept_bytes, kept_loss, kept_grads = _saved_bytes_and_grads(model, ids, recompute=False)
    recomputed_bytes, loss, grads = _saved_bytes_and_grads(model, ids, recompute=True)
    per_norm = TOKENS * H * 2 + TOKENS * 4
    assert kept_bytes - recomputed_bytes == 2 * LAYERS * per_norm
    assert torch.equal(loss, kept_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name

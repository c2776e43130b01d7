"""``fastops.recompute_norms`` on CPU: which norm calls are marked, what the compiled training step then
saves for the backward (exactly the norm outputs less), and that its gradients are unchanged to the bit."""

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import transformers

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext import models
from inductor_ext.inductor import passes
from inductor_ext.inductor.graph_queries import is_call, value
from inductor_ext.inductor.options import parse_options
from inductor_ext.inductor.recompute_norms import NORM_FORWARDS, RECOMPUTABLE_OUTPUT
from tests.hf_spellings import LlamaRMSNorm

H, TOKENS, LAYERS = 64, 32, 2


pytestmark = pytest.mark.usefixtures("fresh_compiles")


def test_option_defaults_on_and_is_set_by_option_or_environment():
    assert parse_options(None, env={})[0].runs("recompute_norms")
    assert not parse_options({"fastops.recompute_norms": False}, env={})[0].runs("recompute_norms")
    assert not parse_options(None, env={"INDUCTOR_EXT_RECOMPUTE_NORMS": "0"})[0].runs("recompute_norms")


class NormsBlock(torch.nn.Module):
    """Four HF norms, rewritten into our op: one feeding a projection (marked), one feeding only an elementwise
    op (as Qwen3's q/k norms feed RoPE: not marked), one feeding a projection through a cast that keeps the
    dtype (marked) and one through a cast to bf16, whose result the projection saves instead (not marked)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head_norm, self.kept_norm, self.cast_norm = (LlamaRMSNorm(H) for _ in range(4))
        self.proj = torch.nn.Linear(H, H, bias=False)
        self.weight16 = torch.nn.Parameter(torch.randn(H, H, dtype=torch.bfloat16))

    def forward(self, x):
        h = self.proj(self.norm(x))
        kept = self.proj(self.kept_norm(h).to(h.dtype))
        cast = torch.nn.functional.linear(self.cast_norm(h).bfloat16(), self.weight16)
        return torch.sin(self.head_norm(h)).sum() + kept.sum() + cast.float().sum()


def test_only_norms_whose_output_reaches_a_matmul_are_marked(monkeypatch):
    marked, mark = [], passes.mark_recompute

    def spy(gm, forwards):
        count = mark(gm, forwards)
        norms = [n for n in gm.graph.nodes if is_call(n, NORM_FORWARDS)]
        marked.append((count, [n.meta.get("recompute") is not None for n in norms]))
        return count

    monkeypatch.setattr(passes, "mark_recompute", spy)
    torch.manual_seed(0)
    block = NormsBlock()
    x = torch.randn(TOKENS, H, requires_grad=True)
    torch.compile(block, backend="fastops_inductor", fullgraph=True)(x).backward()
    # graph order: norm, kept_norm, cast_norm, head_norm (the sin is taken last)
    assert marked == [(2, [True, True, False, False])]


def _output_bytes(node: torch.fx.Node) -> int:
    """Bytes of a call's outputs (a norm's ``y`` and ``rstd``, a GLU's output), from Dynamo's example values."""
    outputs = torch.utils._pytree.tree_leaves(value(node))
    return sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))


@contextlib.contextmanager
def marked_output_bytes() -> Iterator[dict[str, int]]:
    """Within, the bytes the backend marks for recomputation, by op name, summed over the graphs compiled:
    the outputs of the marked norm calls (``rms_norm_fwd``: ``y`` and ``rstd``), and the ``y`` of the
    ``add_rms_norm_fwd`` calls passed through the recomputable-output marker."""
    marked: dict[str, int] = {}
    mark, mark_fused = passes.mark_recompute, passes.mark_fused_norm_outputs

    def add(name: str, node: torch.fx.Node) -> None:
        marked[name] = marked.get(name, 0) + _output_bytes(node)

    def marking(gm, forwards):
        count = mark(gm, forwards)
        for node in gm.graph.nodes:
            if node.meta.get("recompute") is not None and is_call(node, forwards):
                add(node.target._opname, node)
        return count

    def marking_fused(gm):
        count = mark_fused(gm)
        for node in gm.graph.nodes:
            if is_call(node, (RECOMPUTABLE_OUTPUT,)):
                add("add_rms_norm_fwd", node)
        return count

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(passes, "mark_recompute", marking)
        patch.setattr(passes, "mark_fused_norm_outputs", marking_fused)
        yield marked


def _saved_bytes_and_grads(model, ids, norms: bool):
    """Bytes saved for the backward, the bytes of the outputs the backend marked for recomputation (by
    op), loss and gradients of one compiled training step."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch._dynamo.reset()
    options = {"fastops.recompute_norms": norms}
    compiled = torch.compile(model, backend="fastops_inductor", options=options)
    with marked_output_bytes() as marked, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return sum(saved), marked, loss.detach(), grads


@pytest.fixture(scope="module")
def patched_llama():
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=4 * H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()
    with models.patched(model):
        yield model, torch.randint(0, 256, (2, TOKENS // 2))


NORM_BYTES = TOKENS * H * 2 + TOKENS * 4
"""One norm's ``y`` (bf16) and ``rstd`` (fp32)."""
FUSED_NORM_BYTES = TOKENS * H * 2
"""One ``add_rms_norm``'s ``y`` (bf16): its ``rstd`` and ``h`` are saved for its own backward anyway."""


def test_patched_llama_saves_exactly_the_recomputed_outputs_less_with_the_same_gradients(patched_llama):
    """The backend rewrites the patched model's norms as an unpatched model's: the first layer's input norm
    (an ``rms_norm`` feeding the q/k/v projections) is marked for recomputation; the norms after residual
    adds become ``add_rms_norm``, and the outputs of those that feed projections (each layer's MLP norm and
    the second layer's input norm: three) are recomputed from their saved sum and ``rstd``; the final norm
    feeds the fused loss, no matrix product. The step saves exactly the marked bytes less. The recompute
    is the forward's own arithmetic on the same inputs, so loss and gradients are equal to the bit."""
    model, ids = patched_llama
    kept_bytes, kept_marked, kept_loss, kept_grads = _saved_bytes_and_grads(model, ids, norms=False)
    recomputed_bytes, marked, loss, grads = _saved_bytes_and_grads(model, ids, norms=True)
    assert kept_marked == {}
    assert marked == {"rms_norm_fwd": NORM_BYTES, "add_rms_norm_fwd": (2 * LAYERS - 1) * FUSED_NORM_BYTES}
    assert kept_bytes - recomputed_bytes == sum(marked.values())
    assert torch.equal(loss, kept_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name


def test_a_compile_without_backward_drops_the_markers(patched_llama):
    """Under ``no_grad`` AOTAutograd builds no joint graph: the post-grad stage removes the recomputable-output
    markers (each would otherwise copy its ``y``), and the logits are the eager model's."""
    model, ids = patched_llama
    resolved, resolve = [], passes.resolve_marked_outputs

    def spy(graph):
        resolved.append((resolve(graph), sum(is_call(node, (RECOMPUTABLE_OUTPUT,)) for node in graph.nodes)))
        return resolved[-1][0]

    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(passes, "resolve_marked_outputs", spy)
        compiled = torch.compile(model, backend="fastops_inductor")
        logits = compiled(input_ids=ids).logits
        want = model(input_ids=ids).logits
    assert sum(count for count, _ in resolved) == 2 * LAYERS - 1 and all(left == 0 for _, left in resolved)
    torch.testing.assert_close(logits, want, rtol=0.02, atol=0.02)


def test_the_recomputable_output_marker_passes_opcheck():
    """The marker is a real op: schema, fake tensor, autograd registration (its gradient passes to ``y``)."""
    y, x = torch.randn(6, H, requires_grad=True), torch.randn(6, H)
    rstd, weight = torch.rand(6) + 0.5, torch.randn(H)
    torch.library.opcheck(RECOMPUTABLE_OUTPUT, (y, x, rstd, weight, 0.0, "llama"))
    torch.library.opcheck(RECOMPUTABLE_OUTPUT, (y, x, rstd, None, 1.0, "gemma"))

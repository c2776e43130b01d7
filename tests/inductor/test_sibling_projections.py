"""``fastops.fuse_projections`` on CPU: which sibling ``linear`` calls become one product (a group with a
product narrower than its input, GQA's q/k/v; not gate/up or equal-width q/k/v), that the rewritten graph
gives the separate products' outputs and gradients, that the concatenated weights are recomputed in the
backward rather than saved, and that a Llama under the backend trains as before."""

import pytest
import torch
import transformers
from torch import nn

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext.inductor.graph_queries import LINEARS
from inductor_ext.inductor.options import parse_options
from inductor_ext.inductor.sibling_projections import fuse_sibling_projections

H = 64

pytestmark = pytest.mark.usefixtures("fresh_compiles")


def test_option_defaults_off_and_is_set_by_option_or_environment():
    assert parse_options(None, env={})[0].fuse_projections is False
    assert parse_options({"fastops.fuse_projections": True}, env={})[0].fuse_projections is True
    assert parse_options(None, env={"INDUCTOR_EXT_FUSE_PROJECTIONS": "1"})[0].fuse_projections is True


class Siblings(nn.Module):
    """Linear layers of one input: ``widths`` gives their output widths, ``bias`` which have one, ``frozen``
    which are frozen."""

    def __init__(self, widths: tuple[int, ...], bias: tuple[bool, ...] = (), frozen: tuple[bool, ...] = ()) -> None:
        super().__init__()
        bias, frozen = bias or (False,) * len(widths), frozen or (False,) * len(widths)
        self.projections = nn.ModuleList(nn.Linear(H, width, bias=b) for width, b in zip(widths, bias, strict=True))
        for projection, f in zip(self.projections, frozen, strict=True):
            projection.requires_grad_(not f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        return torch.cat([p(y).view(*y.shape[:-1], -1, 8).mul(i + 1) for i, p in enumerate(self.projections)], -2)


def _rewritten(module: nn.Module, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """Groups fused and linear calls left in ``module``'s Dynamo graph, and the rewritten graph's output
    (run eagerly, so the comparison is of the rewrite alone)."""
    seen: list[tuple[int, int]] = []

    def backend(gm, example_inputs):
        fused = fuse_sibling_projections(gm)
        seen.append((fused, sum(1 for node in gm.graph.nodes if node.target in LINEARS)))
        return gm.forward

    out = torch.compile(module, backend=backend, fullgraph=True)(x)
    (fused, linears), = seen  # fmt: skip
    return fused, linears, out


@pytest.mark.parametrize(
    ("widths", "bias", "frozen", "groups", "linears"),
    [
        ((64, 32, 32), (), (), 1, 1),  # GQA q/k/v
        ((64, 32, 32), (True, True, True), (), 1, 1),  # Qwen2's q/k/v biases
        ((128, 128), (), (), 0, 2),  # gate/up: as wide as each other and wider than the input (measured 0.96x)
        ((64, 64, 64), (), (), 0, 3),  # multi-head q/k/v
        ((64, 32, 32), (True, False, True), (), 1, 2),  # q and v (with biases) as one product, k alone
        # LoRA: frozen base q/k/v as one product, the trainable A matrices as another (no frozen weight's
        # gradient computed)
        ((64, 32, 32, 8, 8, 8), (), (True, True, True, False, False, False), 2, 2),
    ],
    ids=["gqa", "gqa_bias", "gate_up", "mha", "mixed_bias", "lora"],
)
def test_which_groups_are_fused_and_their_values_and_gradients(widths, bias, frozen, groups, linears):
    torch.manual_seed(0)
    module = Siblings(widths, bias, frozen).double()
    x = torch.randn(2, 8, H, dtype=torch.float64, requires_grad=True)
    fused, left, out = _rewritten(module, x)
    assert (fused, left) == (groups, linears)
    out.square().sum().backward()
    grads = [x.grad, *(p.grad for p in module.parameters())]
    x.grad = None
    module.zero_grad(set_to_none=True)
    ref = module(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for grad, grad_ref in zip(grads, [x.grad, *(p.grad for p in module.parameters())], strict=True):
        assert (grad is None) == (grad_ref is None)
        if grad is not None:
            torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)


class Pair(nn.Module):
    """Two narrow projections of width 16 for the cases below, each of which is left separate; their
    ``forward`` returns what the test compares with eager."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(H, 16), nn.Linear(H, 16)


def _assert_left_separate(module: Pair, x: torch.Tensor):
    """The rewrite fuses nothing in ``module`` and its graph computes what eager does; the graph's output."""
    fused, linears, out = _rewritten(module, x)
    assert (fused, linears) == (0, 2)
    for got, want in zip(out, module(x), strict=True):
        torch.testing.assert_close(got, want)
    return out


def test_siblings_of_different_inputs_are_not_fused():
    class TwoInputs(Pair):
        def forward(self, x):
            return self.a(x), self.b(x.cos())

    _assert_left_separate(TwoInputs(), torch.randn(4, H))


class Flattened(Pair):
    """Narrow projections whose outputs are flattened with ``view``: a view their columns of one product (rows
    strided by the product's width) cannot take."""

    def forward(self, x):
        y = x.sin()
        return self.a(y).view(-1), self.b(y).transpose(0, 1).unsqueeze(0).view(16, -1)


def test_projections_whose_views_their_columns_cannot_take_are_left_separate():
    _assert_left_separate(Flattened(), torch.randn(4, H))


class AcrossContexts(Pair):
    """Two narrow projections of one input, the first under ``context``: fused, the second would run there."""

    def __init__(self, context) -> None:
        super().__init__()
        self.context = context

    def forward(self, x):
        y = x.sin()
        with self.context():
            a = self.a(y)
        return a.float(), self.b(y)


@pytest.mark.parametrize(
    "context",
    [lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad],
    ids=["autocast", "no_grad"],
)
def test_projections_on_either_side_of_a_context_boundary_are_not_fused(context):
    _, b = _assert_left_separate(AcrossContexts(context), torch.randn(4, H))
    assert b.dtype == torch.float32 and b.requires_grad  # computed as written: outside the context


def test_projections_with_an_in_place_write_between_them_are_not_fused():
    class WrittenBetween(Pair):
        def forward(self, x):
            y = x.sin()
            a = self.a(y)
            y.mul_(2)  # b reads the doubled input
            return a, self.b(y)

    _assert_left_separate(WrittenBetween(), torch.randn(4, H))


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _compiled_step(model, ids, fuse: bool):
    """Loss, gradients and the bytes of the tensors saved for the backward that are not parameters, of a
    compiled step after the compiling one."""
    compiled = torch.compile(model, backend="fastops_inductor", options={"fastops.fuse_projections": fuse})
    compiled(input_ids=ids, labels=ids)  # compiles (saved-tensor hooks would see fake tensors)
    model.zero_grad(set_to_none=True)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    kept = sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() not in parameters)
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, kept


def test_llama_under_the_backend_trains_as_with_separate_projections():
    model = _llama()
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, grads, kept = _compiled_step(model, ids, fuse=True)
    torch._dynamo.reset()
    loss_ref, grads_ref, kept_ref = _compiled_step(model, ids, fuse=False)
    assert kept == kept_ref  # the concatenated weights are recomputed in the backward, not saved
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-5, atol=1e-5 * grads_ref[name].abs().max().item())
    q, k = (grads[f"model.layers.0.self_attn.{name}.weight"] for name in ("q_proj", "k_proj"))
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # views of one buffer
    assert q.shape == (H, H) and k.shape == (H // 2, H) and k.is_contiguous()

"""``fastops.lazy_linear_outputs`` on CPU: HF's returned logits get no logits-sized zero gradient in the
compiled backward, the gradients are unchanged to the bit when the logits are unused and equal when they
are used (also under autocast), and only widening linear outputs that the graph also reads are deferred."""

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import transformers

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext.inductor import passes
from inductor_ext.inductor.lazy_linear_outputs import LinearOutput
from inductor_ext.inductor.options import parse_options

VOCAB, H, BATCH, SEQ = 1000, 64, 2, 32


pytestmark = pytest.mark.usefixtures("fresh_compiles")


def test_the_pass_always_runs_unless_a_test_turns_it_off():
    assert parse_options(None, env={})[0].runs("lazy_linear_outputs")
    assert not parse_options({"fastops._passes_off": ("lazy_linear_outputs",)}, env={})[0].runs("lazy_linear_outputs")
    assert not parse_options(None, env={"INDUCTOR_EXT_PASSES_OFF": "lazy_linear_outputs"})[0].runs(
        "lazy_linear_outputs"
    )


def test_a_former_option_is_honoured_with_a_deprecation_warning():
    with pytest.warns(FutureWarning, match="fastops.lazy_linear_outputs .* is deprecated"):
        assert not parse_options({"fastops.lazy_linear_outputs": False}, env={})[0].runs("lazy_linear_outputs")
    with pytest.warns(FutureWarning, match="fastops.causal_mask .* is deprecated"):
        assert not parse_options(None, env={"INDUCTOR_EXT_CAUSAL_MASK": "0"})[0].runs("causal_mask")


def _llama(dtype=torch.float32):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def _step(model, ids, *, lazy, use_logits=False, autocast=False):
    """One compiled forward and backward: (loss, logits, gradients, shapes of the zeros the backward's
    autograd node was handed for unused outputs, the logits' autograd node type)."""
    options = {} if lazy else {"fastops._passes_off": ("lazy_linear_outputs",)}
    compiled = torch.compile(model, backend="fastops_inductor", options=options)
    model.zero_grad(set_to_none=True)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        out = compiled(input_ids=ids, labels=ids)
        logits_node = type(out.logits.grad_fn)
        if use_logits:  # modified in place first, as HF's logits may be (e.g. by a temperature)
            out.logits.div_(2)
        loss = out.loss + (out.logits.float().square().mean() if use_logits else 0)
        loss.backward()
    zeros = [tuple(e.input_shapes[0]) for e in prof.events() if e.name == "aten::zero_" and _under_compiled_backward(e)]
    return out.loss.detach(), out.logits.detach(), [p.grad for p in model.parameters()], zeros, logits_node


def _under_compiled_backward(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "CompiledFunctionBackward":
            return True
        parent = parent.cpu_parent
    return False


def test_unused_logits_get_no_zero_gradient_and_the_gradients_are_unchanged_to_the_bit():
    model = _llama()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loss, logits, grads, zeros, _ = _step(model, ids, lazy=True)
    loss_ref, logits_ref, grads_ref, zeros_ref, _ = _step(model, ids, lazy=False)
    logits_shape = (BATCH, SEQ, VOCAB)
    assert logits_shape in zeros_ref  # what the option removes: without it, autograd hands zero logits in
    assert logits_shape not in zeros and (BATCH, SEQ, H) in zeros  # the final hidden state's zeros instead
    assert torch.equal(loss, loss_ref) and torch.equal(logits, logits_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert torch.equal(g, g_ref)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
def test_used_logits_get_their_gradient(autocast):
    model = _llama()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    _, logits, grads, _, logits_node = _step(model, ids, lazy=True, use_logits=True, autocast=autocast)
    _, logits_ref, grads_ref, _, _ = _step(model, ids, lazy=False, use_logits=True, autocast=autocast)
    assert logits_node is LinearOutput._backward_cls
    assert torch.equal(logits, logits_ref)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert g.dtype == g_ref.dtype == torch.float32
        # the logits' two gradient contributions reach the hidden state as two products instead of one
        tol = 1e-2 if autocast else 1e-5
        torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol * g_ref.abs().max().item())


class Heads(torch.nn.Module):
    """Four linear outputs returned next to a loss read from them: a widening one read by the loss
    (deferred), a widening one with a bias read by the loss (deferred), a narrowing one (kept: its zeros
    would not be larger than its input's) and a widening one the graph does not read (kept: nothing to save)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = torch.nn.Linear(H, 4 * H, bias=False)
        self.biased = torch.nn.Linear(H, 3 * H)
        self.narrow = torch.nn.Linear(H, H // 2, bias=False)
        self.unread = torch.nn.Linear(H, 2 * H, bias=False)

    def forward(self, x):
        h = torch.tanh(x)
        wide, biased, narrow, unread = self.wide(h), self.biased(h), self.narrow(h), self.unread(h)
        return wide.sum() + biased.square().sum() + narrow.sum(), wide, biased, narrow, unread


def test_only_widening_outputs_the_graph_reads_are_deferred(monkeypatch):
    deferred, defer = [], passes.lazy_linear_outputs

    def spy(gm, example_inputs):
        lazy = defer(gm, example_inputs)
        deferred.append([entry.output for entry in lazy])
        return lazy

    monkeypatch.setattr(passes, "lazy_linear_outputs", spy)
    torch.manual_seed(0)
    heads = Heads()
    x = torch.randn(SEQ, H, requires_grad=True)
    loss, wide, biased, narrow, unread = torch.compile(heads, backend="fastops_inductor", fullgraph=True)(x)
    assert deferred == [[1, 2]]
    assert isinstance(wide.grad_fn, LinearOutput._backward_cls) and isinstance(
        biased.grad_fn, LinearOutput._backward_cls
    )
    wide.mul_(3)  # a deferred output may be modified in place, as any output
    (loss + wide.mean() + biased.mean() + narrow.mean() + unread.mean()).backward()

    x_ref = x.detach().clone().requires_grad_()
    heads_ref = Heads()
    heads_ref.load_state_dict(heads.state_dict())
    loss_ref, *outs_ref = heads_ref(x_ref)
    outs_ref[0].mul_(3)
    (loss_ref + sum(o.mean() for o in outs_ref)).backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for p, p_ref in zip(heads.parameters(), heads_ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad)


def test_inference_graphs_are_left_alone(monkeypatch):
    deferred, defer = [], passes.lazy_linear_outputs
    monkeypatch.setattr(passes, "lazy_linear_outputs", lambda gm, ex: deferred.append(defer(gm, ex)) or deferred[-1])
    model = _llama()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with torch.no_grad():
        out = torch.compile(model, backend="fastops_inductor")(input_ids=ids, labels=ids)
    assert deferred == [[]] and out.logits.grad_fn is None

"""inductor_ext.models.apply on transformers' own models, one tiny random-init config per family (CPU;
our kernels run under the Triton interpreter): the fused loss gives HF's loss and gradients and training
converges step for step with the unpatched model, HF's loss semantics hold, the backend rewrites the
patched model as the unpatched one, nothing outside the patched model changes, unapply restores
everything, and what cannot be patched is named."""

import copy
import re
import warnings

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.models import FAMILIES, PatchWarning

VOCAB = 1000
COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128}  # fmt: skip
EXTRA = {
    "gemma2": {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0},
    "qwen3": {"head_dim": 16},
    "granite": {"logits_scaling": 4.0},
    "phi3": {"pad_token_id": 0},
}
STEPS = 12


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **EXTRA.get(model_type, {}), **overrides})
    config._attn_implementation = "eager" if model_type == "gemma2" else "sdpa"  # Gemma 2 has no SDPA path
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _batches(count: int, batch: int = 2, seq: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, seq), generator=generator) for _ in range(count)]


def train_losses(model: torch.nn.Module, batches: list[torch.Tensor], lr: float = 1e-3) -> list[float]:
    """One AdamW step per batch on the trainable parameters; the loss of each step."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    return _batches(STEPS)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_patched_training_converges_with_the_unpatched_model(model_type, batches):
    """fp32: our kernels differ from HF's aten math by rounding only (≈1e-7 relative per op). Over a
    dozen AdamW steps at lr 1e-3 the losses stay within 1e-5 of each other, and each parameter's
    difference stays under 1% of how far training moved it (AdamW turns a rounding-level difference
    of a near-zero gradient into up to a full step, so a bound relative to the parameter itself
    would fail on small biases)."""
    reference = tiny_model(model_type)
    model = copy.deepcopy(reference)
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", PatchWarning)  # every part of a known family is patched
        with models.patched(model) as report:
            assert report.loss and report.family == model_type
            actual = train_losses(model, batches)
    expected = train_losses(reference, batches)

    for step, (a, b) in enumerate(zip(actual, expected)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        moved = (q - initial[name]).norm().item()
        assert (p - q).norm().item() <= 1e-2 * moved + 1e-9, name


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_patched_loss_and_gradients_are_hf(model_type):
    """One training call (fp32, eager): the fused LM head + loss gives transformers' loss and every
    parameter's gradient, to float32 rounding (Gemma 2: with its final logit soft-cap), and no logits."""
    reference = tiny_model(model_type)
    model = copy.deepcopy(reference)
    ids = _batches(1)[0]
    with models.patched(model):
        ours = model(input_ids=ids, labels=ids)
        ours.loss.backward()
    theirs = reference(input_ids=ids, labels=ids)
    theirs.loss.backward()
    assert ours.logits is None and theirs.logits is not None
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma2"])
def test_patched_model_compiles_with_no_graph_break(model_type):
    """``position_ids`` passed, so the check of their shape is traced too."""
    model = tiny_model(model_type)
    ids = _batches(1)[0]
    positions = torch.arange(ids.shape[1])[None]
    with models.patched(model):
        expected = model(input_ids=ids, labels=ids, position_ids=positions).loss
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        loss = compiled(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
    assert not counters["graph_break"]
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)


BACKEND_CALLS = {
    "causal": {},
    "packed documents": {
        "position_ids": torch.tensor([[*range(6), *range(10)], [*range(4), *range(7), *range(5)]]),
        "use_cache": False,
    },
}


def _backend_passes(model: torch.nn.Module, call: dict, marked: list[int]) -> dict[str, int]:
    """The backend's rewrites of one training call's graph (name -> count) and, in ``marked``, how many
    norm outputs it marked for recomputation; Inductor itself is not run (the graph runs as it is)."""
    torch._dynamo.reset()
    counters.clear()
    marked.clear()
    torch.compile(model, backend="fastops_inductor", fullgraph=True)(**call)
    return {name: n for name, n in counters["inductor_ext"].items() if name.startswith("rewrite_")}


@pytest.mark.parametrize("call", BACKEND_CALLS)
def test_the_backend_rewrites_the_patched_model_as_an_unpatched_one(monkeypatch, call):
    """Under ``fastops_inductor`` the patched model's decoder is rewritten as the unpatched model's: the
    same norm rewrites (the residual adds fused into the norms), RoPE, GLU and mask rewrites (packed rows:
    the document mask), and the same norm outputs marked for recomputation. Only the loss differs: the
    unpatched model's cross-entropy on the logits is rewritten, the patched model's fused loss is our op
    already."""
    import torch._inductor.compile_fx

    from inductor_ext.inductor import passes

    marked: list[int] = []
    mark = passes.mark_recompute
    monkeypatch.setattr(passes, "mark_recompute", lambda gm, ops: marked.append(mark(gm, ops)) or marked[-1])
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", lambda gm, example_inputs, **kwargs: gm.forward)
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    ids = _batches(1)[0]
    call = {"input_ids": ids, "labels": ids, **BACKEND_CALLS[call]}
    unpatched = _backend_passes(reference, call, marked)
    unpatched_marked = list(marked)
    with models.patched(model):
        patched = _backend_passes(model, call, marked)
    torch._dynamo.reset()
    assert marked == unpatched_marked and sum(marked) > 0
    losses = {name for name in unpatched.keys() | patched.keys() if "cross_entropy" in name}
    assert losses and not any("cross_entropy" in name for name in patched)
    decoder = {name: n for name, n in unpatched.items() if name not in losses}
    assert {name: n for name, n in patched.items() if name not in losses} == decoder
    rewrites = ("rms_norm", "add_rms_norm", "rope", "glu") + (("document_mask",) if "position_ids" in call else ())
    for rewrite in rewrites:
        assert any(name.startswith(f"rewrite_{rewrite}") for name in decoder), (rewrite, decoder)


def _kv_cache(outputs) -> object:
    """The KV cache a causal LM returned (transformers renamed ``past_key_values`` to ``cache`` in 5.2x)."""
    caches = (getattr(outputs, name, None) for name in ("cache", "past_key_values"))
    return next((cache for cache in caches if cache is not None), None)


def test_training_with_labels_builds_no_kv_cache_unless_asked():
    """The fused-loss path returns no cache, so a compiled step's only differentiable output is the
    loss (no zero gradient per cached key/value in the backward); ``use_cache=True`` still builds one."""
    model = tiny_model("llama")
    ids = _batches(1)[0]
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with models.patched(model):
        assert _kv_cache(model(input_ids=ids, labels=ids)) is None
        assert _kv_cache(model(input_ids=ids, labels=ids, use_cache=True)) is not None
        torch._dynamo.reset()
        torch.compile(model, backend=recording_backend, fullgraph=True)(input_ids=ids, labels=ids).loss.backward()
    (output,) = graphs[0].graph.find_nodes(op="output")
    returned = [node for node in torch.utils._pytree.tree_leaves(output.args) if isinstance(node, torch.fx.Node)]
    assert [node.meta["example_value"].requires_grad for node in returned].count(True) == 1


def test_loss_keeps_hf_semantics():
    """ignore_index labels, num_items_in_batch (sum / count, for gradient accumulation), shift_labels."""
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    ids = _batches(1)[0]
    labels = ids.clone()
    labels[0, :5] = -100
    count = torch.tensor(7.0)
    shifted = torch.roll(ids, -1, dims=1)
    for kwargs in ({"labels": labels}, {"labels": labels, "num_items_in_batch": count},
                   {"labels": ids, "shift_labels": shifted}):  # fmt: skip
        with models.patched(model):
            ours = model(input_ids=ids, **kwargs)
        theirs = reference(input_ids=ids, **kwargs)
        assert ours.logits is None  # training with labels: no logits
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)


def test_lower_memory_weight_gradient_mode_is_passed_to_the_loss():
    """``weight_grad_accumulation="weight_dtype"``: in fp32 the two modes give the same gradient."""
    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    ids = _batches(1)[0]
    with models.patched(model, weight_grad_accumulation="weight_dtype"):
        model(input_ids=ids, labels=ids).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="weight_grad_accumulation must be one of"):
        models.apply(model, weight_grad_accumulation="bf16")


def test_loss_chunk_size_is_passed_to_the_loss(monkeypatch):
    """``loss_chunk_size`` reaches the fused loss (the same loss and gradient in fp32); bad values raise."""
    from inductor_ext.models import forwards

    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    ids = _batches(1)[0]
    chunk_sizes = []
    loss = forwards.fused_linear_cross_entropy

    def recording(*args, chunk_size=None, **kwargs):
        chunk_sizes.append(chunk_size)
        return loss(*args, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(forwards, "fused_linear_cross_entropy", recording)
    with models.patched(model, loss_chunk_size=5):
        ours = model(input_ids=ids, labels=ids).loss
        ours.backward()
    theirs = reference(input_ids=ids, labels=ids).loss
    theirs.backward()
    assert chunk_sizes == [5]
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-5, atol=1e-7)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="loss_chunk_size must be None or a positive int"):
            models.apply(model, loss_chunk_size=bad)


def test_evaluation_and_calls_without_labels_return_logits():
    reference = tiny_model("qwen3")
    model = copy.deepcopy(reference)
    ids = _batches(1)[0]
    with models.patched(model):
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        model.eval()
        reference.eval()
        ours, theirs = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
        torch.testing.assert_close(ours.logits, theirs.logits)
        torch.testing.assert_close(ours.loss, theirs.loss)


def test_unapply_restores_the_model():
    model = tiny_model("llama")
    models.apply(model)
    models.unapply(model)
    assert not any(attribute.startswith(("forward", "_fastops_")) for m in model.modules() for attribute in vars(m))
    ids = _batches(1)[0]
    assert model(input_ids=ids, labels=ids).logits is not None


def _outputs_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Training loss, logits and gradients, then evaluation logits, of one call on ``ids``."""
    model.train()
    outputs = model(input_ids=ids, labels=ids)
    outputs.loss.backward()
    results = [outputs.loss.detach(), outputs.logits.detach(), *(p.grad for p in model.parameters())]
    model.eval()
    with torch.no_grad():
        results.append(model(input_ids=ids).logits)
    return results


def test_patching_one_model_leaves_other_models_and_transformers_alone():
    """``apply`` changes the instance it is given only: a second Llama built and run in the same process
    while another is patched computes what plain transformers computes, to the bit, and no attribute of
    transformers' modeling module is replaced, while the first model is patched or after it is unapplied."""
    from transformers.models.llama import modeling_llama

    ids = _batches(1)[0]
    module_before = dict(vars(modeling_llama))
    expected = _outputs_and_grads(tiny_model("llama", seed=1), ids)  # plain transformers, before any patch

    first = tiny_model("llama")
    with models.patched(first) as report:
        assert report.loss
        first(input_ids=ids, labels=ids).loss.backward()  # the patched model runs
        module_patched = dict(vars(modeling_llama))
        second = tiny_model("llama", seed=1)
        actual = _outputs_and_grads(second, ids)
    assert not any("forward" in vars(m) or any(a.startswith("_fastops_") for a in vars(m)) for m in second.modules())
    assert len(actual) == len(expected)
    for ours, theirs in zip(actual, expected):
        assert torch.equal(ours, theirs)
    for module in (module_patched, dict(vars(modeling_llama))):
        assert module.keys() == module_before.keys()
        assert [name for name, value in module.items() if value is not module_before[name]] == []


def test_peft_wrapped_model_is_patched_and_trains():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(tiny_model("llama"), config)
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: give the adapters a gradient path of their own
            torch.nn.init.normal_(param, std=0.02)
    wrapped_reference = copy.deepcopy(wrapped)
    ids = _batches(1)[0]
    with models.patched(wrapped) as report:  # the MLPs' up and down projections have no LoRA: no lora_mlp
        assert report.loss and len(report.lora) == 3 * COMMON["num_hidden_layers"] and report.lora_mlps == []
        ours = wrapped(input_ids=ids, labels=ids)
        ours.loss.backward()
    theirs = wrapped_reference(input_ids=ids, labels=ids)
    theirs.loss.backward()
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    for (name, p), (_, q) in zip(wrapped.named_parameters(), wrapped_reference.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_what_cannot_be_patched_is_named():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.warns(PatchWarning, match="unknown model family 'gpt2'"):
        report = models.apply(gpt2)
    assert not report
    with pytest.raises(ValueError, match="is not patched"):  # nothing was patched: the model stays unmarked
        models.unapply(gpt2)
    with pytest.warns(PatchWarning, match="unknown model family"), models.patched(gpt2) as again:
        assert not again  # a second apply is not "already patched", and leaving the block unapplies nothing

    hooked = tiny_model("llama")
    hooked.forward = hooked.forward  # e.g. an accelerate hook: an instance forward
    with pytest.warns(PatchWarning, match=r"model: its forward is already replaced"):
        report = models.apply(hooked)
    assert not report.loss and "model" in report.skipped
    models.unapply(hooked)

    decoder = tiny_model("llama").model  # a LlamaModel: no LM head
    with pytest.warns(PatchWarning, match=r"LlamaModel: not a LlamaForCausalLM: the loss is left as it is"):
        assert not models.apply(decoder)
    models.unapply(decoder)


def test_bad_calls_raise():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        models.apply("llama")
    with pytest.raises(ValueError, match="is not patched"):
        models.unapply(model)
    models.apply(model)
    with pytest.raises(ValueError, match="already patched"):
        models.apply(model)
    # transformers computes RoPE's cos and sin from them: its own error names cos
    ids = _batches(1)[0]
    for tokens in ({"input_ids": ids}, {"inputs_embeds": torch.randn(*ids.shape, COMMON["hidden_size"])}):
        for positions in (torch.arange(5)[None], torch.arange(16).expand(3, 16)):
            shape = re.escape(str(tuple(positions.shape)))
            with pytest.raises(ValueError, match=rf"position_ids must give one position per token: .*got {shape}"):
                model(**tokens, position_ids=positions)
    models.unapply(model)


def test_the_patched_forward_binds_and_shows_the_model_s_own_arguments():
    """The patched ``forward`` takes its arguments as the model class's does: positionally in the class's order
    (``model(ids, attention_mask)`` is not taken as labels) and with the class's signature (HF ``Trainer``
    keeps the dataset columns that signature names); a misuse is refused as Python would."""
    import inspect

    reference = tiny_model("llama").eval()
    patched = copy.deepcopy(reference)
    models.apply(patched)
    assert inspect.signature(patched.forward) == inspect.signature(reference.forward)
    ids = torch.randint(0, 256, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with torch.no_grad():
        want = reference(ids, mask).logits
        got = patched(ids, mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="multiple values for argument 'input_ids'"):
        patched(ids, input_ids=ids)
    too_many = len(inspect.signature(reference.forward).parameters) + 1
    with pytest.raises(TypeError, match="positional arguments but"):
        patched(*([None] * too_many))

"""Packed documents under inductor_ext.models.apply: the patched model masks as transformers does (CPU, fp32).

transformers separates packed documents (``position_ids`` restarting at 0, no ``attention_mask``) only
when the decoder runs without a KV cache, and builds one by default (``use_cache`` unset means
``config.use_cache``). The patched training forward builds no KV cache, yet for every spelling of
``use_cache``, with packed ``position_ids``, a padding ``attention_mask`` or both, in training and in
evaluation, its loss and gradients are transformers' for the same call; ``packed_documents="separate"``
is transformers with ``use_cache=False``.
"""

import copy
from collections.abc import Iterator

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.models import FAMILIES
from tests.models.test_patch import VOCAB, _kv_cache, tiny_model

BATCH, SEQ = 2, 16
SPELLINGS = {"unset": {}, "use_cache=True": {"use_cache": True}, "use_cache=False": {"use_cache": False}}
PACKED = torch.tensor([[*range(6), *range(10)], [*range(4), *range(7), *range(5)]])
"""Two rows of three and two documents."""
PADDING = torch.ones(BATCH, SEQ, dtype=torch.long)
PADDING[1, -5:] = 0
INPUTS = {
    "packed position_ids": {"position_ids": PACKED},
    "attention_mask": {"attention_mask": PADDING},
    "both": {"position_ids": PACKED, "attention_mask": PADDING},
}


def _batch(**inputs) -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.masked_fill(inputs["attention_mask"] == 0, -100) if "attention_mask" in inputs else ids
    return {"input_ids": ids, "labels": labels, **inputs}


def _loss_and_grads(model: torch.nn.Module, **call) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**call).loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(ours: tuple, theirs: tuple) -> None:
    (loss, grads), (expected_loss, expected_grads) = ours, theirs
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return tiny_model("llama", num_hidden_layers=1)


@pytest.fixture(scope="module", params=["hf", "separate"])
def patched(request, reference) -> Iterator[tuple[str, torch.nn.Module]]:
    model = copy.deepcopy(reference)
    with models.patched(model, packed_documents=request.param):
        yield request.param, model


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_patched_model_masks_as_transformers_does(reference, patched, spelling, inputs, training):
    """``"hf"``: transformers' loss and gradients for the same call; ``"separate"``: transformers'
    with ``use_cache=False``."""
    mode, model = patched
    call = {**_batch(**INPUTS[inputs]), **SPELLINGS[spelling]}
    expected_call = {**call, "use_cache": False} if mode == "separate" else call
    model.train(training)
    reference.train(training)
    try:
        _assert_same(_loss_and_grads(model, **call), _loss_and_grads(reference, **expected_call))
    finally:
        model.train()
        reference.train()


def test_transformers_default_lets_packed_documents_attend_across(reference):
    """The trap itself: with its default cache transformers masks packed rows causally only."""
    call = _batch(**INPUTS["packed position_ids"])
    default, without_cache = reference(**call).loss, reference(**call, use_cache=False).loss
    assert (default - without_cache).abs() > 1e-4
    separate = copy.deepcopy(reference)
    with models.patched(separate, packed_documents="separate"):
        torch.testing.assert_close(separate(**call).loss, without_cache, rtol=1e-6, atol=1e-6)


def test_gradient_checkpointing_resolves_use_cache_as_transformers_does(reference):
    """Under gradient checkpointing in training transformers builds no default cache: the documents
    are separated, by both."""
    theirs, ours = copy.deepcopy(reference), copy.deepcopy(reference)
    for model in (theirs, ours):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    call = _batch(**INPUTS["packed position_ids"])
    with models.patched(ours):
        _assert_same(_loss_and_grads(ours, **call), _loss_and_grads(theirs, **call))
    torch.testing.assert_close(theirs(**call).loss, reference(**call, use_cache=False).loss)


def test_patched_training_builds_no_kv_cache(reference, monkeypatch):
    """``use_cache`` unset with packed rows: no cache is returned and no key or value is stored, eager or
    compiled (whose only differentiable output is the loss), and the loss is still transformers'."""
    from transformers import cache_utils

    stored = []
    for layer in (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer):
        update = layer.update
        monkeypatch.setattr(
            layer, "update", lambda self, *a, _update=update, **k: stored.append(1) or _update(self, *a, **k)
        )
    model = copy.deepcopy(reference)
    call = _batch(**INPUTS["packed position_ids"])
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with models.patched(model):
        outputs = model(**call)
        assert _kv_cache(outputs) is None
        assert not stored
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend=recording_backend, fullgraph=True)(**call).loss
        compiled.backward()
    assert not counters["graph_break"] and not stored
    (output,) = graphs[0].graph.find_nodes(op="output")
    returned = [node for node in torch.utils._pytree.tree_leaves(output.args) if isinstance(node, torch.fx.Node)]
    assert [node.meta["example_value"].requires_grad for node in returned].count(True) == 1
    monkeypatch.undo()
    torch.testing.assert_close(compiled.detach(), reference(**call).loss.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outputs.loss.detach(), reference(**call).loss.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_masks_packed_rows_as_transformers_does(model_type):
    """The default call on packed rows (sliding-window layers included: a 4-token window where the
    family has one): ``"hf"`` is transformers' default, ``"separate"`` transformers' ``use_cache=False``."""
    config = transformers.AutoConfig.for_model(model_type)
    window = {"sliding_window": 4} if hasattr(config, "sliding_window") else {}
    reference = tiny_model(model_type, num_hidden_layers=1, **window)
    call = _batch(**INPUTS["packed position_ids"])
    for mode, expected_call in (("hf", call), ("separate", {**call, "use_cache": False})):
        model = copy.deepcopy(reference)
        with models.patched(model, packed_documents=mode):
            ours = model(**call)
            assert _kv_cache(ours) is None
            torch.testing.assert_close(ours.loss, reference(**expected_call).loss, rtol=1e-6, atol=1e-6)


def test_without_a_cache_that_keeps_nothing_transformers_forward_runs_the_call(reference):
    """Where no mask-only cache can be made, the default training call is transformers' own (its
    cache and logits included), so its masks are still transformers'."""
    model = copy.deepcopy(reference)
    call = _batch(**INPUTS["packed position_ids"])
    with models.patched(model):
        model._fastops_mask_only_cache = None
        ours = model(**call)
        assert ours.logits is not None and _kv_cache(ours) is not None
        torch.testing.assert_close(ours.loss, reference(**call).loss, rtol=1e-6, atol=1e-6)
        assert model(**call, use_cache=False).logits is None  # no cache wanted: the fused loss


def test_separate_without_the_fused_loss(reference):
    """``loss=False``: the loss is transformers' (logits built), packed documents still separated."""
    model = copy.deepcopy(reference)
    call = _batch(**INPUTS["packed position_ids"])
    with models.patched(model, loss=False, packed_documents="separate") as report:
        assert not report.loss
        ours = model(**call, use_cache=True)
        assert ours.logits is not None and _kv_cache(ours) is None
        torch.testing.assert_close(ours.loss, reference(**call, use_cache=False).loss, rtol=1e-6, atol=1e-6)


def test_bad_packed_documents_raises(reference):
    for bad in ("HF", "causal", None, 1):
        with pytest.raises(ValueError, match="packed_documents must be one of"):
            models.apply(reference, packed_documents=bad)

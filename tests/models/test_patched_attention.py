"""The patched model's attention (inductor_ext.models.attention): packed rows that transformers masks as
documents run ``document_causal_attention``, every other call SDPA on transformers' mask; the loss and
gradients are transformers' either way (CPU, fp32), eager and under ``torch.compile``."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.models import attention
from tests.models.test_packed_semantics import INPUTS, LOSS_ONLY, PACKED, _assert_same, _batch, _loss_and_grads
from tests.models.test_patch import tiny_model
from tests.packed_positions import random_packed_positions


@pytest.fixture
def document_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The (batch, length) of each ``document_causal_attention`` call the patched layers make."""
    calls: list[tuple[int, ...]] = []
    real = attention.document_causal_attention

    def spy(query, *args, **kwargs):
        calls.append((query.shape[0], query.shape[2]))
        return real(query, *args, **kwargs)

    monkeypatch.setattr(attention, "document_causal_attention", spy)
    return calls


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return tiny_model("llama", num_hidden_layers=2)


CALLS = {
    "packed, use_cache=False": ({**INPUTS["packed position_ids"], "use_cache": False}, True),
    "packed, use_cache unset (transformers' cache: causal)": (INPUTS["packed position_ids"], False),
    "packed with an attention_mask": ({**INPUTS["both"], "use_cache": False}, False),
    "one document per row": ({"position_ids": torch.arange(16).expand(2, 16), "use_cache": False}, False),
}


@pytest.mark.parametrize("call", CALLS)
def test_document_attention_runs_exactly_where_transformers_masks_documents(reference, document_calls, call):
    inputs, documents = CALLS[call]
    model = copy.deepcopy(reference)
    with models.patched(model, **LOSS_ONLY) as report:
        assert report.attention and model.config._attn_implementation == attention.ATTENTION
        _assert_same(_loss_and_grads(model, **_batch(**inputs)), _loss_and_grads(reference, **_batch(**inputs)))
    assert document_calls == ([(2, 16)] * 2 if documents else [])
    assert model.config._attn_implementation == "sdpa"  # unapply restores it


def test_separate_packed_documents_run_document_attention(reference, document_calls):
    model = copy.deepcopy(reference)
    with models.patched(model, packed_documents="separate", **LOSS_ONLY):
        ours = _loss_and_grads(model, **_batch(**INPUTS["packed position_ids"]))
    _assert_same(ours, _loss_and_grads(reference, **_batch(**INPUTS["packed position_ids"]), use_cache=False))
    assert len(document_calls) == 2


def test_sliding_window_layers_keep_transformers_mask(document_calls):
    reference = tiny_model("mistral", num_hidden_layers=1, sliding_window=4)
    model = copy.deepcopy(reference)
    call = _batch(**INPUTS["packed position_ids"])
    with models.patched(model, **LOSS_ONLY):
        _assert_same(
            _loss_and_grads(model, **call, use_cache=False), _loss_and_grads(reference, **call, use_cache=False)
        )
    assert document_calls == []


def test_attention_switch_and_non_sdpa_models_are_left_alone(reference):
    model = copy.deepcopy(reference)
    with models.patched(model, attention=False, **LOSS_ONLY) as report:
        assert not report.attention and model.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", num_hidden_layers=1)
    eager.set_attn_implementation("eager")
    with models.patched(eager, **LOSS_ONLY) as report:
        assert not report.attention and "not 'sdpa'" in report.skipped["attention"]
        assert eager.config._attn_implementation == "eager"


def test_compiled_patched_model_on_packed_rows_is_one_graph_and_matches_eager(reference):
    """Dynamo traces the document attention (fullgraph); five packings of one row shape, one graph."""
    torch._dynamo.reset()
    counters.clear()
    model = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(0)
    with models.patched(model, **LOSS_ONLY):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        for _ in range(5):
            positions = random_packed_positions(len(PACKED), PACKED.shape[1], generator, longest=8)
            call = _batch(position_ids=positions, use_cache=False)
            model.zero_grad(set_to_none=True)
            loss = compiled(**call).loss
            loss.backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            _assert_same((loss.detach(), grads), _loss_and_grads(reference, **call))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]

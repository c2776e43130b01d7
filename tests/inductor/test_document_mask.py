"""The document-mask rewrite (inductor_ext.inductor.document_mask): transformers' packed-document mask
becomes block-sparse document attention; every other mask stays exactly as it is.

Masks are named as attention-gym names them: ``causal``, ``document_causal`` (causal within each
document of ``position_ids``), ``sliding_window``, ``padding``.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch._dynamo.utils import counters

from inductor_ext.inductor.causal_mask import rewrite_causal_masks
from inductor_ext.inductor.document_mask import rewrite_document_masks
from inductor_ext.inductor.sdpa_masks import SDPA_TARGETS
from inductor_ext.ops.document_attention import document_causal_attention, document_ids
from tests.packed_positions import packed_positions


@pytest.fixture
def materialised_hf_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers build the mask tensor under Dynamo, as it does on CUDA with torch < 2.14."""
    monkeypatch.setattr(transformers.masking_utils, "is_torchdynamo_exporting", lambda: True)


def _hf_model(family: str = "llama", **overrides):
    common = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "attn_implementation": "sdpa"}  # fmt: skip
    common.update(overrides)
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).train()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).train()


def _capture(model, **kwargs):
    """Dynamo's graph of ``model(**kwargs)`` with both mask rewrites applied; returns (output, causal, document, gm)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((rewrite_causal_masks(gm), rewrite_document_masks(gm), gm))
        return gm.forward

    torch._dynamo.reset()
    output = torch.compile(model, backend=backend, fullgraph=True)(**kwargs)
    assert len(seen) == 1
    return (output, *seen[0])


def _loss_and_grads(model, **kwargs):
    model.zero_grad()
    output = model(**kwargs)
    output.loss.backward()
    return output.loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same_training(model, compiled, **kwargs):
    loss, grads = _loss_and_grads(model, **kwargs)
    compiled_loss, compiled_grads = _loss_and_grads(compiled, **kwargs)
    torch.testing.assert_close(compiled_loss, loss)
    for got, expected in zip(compiled_grads, grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_hf_packed_document_mask_is_rewritten(materialised_hf_mask):
    model = _hf_model()
    positions = packed_positions([[5, 1, 9, 9], [24]])
    ids = torch.randint(0, 128, positions.shape)
    kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}

    output, causal, document, gm = _capture(model, **kwargs)

    assert causal.rewritten == 0 and all("position_ids" in reason for reason in causal.kept.values())
    assert (document.rewritten, document.kept) == (2, {})
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    assert sum(n.target is document_causal_attention for n in gm.graph.nodes) == 2
    torch.testing.assert_close(output.loss, model(**kwargs).loss)


def test_backend_trains_collated_packed_rows_as_hf_with_no_recompile(materialised_hf_mask, fresh_dynamo):
    """Five packings of one row shape, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    builds them (``position_ids`` and the ``cu_seq_lens_*``/``max_length_*`` keywords, which SDPA attention
    ignores and whose shapes change with the number of documents): one graph, loss and gradients as HF
    eager's for each."""
    model = _hf_model()
    compiled = torch.compile(model, backend="fastops_inductor", fullgraph=True)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    generator = torch.Generator().manual_seed(0)
    documents = set()
    for _ in range(5):
        lengths, total = [], 0
        while total < 40:
            lengths.append(min(int(torch.randint(2, 15, (1,), generator=generator)), 40 - total))
            total += lengths[-1]
        documents.add(len(lengths))
        batch = collator([{"input_ids": torch.randint(0, 128, (n,)).tolist()} for n in lengths])
        assert {"position_ids", "cu_seq_lens_q", "max_length_k"} <= set(batch)
        _assert_same_training(model, compiled, **batch, use_cache=False)
    assert len(documents) > 1
    assert counters["inductor_ext"]["rewrite_document_mask"] == 2
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]


def test_exported_hf_program_runs_document_attention_in_its_package(fresh_dynamo, tmp_path):
    """``inductor_ext.export`` of packed rows: torch.export materialises HF's document mask, the rewrite
    replaces it in the exported graph, and the AOTInductor package gives HF's logits for other packings
    of the row shape (on CPU the op materialises the mask itself: the GPU test runs FlexAttention)."""
    import inductor_ext

    model = _hf_model().eval()
    positions = packed_positions([[5, 1, 9, 9], [24]])
    ids = torch.randint(0, 128, positions.shape)
    kwargs = {"position_ids": positions, "use_cache": False}
    path = inductor_ext.export(model, (ids,), tmp_path / "packed.pt2", kwargs=kwargs)
    assert counters["inductor_ext"]["rewrite_document_mask"] == 2
    package = inductor_ext.load(path)
    for lengths in ([[5, 1, 9, 9], [24]], [[1] * 24, [12, 12]], [[24], [3, 21]]):
        positions = packed_positions(lengths)
        with torch.no_grad():
            expected = model(ids, position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(package(ids, position_ids=positions, use_cache=False).logits, expected,
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


def test_hf_default_cache_keeps_documents_attending_across(materialised_hf_mask):
    """With ``use_cache`` unset transformers builds a KV cache and no document mask: the causal rewrite
    applies, the document rewrite has nothing to do (HF's semantics kept)."""
    model = _hf_model()
    positions = packed_positions([[6, 6, 6]])
    ids = torch.randint(0, 128, positions.shape)
    output, causal, document, _ = _capture(model, input_ids=ids, position_ids=positions, labels=ids)
    assert causal.rewritten == 2 and document.rewritten == 0
    torch.testing.assert_close(output.loss, model(input_ids=ids, position_ids=positions, labels=ids).loss)


def test_padding_mask_is_kept(materialised_hf_mask):
    model = _hf_model()
    ids = torch.randint(0, 128, (2, 12))
    padding = torch.ones_like(ids)
    padding[0, :3] = 0
    output, _, document, _ = _capture(model, input_ids=ids, attention_mask=padding, labels=ids, use_cache=False)
    assert document.rewritten == 0 and len(document.kept) == 2
    assert all("attention_mask" in reason for reason in document.kept.values())
    torch.testing.assert_close(output.loss, model(input_ids=ids, attention_mask=padding, labels=ids).loss)


def test_packed_rows_with_an_attention_mask_are_kept(materialised_hf_mask):
    """transformers ignores packing when an attention_mask is given: a padding mask, kept."""
    model = _hf_model()
    positions = packed_positions([[5, 7]])
    ids = torch.randint(0, 128, positions.shape)
    kwargs = {"input_ids": ids, "position_ids": positions, "attention_mask": torch.ones_like(ids), "labels": ids,
              "use_cache": False}  # fmt: skip
    output, _, document, _ = _capture(model, **kwargs)
    assert document.rewritten == 0 and len(document.kept) == 2
    torch.testing.assert_close(output.loss, model(**kwargs).loss)


def test_sliding_window_document_mask_is_kept(materialised_hf_mask):
    model = _hf_model("mistral", sliding_window=4)
    positions = packed_positions([[10, 14]])
    ids = torch.randint(0, 128, positions.shape)
    kwargs = {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}
    output, _, document, _ = _capture(model, **kwargs)
    assert document.rewritten == 0 and all("not document_causal" in r for r in document.kept.values())
    torch.testing.assert_close(output.loss, model(**kwargs).loss)


@pytest.mark.parametrize(
    "spelling",
    [
        "document_causal",  # rewritten
        "strictly_causal",  # kv < q: not document_causal (the diagonal differs)
        "zero_starts",  # documents start where position == 0: differs when a document starts at another position
        "user_mask",  # a mask the caller passes
        "window",  # document_causal and a 3-token window
    ],
)
def test_hand_written_masks(spelling):
    def attention(q, k, v, positions, user_mask):
        index = torch.arange(q.shape[-2])
        if spelling == "zero_starts":
            doc = (positions == 0).cumsum(-1)
        else:
            doc = document_ids(positions)
        same = doc[:, :, None] == doc[:, None, :]
        if spelling == "strictly_causal":
            causal = index[:, None] > index[None, :]
        elif spelling == "window":
            causal = (index[:, None] >= index[None, :]) & (index[:, None] - index[None, :] < 3)
        else:
            causal = index[:, None] >= index[None, :]
        mask = user_mask if spelling == "user_mask" else (causal[None] & same)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    seen = []

    def backend(gm, example_inputs):
        seen.append(rewrite_document_masks(gm))
        return gm.forward

    q, k, v = (torch.randn(2, 4, 20, 8) for _ in range(3))
    positions = packed_positions([[7, 13], [20]])
    user_mask = torch.rand(2, 1, 20, 20) > 0.3
    user_mask[..., 0] = True
    torch._dynamo.reset()
    output = torch.compile(attention, backend=backend, fullgraph=True)(q, k, v, positions, user_mask)
    torch.testing.assert_close(output, attention(q, k, v, positions, user_mask))
    assert seen[0].rewritten == (1 if spelling == "document_causal" else 0)

"""The causal-mask rewrite (inductor_ext.inductor.causal_mask): which masks become ``is_causal=True``,
which stay exactly as they are, on HF transformers' own models and on hand-written spellings.

On CPU, transformers 5.24 with torch 2.13 traces ``attn_mask=None`` already; on CUDA with torch 2.11
(and under ``torch.export``) it materialises the mask because ``torch.compiler.is_exporting()`` reads
as true under Dynamo there. The ``materialised_hf_mask`` fixture takes that path on CPU.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from inductor_ext.inductor.causal_mask import rewrite_causal_masks
from inductor_ext.inductor.sdpa_masks import SDPA_TARGETS


@pytest.fixture
def materialised_hf_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make transformers build the mask tensor under Dynamo, as it does on CUDA with torch < 2.14."""
    monkeypatch.setattr(transformers.masking_utils, "is_torchdynamo_exporting", lambda: True)


def _compile(model, *args, dynamic: bool = False, assume_no_padding: bool = False, **kwargs):
    """Run ``model`` under Dynamo with the rewrite applied to its graph; returns (output, MaskRewrites, graph, masks
    the traced graph had before the rewrite)."""
    seen = []

    def backend(gm, example_inputs):
        masks = [n.kwargs.get("attn_mask") is not None for n in _sdpa_calls(gm)]
        seen.append((rewrite_causal_masks(gm, assume_no_padding=assume_no_padding), gm, masks))
        return gm.forward

    torch._dynamo.reset()
    output = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)(*args, **kwargs)
    assert len(seen) == 1
    return (output, *seen[0])


def _sdpa_calls(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def _hf_model(family: str = "llama", **overrides) -> nn.Module:
    common = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 128, "attn_implementation": "sdpa"}  # fmt: skip
    common.update(overrides)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common)).eval()
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
    raise ValueError(family)


# ------------------------------------------------------------------ HF models


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_hf_materialised_causal_mask_is_rewritten(materialised_hf_mask, family, dynamic):
    model = _hf_model(family)
    ids = torch.randint(0, 128, (2, 12))
    expected = model(ids).logits

    output, result, gm, masks = _compile(model, ids, dynamic=dynamic)

    assert masks == [True, True]  # the traced graph had the materialised mask, as on CUDA
    assert (result.rewritten, result.ungrouped, result.kept) == (2, 2, {})
    for call in _sdpa_calls(gm):
        assert call.kwargs["attn_mask"] is None and call.kwargs["is_causal"] is True
        assert call.kwargs["enable_gqa"] is True  # the repeat_kv copies are gone, as eager HF calls SDPA
    assert not any(n.target in (torch.arange,) for n in gm.graph.nodes if n.users and "mask" in n.name)
    torch.testing.assert_close(output.logits, expected)


def test_hf_padding_mask_is_kept(materialised_hf_mask):
    model = _hf_model()
    ids = torch.randint(0, 128, (2, 12))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0  # left padding
    expected = model(ids, attention_mask=attention_mask).logits

    output, result, gm, masks = _compile(model, ids, attention_mask=attention_mask)

    assert masks == [True, True] and result.rewritten == 0
    assert all("attention_mask" in reason for reason in result.kept.values()) and len(result.kept) == 2
    assert all(call.kwargs["attn_mask"] is not None and not call.kwargs["is_causal"] for call in _sdpa_calls(gm))
    torch.testing.assert_close(output.logits, expected)


def test_hf_mask_of_ones_needs_the_no_padding_promise():
    """transformers materialises the mask whenever an attention_mask is passed under Dynamo (any torch)."""
    model = _hf_model()
    ids = torch.randint(0, 128, (2, 12))
    ones = torch.ones_like(ids)
    expected = model(ids, attention_mask=ones).logits

    _, kept, _, masks = _compile(model, ids, attention_mask=ones)
    assert masks == [True, True] and kept.rewritten == 0

    output, result, gm, _ = _compile(model, ids, attention_mask=ones, assume_no_padding=True)
    assert result.rewritten == 2 and result.assumed_no_padding == ("l_kwargs_attention_mask_",)
    assert sum(n.target is torch._assert_async for n in gm.graph.nodes) == 1
    torch.testing.assert_close(output.logits, expected)


def test_no_padding_promise_is_checked_at_run_time():
    model = _hf_model()
    ids = torch.randint(0, 128, (2, 12))
    padded = torch.ones_like(ids)
    padded[1, :2] = 0
    with pytest.raises(RuntimeError, match="assume_no_padding"):
        _compile(model, ids, attention_mask=padded, assume_no_padding=True)


@pytest.mark.parametrize(
    ("window", "dynamic", "rewritten"),
    [
        (4, False, 0),  # a window shorter than the sequence: not causal
        (64, False, 2),  # static shapes: at 12 tokens a 64-token window is the causal mask
        (64, True, 0),  # dynamic shapes: it is not at 77 tokens, past the window constant
    ],
)
def test_hf_sliding_window_mask(materialised_hf_mask, window, dynamic, rewritten):
    model = _hf_model("mistral", sliding_window=window)
    ids = torch.randint(0, 128, (2, 12))
    expected = model(ids).logits

    output, result, _, masks = _compile(model, ids, dynamic=dynamic)

    assert masks == [True, True]
    assert result.rewritten == rewritten and len(result.kept) == 2 - rewritten
    assert all("not the causal mask" in reason for reason in result.kept.values())
    torch.testing.assert_close(output.logits, expected)


# --------------------------------------------------------- hand-written spellings


class Attention(nn.Module):
    """SDPA over (B, H, L, D) with a mask from ``make_mask(q, k)``."""

    def __init__(self, make_mask) -> None:
        super().__init__()
        self.make_mask = make_mask

    def forward(self, q, k, v, *extra):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.make_mask(q, k, *extra))


def _bool_tril(q, k):
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()


def _float_triu(q, k):
    return torch.full((q.shape[-2], k.shape[-2]), float("-inf"), device=q.device).triu(1)


def _finfo_min_4d(q, k):
    """transformers 4.x: a float mask of the dtype's lowest value, built from cache positions."""
    length, dtype = q.shape[-2], q.dtype
    mask = torch.full((length, length), torch.finfo(dtype).min, dtype=dtype, device=q.device)
    mask = torch.triu(mask, diagonal=1)
    cache_position = torch.arange(length, device=q.device)
    mask = mask * (torch.arange(length, device=q.device) > cache_position.reshape(-1, 1))
    return mask[None, None, :, :].expand(q.shape[0], 1, -1, -1)


def _bottom_right(q, k):
    """Queries at the end of a longer key sequence (a KV cache): not SDPA's top-left is_causal."""
    q_idx = torch.arange(q.shape[-2], device=q.device) + (k.shape[-2] - q.shape[-2])
    return torch.arange(k.shape[-2], device=q.device)[None, :] <= q_idx[:, None]


def _random(q, k):
    return (torch.rand(q.shape[-2], k.shape[-2], device=q.device) < 2) & _bool_tril(q, k)


def _user_mask(q, k, mask):
    return mask


def _in_place_after(q, k):
    mask = _bool_tril(q, k)
    mask[0, 1] = True  # a later in-place write changes the mask
    return mask


@pytest.mark.parametrize(
    ("make_mask", "key_length", "rewritten"),
    [
        (_bool_tril, 10, True),
        (_float_triu, 10, True),
        (_finfo_min_4d, 10, True),
        (_bottom_right, 10, True),  # equal lengths: bottom-right is top-left
        (_bottom_right, 16, False),
        (_random, 10, False),
        (_user_mask, 10, False),
        (_in_place_after, 10, False),
    ],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_hand_written_masks(make_mask, key_length, rewritten, dynamic):
    q = torch.randn(2, 4, 10, 16)
    k, v = torch.randn(2, 4, key_length, 16), torch.randn(2, 4, key_length, 16)
    extra = (_bool_tril(q, k),) if make_mask is _user_mask else ()
    module = Attention(make_mask)
    expected = module(q, k, v, *extra)

    output, result, gm, _ = _compile(module, q, k, v, *extra, dynamic=dynamic)

    assert result.rewritten == int(rewritten), result.kept
    (call,) = _sdpa_calls(gm)
    assert (call.kwargs.get("attn_mask") is None) == rewritten
    torch.testing.assert_close(output, expected)


def test_fully_masked_rows_are_not_causal():
    """A float mask with a -inf diagonal differs from is_causal (rows attend to nothing)."""
    module = Attention(lambda q, k: torch.full((q.shape[-2], k.shape[-2]), float("-inf")).triu(0))
    q = torch.randn(1, 2, 6, 8)
    _, result, _, _ = _compile(module, q, q, q)
    assert result.rewritten == 0


# ------------------------------------------------------------------- export


def test_exported_hf_program_is_rewritten():
    """torch.export always materialises HF's mask; the rewrite applies to the exported (aten) graph."""
    model = _hf_model()
    ids = torch.randint(0, 128, (2, 12))
    expected = model(ids, use_cache=False).logits
    program = torch.export.export(model, (ids,), kwargs={"use_cache": False})

    result = rewrite_causal_masks(program.graph_module)

    assert (result.rewritten, result.ungrouped) == (2, 2)
    calls = _sdpa_calls(program.graph_module)
    assert [(c.kwargs["is_causal"], c.kwargs["attn_mask"], c.kwargs["enable_gqa"]) for c in calls] == [
        (True, None, True)
    ] * 2
    torch.testing.assert_close(program.module()(ids, use_cache=False).logits, expected)


# ---------------------------------------------------- through the real backend


def test_backend_training_step_matches_eager(materialised_hf_mask):
    """fastops_inductor, forward and backward of HF Llama's loss, against eager (fp32 on CPU)."""
    import inductor_ext  # noqa: F401  registers the backend

    model = _hf_model()
    model.train()
    ids = torch.randint(0, 128, (2, 12))
    loss = model(ids, labels=ids).loss
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(model, backend="fastops_inductor", fullgraph=True)
    compiled_loss = compiled(ids, labels=ids).loss
    compiled_loss.backward()

    assert counters["inductor_ext"]["rewrite_causal_mask"] == 2
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-4, atol=1e-5, msg=name)

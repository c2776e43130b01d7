"""The generation step's attention choices (``inductor_ext.runtime.generation.attention``): :func:`folded_sdpa`
and :func:`decode_kernel_attention` equal transformers' SDPA attention for decode- and prefill-shaped
calls with padded masks; the step attends on the cache's own key/value heads with either, and as
transformers does with ``"sdpa"``; packages of both generate transformers' tokens (a strided prompt
too); a bad choice is refused; other attention implementations and the model's setting are left as
they were."""

from unittest import mock

import pytest
import torch

from inductor_ext.bench.train import build_model
from inductor_ext.runtime.generation import export_generation, load_generation
from inductor_ext.runtime.generation.attention import decode_kernel_attention, folded_sdpa, generation_attention
from inductor_ext.runtime.generation.cache_layout import kv_cache_shape, layer_caches
from inductor_ext.runtime.generation.step import GenerationStep

transformers = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward

pytestmark = pytest.mark.xdist_group("generation_attention")  # one worker builds the module's packages once


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny-llama", "cpu", torch.float32).eval()


@pytest.mark.parametrize(("heads", "kv_heads", "tokens"), [(8, 2, 1), (8, 2, 5), (6, 3, 1), (4, 4, 1), (4, 4, 3)])
@pytest.mark.parametrize("mask_rows", ["batch", 1])
@pytest.mark.parametrize("attention", [folded_sdpa, decode_kernel_attention], ids=["folded_sdpa", "decode_attention"])
def test_attention_equals_transformers_sdpa(heads, kv_heads, tokens, mask_rows, attention):
    batch, slots, dim = 3, 11, 16
    mask_rows = batch if mask_rows == "batch" else mask_rows
    generator = torch.Generator().manual_seed(heads * 100 + tokens)
    query = torch.randn(batch, tokens, heads, dim, generator=generator).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, slots, dim, generator=generator) for _ in range(2))
    cache_position = torch.arange(slots - tokens, slots)
    visible = torch.arange(slots)[None, :] <= cache_position[:, None]
    padding = torch.ones(mask_rows, slots, dtype=torch.bool)
    padding[0, :3] = False  # a left-padded row
    mask = visible[None, None] & padding[:, None, None, :]
    module = _Attention(heads // kv_heads)
    with torch.no_grad():
        ours, _ = attention(module, query, key, value, mask, scaling=0.3)
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (batch, tokens, heads, dim) and ours.is_contiguous()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("attention", ["sdpa", "folded_sdpa", "decode_attention"])
def test_the_step_attends_on_the_cache_heads_as_chosen(model, attention, tokens):
    from inductor_ext.ops.decode_attention import decode_attention as op

    config = model.config
    assert config.num_attention_heads > config.num_key_value_heads  # the test needs a grouped-query model
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def recording_sdpa(query, key, value, *args, **kwargs):
        calls.append(("sdpa", query.shape[1], key.shape[1]))
        return sdpa(query, key, value, *args, **kwargs)

    def recording_op(query, key, *args):
        calls.append(("op", query.shape[1], key.shape[1]))
        return op(query, key, *args)

    batch, seq = 2, 16
    cache = layer_caches(torch.zeros(kv_cache_shape(config, batch, seq)), batch)
    ids = torch.randint(3, 200, (batch, tokens))
    step = GenerationStep(model, attention=attention)
    with (
        torch.no_grad(),
        mock.patch("torch.nn.functional.scaled_dot_product_attention", recording_sdpa),
        mock.patch("inductor_ext.runtime.generation.attention.decode_attention", recording_op),
    ):
        step(ids, torch.arange(tokens).expand(batch, tokens), torch.arange(tokens), torch.ones(batch, seq), cache)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if attention == "decode_attention":
        assert calls == [("op", heads, kv_heads)] * config.num_hidden_layers
    elif attention == "folded_sdpa":
        assert calls == [("sdpa", kv_heads, kv_heads)] * config.num_hidden_layers
    else:  # transformers' own (in eager it folds a one-token query itself, pack_gqa)
        assert [call[0] for call in calls] == ["sdpa"] * config.num_hidden_layers
    assert config._attn_implementation == "sdpa"  # restored after the call


@pytest.mark.parametrize("attention", ["folded_sdpa", "decode_attention"])
def test_a_package_generates_transformers_tokens_with_padding(model, tmp_path, attention):
    """One graph, a traced batch and token count (the decode op's splits follow the token count: many for
    a decode step, one for the prompt); a strided prompt (a slice) is read as the same tokens."""
    path = export_generation(model, tmp_path / "model.pt2", max_batch_size=4, max_seq_len=40, attention=attention)
    package = load_generation(path)
    for batch in (2, 4):
        ids = torch.randint(3, model.config.vocab_size, (batch, 9), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        ours = package.generate(ids, 24, attention_mask=mask)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    wider = torch.cat([ids, ids[:, :1]], dim=1)
    torch.testing.assert_close(package.generate(wider[:, :9], 24, attention_mask=mask), ours, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["flash", "", None, 1])
def test_a_bad_attention_choice_is_refused(model, bad, tmp_path):
    with pytest.raises(ValueError, match="attention must be one of 'sdpa', 'folded_sdpa', 'decode_attention'"):
        export_generation(model, tmp_path / "bad.pt2", max_batch_size=2, max_seq_len=8, attention=bad)
    with pytest.raises(ValueError, match="attention must be one of"):
        GenerationStep(model, attention=bad)


@pytest.mark.parametrize(("implementation", "inside"), [("sdpa", "fastops_folded_sdpa"), ("eager", "eager")])
def test_only_sdpa_models_are_switched_and_the_setting_is_restored(implementation, inside):
    model = build_model("tiny-llama", "cpu", torch.float32)
    model.config._attn_implementation = implementation
    with pytest.raises(RuntimeError, match="raised inside"), generation_attention(model, "folded_sdpa") as switched:
        assert model.config._attn_implementation == inside and switched == (implementation == "sdpa")
        raise RuntimeError("raised inside")
    assert model.config._attn_implementation == implementation

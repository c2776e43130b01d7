"""The generation step's optional attention (``inductor_ext.generation.attention``): grouped-query SDPA
with the query heads folded into rows equals transformers' SDPA attention (which repeats the
key/value heads) in float64, for prefill- and decode-shaped calls and padded masks; with
``fold_query_heads`` the step hands SDPA the cache's own key/value heads (without it, repeated ones),
and a folded package generates transformers' tokens; other attention implementations and the
model's setting are left as they were."""

from unittest import mock

import pytest
import torch

from inductor_ext.bench.train import build_model
from inductor_ext.generation import export_generation, load_generation
from inductor_ext.generation.attention import GROUPED_QUERY_SDPA, grouped_query_attention, grouped_query_sdpa
from inductor_ext.generation.cache_layout import kv_cache_shape, layer_caches
from inductor_ext.generation.step import GenerationStep

transformers = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize(("heads", "kv_heads", "tokens"), [(8, 2, 1), (8, 2, 5), (6, 3, 4), (4, 4, 3)])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("mask_rows", ["batch", 1])
def test_folded_attention_equals_transformers_sdpa(heads, kv_heads, tokens, batch, mask_rows):
    slots, dim = 11, 16
    mask_rows = batch if mask_rows == "batch" else mask_rows
    generator = torch.Generator().manual_seed(heads * 100 + tokens)
    query = torch.randn(batch, tokens, heads, dim, dtype=torch.float64, generator=generator).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, slots, dim, dtype=torch.float64, generator=generator) for _ in range(2))
    cache_position = torch.arange(slots - tokens, slots)
    visible = torch.arange(slots)[None, :] <= cache_position[:, None]
    padding = torch.ones(mask_rows, slots, dtype=torch.bool)
    padding[0, :3] = False  # a left-padded row
    mask = visible[None, None] & padding[:, None, None, :]
    module = _Attention(heads // kv_heads)
    ours, _ = grouped_query_sdpa(module, query, key, value, mask, scaling=0.3)
    # transformers folds a one-token query itself outside tracing (pack_gqa); force its repeat_kv path
    with mock.patch(
        "transformers.integrations.sdpa_attention.is_torchdynamo_compiling", return_value=True, create=True
    ):
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (batch, tokens, heads, dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fold", [True, False])
def test_the_folded_step_reads_the_cache_heads_without_repeating_them(fold):
    torch.manual_seed(0)
    model = build_model("tiny-llama", "cpu", torch.float32).eval()
    config = model.config
    assert config.num_attention_heads > config.num_key_value_heads  # the test needs a grouped-query model
    sdpa = torch.nn.functional.scaled_dot_product_attention
    key_heads = []

    def recording_sdpa(query, key, value, *args, **kwargs):
        key_heads.append(key.shape[1])
        return sdpa(query, key, value, *args, **kwargs)

    batch, seq = 2, 16
    cache = layer_caches(torch.zeros(kv_cache_shape(config, batch, seq)), batch)
    ids = torch.randint(3, 200, (batch, 4))
    with torch.no_grad(), mock.patch("torch.nn.functional.scaled_dot_product_attention", recording_sdpa):
        GenerationStep(model, fold_query_heads=fold)(
            ids, torch.arange(4).expand(batch, 4), torch.arange(4), torch.ones(batch, seq), cache
        )
    heads = config.num_key_value_heads if fold else config.num_attention_heads
    assert key_heads == [heads] * config.num_hidden_layers
    assert config._attn_implementation == "sdpa"  # restored after the call


@pytest.mark.parametrize(("implementation", "inside"), [("sdpa", GROUPED_QUERY_SDPA), ("eager", "eager")])
def test_only_sdpa_models_are_switched_and_the_setting_is_restored(implementation, inside):
    model = build_model("tiny-llama", "cpu", torch.float32)
    model.config._attn_implementation = implementation
    with pytest.raises(RuntimeError, match="raised inside"), grouped_query_attention(model):
        assert model.config._attn_implementation == inside
        raise RuntimeError("raised inside")
    assert model.config._attn_implementation == implementation


def test_a_folded_package_generates_transformers_tokens(tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny-llama", "cpu", torch.float32).eval()
    package = load_generation(export_generation(model, tmp_path / "folded.pt2", max_batch_size=3, max_seq_len=40,
                                                fold_query_heads=True))  # fmt: skip
    ids = torch.randint(3, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        theirs = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    ours = package.generate(ids, 24, attention_mask=mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

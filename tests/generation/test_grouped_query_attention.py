"""The generation step's optional attention (``inductor_ext.generation.attention``): grouped-query SDPA,
folded (query heads as rows) or repeated (key/value heads repeated, as transformers does), equals
transformers' SDPA attention in float64 for prefill- and decode-shaped calls and padded masks; the
step hands SDPA the cache's own key/value heads from ``fold_query_heads_from_batch`` rows and repeated
ones below; a package that folds always, and one that chooses by batch at run time (``torch.cond``),
generate transformers' tokens on both sides of the threshold; bad thresholds are refused; other
attention implementations and the model's setting are left as they were."""

from unittest import mock

import pytest
import torch

from inductor_ext.bench.train import build_model
from inductor_ext.generation import export_generation, load_generation
from inductor_ext.generation.attention import (
    FOLD_FROM_BATCH,
    GROUPED_QUERY_SDPA,
    grouped_query_attention,
    grouped_query_sdpa,
)
from inductor_ext.generation.cache_layout import kv_cache_shape, layer_caches
from inductor_ext.generation.step import GenerationStep

transformers = pytest.importorskip("transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny-llama", "cpu", torch.float32).eval()


@pytest.mark.parametrize(("heads", "kv_heads", "tokens"), [(8, 2, 1), (8, 2, 5), (6, 3, 4), (4, 4, 3)])
@pytest.mark.parametrize("mask_rows", ["batch", 1])
@pytest.mark.parametrize(("batch", "from_batch"), [(3, 1), (3, 4)], ids=["folded", "repeated"])
def test_attention_equals_transformers_sdpa(heads, kv_heads, tokens, mask_rows, batch, from_batch):
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
    ours, _ = grouped_query_sdpa(module, query, key, value, mask, scaling=0.3, **{FOLD_FROM_BATCH: from_batch})
    # transformers folds a one-token query itself outside tracing (pack_gqa); force its repeat_kv path
    with mock.patch(
        "transformers.integrations.sdpa_attention.is_torchdynamo_compiling", return_value=True, create=True
    ):
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (batch, tokens, heads, dim) and ours.is_contiguous()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("from_batch", "batch"), [(None, 2), (1, 2), (3, 2), (3, 3)])
def test_the_step_reads_the_cache_heads_without_repeating_them_from_the_batch_asked(model, from_batch, batch):
    config = model.config
    assert config.num_attention_heads > config.num_key_value_heads  # the test needs a grouped-query model
    sdpa = torch.nn.functional.scaled_dot_product_attention
    key_heads = []

    def recording_sdpa(query, key, value, *args, **kwargs):
        key_heads.append(key.shape[1])
        return sdpa(query, key, value, *args, **kwargs)

    seq = 16
    cache = layer_caches(torch.zeros(kv_cache_shape(config, batch, seq)), batch)
    ids = torch.randint(3, 200, (batch, 4))
    step = GenerationStep(model, fold_query_heads_from_batch=from_batch)
    with torch.no_grad(), mock.patch("torch.nn.functional.scaled_dot_product_attention", recording_sdpa):
        step(ids, torch.arange(4).expand(batch, 4), torch.arange(4), torch.ones(batch, seq), cache)
    folds = from_batch is not None and batch >= from_batch
    heads = config.num_key_value_heads if folds else config.num_attention_heads
    assert key_heads == [heads] * config.num_hidden_layers
    assert config._attn_implementation == "sdpa"  # restored after the call


@pytest.mark.parametrize("from_batch", [1, 3])
def test_folding_packages_generate_transformers_tokens(model, tmp_path, from_batch):
    """``from_batch=3``: exported with a traced batch, so the choice is ``torch.cond``'s, at run time."""
    path = export_generation(model, tmp_path / "folded.pt2", max_batch_size=4, max_seq_len=40,
                             fold_query_heads_from_batch=from_batch)  # fmt: skip
    package = load_generation(path)
    for batch in (2, 4):
        ids = torch.randint(3, model.config.vocab_size, (batch, 9), generator=torch.Generator().manual_seed(batch))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        ours = package.generate(ids, 24, attention_mask=mask)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "8"])
def test_a_bad_fold_batch_is_refused(model, bad, tmp_path):
    with pytest.raises(ValueError, match="fold_query_heads_from_batch must be None or an int >= 1"):
        export_generation(model, tmp_path / "bad.pt2", max_batch_size=2, max_seq_len=8, fold_query_heads_from_batch=bad)


@pytest.mark.parametrize(("implementation", "inside"), [("sdpa", GROUPED_QUERY_SDPA), ("eager", "eager")])
def test_only_sdpa_models_are_switched_and_the_setting_is_restored(implementation, inside):
    model = build_model("tiny-llama", "cpu", torch.float32)
    model.config._attn_implementation = implementation
    with pytest.raises(RuntimeError, match="raised inside"), grouped_query_attention(model) as switched:
        assert model.config._attn_implementation == inside and switched == (implementation == "sdpa")
        raise RuntimeError("raised inside")
    assert model.config._attn_implementation == implementation

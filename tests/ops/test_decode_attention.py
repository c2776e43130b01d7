"""Decode attention (``fastops::decode_attention``): the kernels under the interpreter (every config of
the broadcast-sum path) against float64 for grouped-query, multi-query and multi-head shapes, several
tokens, caches across split boundaries, left padding, a token with no visible slot (zeros), padded head
dims, strided queries; the registered op (opcheck, compile on CPU); clear errors for bad input."""

import pytest
import torch

from inductor_ext.kernels.decode_attention import KEYS_PER_SPLIT, partial_configs
from inductor_ext.ops.decode_attention import decode_attention, decode_attention_ref
from inductor_ext.tuning.launch_settings import force_launch_config
from tests.tolerances import OUTPUT, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(batch, heads, kv_heads, tokens, slots, dim, dtype, *, strided_query=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if strided_query:  # as transformers hands it over: (b, t, heads, d) viewed as (b, heads, t, d)
        query = torch.randn(batch, tokens, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    else:
        query = torch.randn(batch, heads, tokens, dim, generator=generator).to(dtype)
    key, value = (torch.randn(batch, kv_heads, slots, dim, generator=generator).to(dtype) for _ in range(2))
    filled = slots - 7  # a static cache's unfilled tail
    mask = torch.zeros(batch, tokens, slots, dtype=torch.bool)
    for i in range(tokens):
        mask[:, i, : filled - tokens + 1 + i] = True  # causal over the filled slots
    mask[0, :, :19] = False  # a left-padded row
    return query, key, value, mask


def _check(query, key, value, mask, scale=None):
    ours = decode_attention(query, key, value, mask, scale)
    ref = decode_attention_ref(query, key, value, mask, scale)
    assert ours.shape == query.shape and ours.dtype == query.dtype and ours.is_contiguous()
    assert rel_err(ours, ref) < OUTPUT[query.dtype], rel_err(ours, ref)
    return ours


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(8, 2, 64), (6, 1, 40), (4, 4, 16)], ids=["gqa", "mqa-pad", "mha"]
)
def test_every_config_matches_float64(heads, kv_heads, dim):
    configs = partial_configs(False)
    assert configs and all(KEYS_PER_SPLIT % c.kwargs["BLOCK_N"] == 0 for c in configs)
    for config in configs:
        with force_launch_config(config.all_kwargs()):
            _check(*_inputs(2, heads, kv_heads, 1, 2 * KEYS_PER_SPLIT + 45, dim, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 6], ids=["decode-5-splits", "3-tokens-2-splits", "prompt-1-split"])
def test_matches_float64(dtype, tokens):
    """One token gets many splits of the cache, a prompt one (``splits = max(1, ceil(S / 128) // t)``)."""
    slots = 4 * KEYS_PER_SPLIT + 30
    _check(*_inputs(2, 8, 2, tokens, slots, 32, dtype, strided_query=True, seed=tokens), scale=0.2)


def test_a_token_with_no_visible_slot_gets_zeros_and_other_rows_are_unaffected():
    query, key, value, mask = _inputs(2, 4, 2, 2, 50, 16, torch.float32)
    mask[1, 0] = False
    ours = _check(query, key, value, mask)
    assert torch.equal(ours[1, :, 0], torch.zeros_like(ours[1, :, 0]))
    assert ours[1, :, 1].abs().sum() > 0


def test_masked_slots_are_not_read():
    """Keys and values of invisible slots may hold anything (an unfilled cache, NaN included)."""
    query, key, value, mask = _inputs(2, 4, 2, 1, 3 * KEYS_PER_SPLIT, 16, torch.float32)
    clean = decode_attention(query, key, value, mask)
    key[~mask[:, 0][:, None, :].expand_as(key[..., 0])] = float("nan")
    value[~mask[:, 0][:, None, :].expand_as(value[..., 0])] = float("nan")
    torch.testing.assert_close(decode_attention(query, key, value, mask), clean, rtol=0, atol=0)


def test_the_registered_op_passes_opcheck_and_compiles_on_cpu():
    query, key, value, mask = _inputs(2, 4, 2, 1, 40, 16, torch.float32, strided_query=True)
    torch.library.opcheck(torch.ops.fastops.decode_attention.default, (query, key, value, mask, 0.25))
    compiled = torch.compile(decode_attention, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(query, key, value, mask), decode_attention_ref(query, key, value, mask).float()
        )


def _bad(name):
    query, key, value, mask = _inputs(2, 4, 2, 1, 20, 16, torch.float32)
    return {
        "rank": (query[0], key, value, mask),
        "heads": (query, key[:, :1].expand(2, 3, 20, 16), value[:, :1].expand(2, 3, 20, 16), mask),
        "mask dtype": (query, key, value, mask.long()),
        "mask shape": (query, key, value, mask[:, :, :10]),
        "dtype": (query, key.half(), value, mask),
        "float64": (query.double(), key.double(), value.double(), mask),
        "head dim": (*(torch.zeros(1, 1, 1, 512) for _ in range(3)), torch.ones(1, 1, 1, dtype=torch.bool)),
        "not a tensor": (query, key, value, None),
    }[name]


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("rank", ValueError, "query must be"),
        ("heads", ValueError, "kv_heads dividing"),
        ("mask dtype", ValueError, "mask must be a bool"),
        ("mask shape", ValueError, "mask must be a bool"),
        ("dtype", TypeError, "must share one of"),
        ("float64", TypeError, "must share one of"),
        ("head dim", ValueError, "head dim 512"),
        ("not a tensor", TypeError, "mask must be a tensor"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(name, error, match):
    with pytest.raises(error, match=match):
        decode_attention(*_bad(name))


def test_a_gradient_is_refused():
    query, key, value, mask = _inputs(1, 2, 1, 1, 8, 16, torch.float32)
    with pytest.raises(RuntimeError, match="inference only"):
        decode_attention(query.requires_grad_(), key, value, mask)

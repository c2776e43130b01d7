"""Decode attention on a real GPU: the ``tl.dot`` path (bf16, fp16) and the float32 path, every config,
against float64 on real shapes (Llama-3.2-1B and 8B, Qwen2.5-1.5B's group of 6, a batch of 64, a prompt), as
close to it as SDPA of the same inputs in the same dtype; compiled (the traced launch, Inductor's
tuning) as close; masked slots never read."""

import pytest
import torch
import torch.nn.functional as F

from inductor_ext.kernels.decode_attention import decode_attention_partial_kernel, decode_attention_partial_sum_kernel
from inductor_ext.ops.decode_attention import decode_attention, decode_attention_ref
from inductor_ext.tuning.launch_settings import force_launch_config
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (batch, heads, kv_heads, tokens, slots, head dim)
CASES = [
    (1, 32, 8, 1, 2113, 64),
    (64, 32, 8, 1, 1100, 128),
    (4, 12, 2, 2, 777, 128),
    (2, 8, 8, 1, 300, 80),
    (2, 32, 8, 300, 340, 64),
]  # the last: a prompt (one split, blocks of 16 tokens)


def _inputs(batch, heads, kv_heads, tokens, slots, dim, dtype):
    query = torch.randn(batch, tokens, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, slots, dim, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.zeros(batch, tokens, slots, dtype=torch.bool, device="cuda")
    filled = slots - 40
    for i in range(tokens):
        mask[:, i, : filled - tokens + 1 + i] = True
    mask[0, :, :100] = False  # left padding
    return query, key, value, mask


def _sdpa(query, key, value, mask):
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64_as_closely_as_sdpa(case, dtype):
    inputs = _inputs(*case, dtype)
    ref = decode_attention_ref(*inputs)
    bound = 1.5 * rel_err(_sdpa(*inputs), ref) + 1e-6
    kernel = decode_attention_partial_sum_kernel if dtype == torch.float32 else decode_attention_partial_kernel
    for config in kernel.configs:
        with force_launch_config(config.all_kwargs()):
            out = decode_attention(*inputs)
        assert out.dtype == dtype and rel_err(out, ref) <= bound, (config, rel_err(out, ref), bound)


def test_compiled_matches_float64_and_masked_slots_are_not_read():
    query, key, value, mask = _inputs(*CASES[0], torch.bfloat16)
    ref = decode_attention_ref(query, key, value, mask)
    bound = 1.5 * rel_err(_sdpa(query, key, value, mask), ref) + 1e-6
    hidden = ~mask[0, 0]  # row 0's invisible slots: its left padding and the unfilled tail
    key[0][:, hidden], value[0][:, hidden] = float("nan"), float("nan")
    compiled = torch.compile(decode_attention, fullgraph=True)
    with torch.no_grad():
        out = compiled(query, key, value, mask)
    assert rel_err(out, ref) <= bound, (rel_err(out, ref), bound)  # NaN fails it

"""Document-causal attention (inductor_ext.ops.document_attention): the block mask (key and query
tables) against FlexAttention's own ``create_block_mask``, the attention against float64 masked SDPA, bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch.nn.attention.flex_attention import create_block_mask
from transformers.masking_utils import find_packed_sequence_indices

from inductor_ext.ops.document_attention import (
    _document_causal_mod,
    _ordered,
    document_block_mask,
    document_causal_attention,
    document_causal_mask_ref,
    document_ids,
)
from tests.packed_positions import random_packed_positions


def test_document_ids_are_transformers_packed_sequence_indices():
    generator = torch.Generator().manual_seed(0)
    positions = random_packed_positions(3, 200, generator)
    positions[1, 50:60] += 4  # a jump inside a document starts a new one, as in transformers
    assert torch.equal(document_ids(positions), find_packed_sequence_indices(positions))


@pytest.mark.parametrize("length", [1, 127, 128, 300, 513])
@pytest.mark.parametrize("block_size", [64, 128])
def test_block_mask_matches_create_block_mask(length, block_size):
    """Key tables (forward) and query tables (backward), counts equal and the same blocks listed."""
    generator = torch.Generator().manual_seed(length)
    for batch, longest in ((2, 2), (2, 40), (4, 400), (3, 300)):
        positions = random_packed_positions(batch, length, generator, longest)
        doc = document_ids(positions)
        ours = document_block_mask(doc, _document_causal_mod, block_size)
        expected = create_block_mask(
            lambda b, h, q, kv, doc=doc: (q >= kv) & (doc[b, q] == doc[b, kv]), batch, None, length, length,
            device="cpu", BLOCK_SIZE=block_size,
        )  # fmt: skip
        tables = ("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")
        tables += ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")
        for count_name, indices_name in tables:
            count, got, want = (getattr(ours, count_name), getattr(ours, indices_name), getattr(expected, indices_name))
            assert torch.equal(count, getattr(expected, count_name)), count_name
            for b in range(batch):
                for row in range(count.shape[-1]):
                    n = int(count[b, 0, row])
                    assert got[b, 0, row, :n].tolist() == sorted(want[b, 0, row, :n].tolist()), indices_name


def test_ordered_lists_set_columns_in_order_without_a_sort():
    generator = torch.Generator().manual_seed(5)
    blocks = torch.rand(3, 1, 9, 9, generator=generator) < 0.4
    blocks[0, 0, 0] = False  # an empty row
    blocks[0, 0, 1] = True  # a full row
    count, indices = _ordered(blocks)
    for row, n, listed in zip(blocks.flatten(0, 2), count.flatten(), indices.flatten(0, 2), strict=True):
        columns = row.nonzero().flatten().tolist()
        assert int(n) == len(columns) and listed.tolist() == columns + [0] * (9 - len(columns))
    assert count.dtype == indices.dtype == torch.int32


def _qkv(batch, heads, kv_heads, length, dim, dtype=torch.float32, grad=True):
    return [torch.randn(batch, h, length, dim, dtype=dtype, requires_grad=grad) for h in (heads, kv_heads, kv_heads)]


def _reference(q, k, v, positions, **kwargs):
    mask = document_causal_mask_ref(positions)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)


def test_flex_forward_matches_float64_reference():
    """FlexAttention's unfused CPU math on our block mask (CPU flex has no backward)."""
    generator = torch.Generator().manual_seed(1)
    positions = random_packed_positions(2, 300, generator)
    q, k, v = _qkv(2, 4, 2, 300, 16, grad=False)
    out = document_causal_attention(q, k, v, positions, enable_gqa=True, use_flex=True)
    expected = _reference(*(t.double() for t in (q, k, v)), positions, enable_gqa=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_flex_forward_and_backward_under_make_fx():
    """The path the backend's rewrite takes: AOTAutograd traces the higher-order op, forward and backward."""
    generator = torch.Generator().manual_seed(2)
    positions = random_packed_positions(1, 200, generator)
    q, k, v = _qkv(1, 4, 2, 200, 16)
    grad = torch.randn(1, 4, 200, 16)

    def attention(q, k, v, positions):
        return document_causal_attention(q, k, v, positions, scale=0.3, enable_gqa=True, use_flex=True)

    compiled = aot_function(attention, fw_compiler=lambda g, _: make_boxed_func(g.forward))
    got = torch.autograd.grad(compiled(q, k, v, positions), (q, k, v), grad)
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(
        _reference(*reference, positions, scale=0.3, enable_gqa=True), reference, grad.double()
    )
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_cpu_path_gradients_match_float64_reference():
    generator = torch.Generator().manual_seed(3)
    positions = random_packed_positions(2, 77, generator, longest=20)
    q, k, v = _qkv(2, 4, 4, 77, 8)
    grad = torch.randn(2, 4, 77, 8)
    got = torch.autograd.grad(document_causal_attention(q, k, v, positions), (q, k, v), grad)
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(_reference(*reference, positions), reference, grad.double())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("query_3d", "must be 4-D"),
        ("key_length", "key .* and value"),
        ("heads", "heads"),
        ("positions_shape", "position_ids must be"),
        ("positions_float", "must hold integers"),
    ],
)
def test_bad_inputs(change, message):
    q, k, v = _qkv(1, 4, 2, 10, 8, grad=False)
    positions = torch.arange(10)[None]
    enable_gqa = True
    if change == "query_3d":
        q = q[0]
    elif change == "key_length":
        k = k[:, :, :5]
    elif change == "heads":
        enable_gqa = False
    elif change == "positions_shape":
        positions = positions[:, :5]
    elif change == "positions_float":
        positions = positions.float()
    with pytest.raises(ValueError, match=message):
        document_causal_attention(q, k, v, positions, enable_gqa=enable_gqa)


def test_flex_runs_on_cuda_only_where_gradients_are_needed():
    """Forward-only graphs keep the materialised mask (``flex_is_trusted``: FlexAttention on these block
    tables was wrong in compiled inference graphs on the H200)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from inductor_ext.ops.document_attention import flex_is_trusted

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(1, 2, 8, 4, device="cuda") for _ in range(3))
        assert not flex_is_trusted(q, k, v)
        k.requires_grad_()
        assert flex_is_trusted(q, k, v)
        with torch.no_grad():
            assert not flex_is_trusted(q, k, v)
    leaf = torch.randn(1, 2, 8, 4, requires_grad=True)
    assert not flex_is_trusted(leaf, leaf, leaf)

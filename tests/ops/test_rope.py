"""RoPE: kernel numerics (every config, under the interpreter on CPU), HF conventions, the in-place
form, op registration, bad input, and torch.compile / cpp_wrapper / AOTInductor through the CPU branch."""

import pytest
import torch
import triton
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext
from inductor_ext.kernels.rope import search_space
from inductor_ext.ops.rope import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_,
    apply_rotary_pos_emb_ref,
    rope_family,
)
from inductor_ext.tuning.launch_settings import force_launch_config
from tests.conftest import DEVICE
from tests.tolerances import OUTPUT, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TABLES = ["batch", "shared3d", "shared2d", "positions"]


def _heads(batch, heads, seq, dim, unsqueeze_dim, dtype=torch.float32, hf_transposed=False):
    """q or k in the layout of unsqueeze_dim; hf_transposed: a (B, S, H, D) projection viewed as (B, H, S, D)."""
    if unsqueeze_dim == 1 and hf_transposed:
        return torch.randn(batch, seq, heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)
    shape = (batch, heads, seq, dim) if unsqueeze_dim == 1 else (batch, seq, heads, dim)
    return torch.randn(shape, device=DEVICE, dtype=dtype)


def _tables(kind, batch, seq, rot, dtype=torch.float32, hf=False, n_positions=50):
    """(cos, sin, position_ids). Random tables whose halves differ (checks the exact transpose in
    the backward) unless hf: HF's cat(freqs, freqs) tables."""
    rows = {"batch": (batch, seq), "shared3d": (1, seq), "shared2d": (seq,), "positions": (n_positions,)}[kind]
    if hf:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot))
        pos = torch.arange(rows[-1], device=DEVICE).float() + (torch.rand(rows[:-1] + (1,), device=DEVICE) * 100)
        emb = torch.cat([pos[..., None] * inv_freq] * 2, -1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    else:
        cos = torch.randn(*rows, rot, device=DEVICE).to(dtype)
        sin = torch.randn(*rows, rot, device=DEVICE).to(dtype)
    position_ids = torch.randint(0, n_positions, (batch, seq), device=DEVICE) if kind == "positions" else None
    return cos, sin, position_ids


def _fwd_bwd(f, q, k, cos, sin, position_ids, unsqueeze_dim, dq, dk):
    q = q.detach().clone().requires_grad_()
    k = k.detach().clone().requires_grad_()
    q_embed, k_embed = f(q, k, cos, sin, position_ids, unsqueeze_dim)
    return (q_embed, k_embed, *torch.autograd.grad((q_embed, k_embed), (q, k), (dq, dk)))


def _check_against_float64(
    heads=(5, 3), batch=2, seq=7, dim=16, rot=16, dtype=torch.float32, table="batch", unsqueeze_dim=1, hf=False,
    hf_transposed=False,
):  # fmt: skip
    q = _heads(batch, heads[0], seq, dim, unsqueeze_dim, dtype, hf_transposed)
    k = _heads(batch, heads[1], seq, dim, unsqueeze_dim, dtype, hf_transposed)
    cos, sin, position_ids = _tables(table, batch, seq, rot, dtype, hf)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    ours = _fwd_bwd(apply_rotary_pos_emb, q, k, cos, sin, position_ids, unsqueeze_dim, dq, dk)
    args64 = (q.double(), k.double(), cos.double(), sin.double(), position_ids, unsqueeze_dim, dq.double(), dk.double())
    ref = _fwd_bwd(apply_rotary_pos_emb_ref, *args64)
    for name, o, r in zip(("q_embed", "k_embed", "dq", "dk"), ours, ref):
        assert o.shape == r.shape and o.dtype == dtype, name
        assert torch.isfinite(o).all(), name
        assert rel_err(o, r) < OUTPUT[dtype], (name, rel_err(o, r))
    return q, k, cos, sin, ours


@pytest.mark.parametrize(
    "heads,dim,rot", [((5, 3), 16, 16), ((4, 1), 24, 16), ((2, 6), 40, 24)], ids=["gqa", "mqa-partial", "odd-half"]
)
def test_every_config_matches_float64(heads, dim, rot):
    """Each config the autotuner may pick for these head counts and head dim (layouts alternate)."""
    pass_pad = triton.next_power_of_2(dim - rot) if dim > rot else 0
    configs = search_space(*heads, triton.next_power_of_2(rot // 2), pass_pad)
    assert configs
    for i, config in enumerate(configs):
        with force_launch_config(config.to_triton().all_kwargs()):
            _check_against_float64(heads, dim=dim, rot=rot, unsqueeze_dim=1 + i % 2, table="positions")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("table", TABLES)
def test_matches_float64(table, dtype):
    _check_against_float64(dtype=dtype, table=table, unsqueeze_dim=1 if table != "shared3d" else 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hf_tables_and_layout_match_hf_and_keep_strides(dtype):
    """HF's cos/sin (cat(freqs, freqs), (B, S, D)) on q/k transposed from a projection, as LlamaAttention does:
    runs on the strided views without a copy (outputs have q's and k's strides)."""
    q, k, cos, sin, ours = _check_against_float64(
        (8, 2), batch=2, seq=33, dim=64, rot=64, dtype=dtype, hf=True, hf_transposed=True
    )
    assert not q.is_contiguous()
    assert ours[0].stride() == q.stride() and ours[1].stride() == k.stride()
    q_hf, k_hf = apply_rotary_pos_emb_ref(q, k, cos, sin)  # HF's own rounding in the low-precision dtype
    assert rel_err(ours[0], q_hf) < 2 * OUTPUT[dtype] and rel_err(ours[1], k_hf) < 2 * OUTPUT[dtype]


def test_partial_rotary_passes_the_rest_through_bitwise():
    q = _heads(2, 3, 5, 40, 1)
    k = _heads(2, 1, 5, 40, 1)
    cos, sin, _ = _tables("batch", 2, 5, 16)
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q_embed[..., 16:], q[..., 16:]) and torch.equal(k_embed[..., 16:], k[..., 16:])
    assert not torch.allclose(q_embed[..., :16], q[..., :16])


def test_position_ids_broadcast_shapes_match_reference():
    q, k = _heads(3, 4, 6, 16, 2), _heads(3, 2, 6, 16, 2)
    cos, sin, _ = _tables("positions", 3, 6, 16)
    for position_ids in (torch.arange(6) + 10, torch.arange(6)[None] * 3, torch.randint(0, 50, (3, 6))):
        position_ids = position_ids.to(DEVICE)
        ours = apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=2)
        ref = apply_rotary_pos_emb_ref(q, k, cos, sin, position_ids, unsqueeze_dim=2)
        for o, r in zip(ours, ref):
            assert rel_err(o, r) < OUTPUT[torch.float32]
    # with 3-D tables HF ignores position_ids, and so do we
    cos3, sin3, _ = _tables("batch", 3, 6, 16)
    ours = apply_rotary_pos_emb(q, k, cos3, sin3, torch.full((3, 6), 10**6), unsqueeze_dim=2)
    ref = apply_rotary_pos_emb_ref(q, k, cos3, sin3, None, unsqueeze_dim=2)
    assert rel_err(ours[0], ref[0]) < OUTPUT[torch.float32]


def test_out_of_range_positions_error_on_cpu_and_give_nan_rows_in_the_kernel():
    q, k = _heads(2, 2, 4, 8, 1), _heads(2, 1, 4, 8, 1)
    cos, sin, _ = _tables("positions", 2, 4, 8, n_positions=10)
    bad = torch.tensor([[0, 1, 10, 3], [-1, 2, 2, 9]], device=DEVICE)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"position_ids must be in \[0, 10\).*\[-1, 10\]"):
            apply_rotary_pos_emb(q, k, cos, sin, bad)
    # below the public check: the GPU behaviour (kernels), and the aten math agrees
    for q_embed, _ in (rope_family(q, k, cos, sin, bad, 1), torch.ops.fastops.rope_fwd(q, k, cos, sin, bad, 1)):
        nan_tokens = torch.isnan(q_embed).any(-1).any(1)  # (B, S)
        expected = torch.tensor([[False, False, True, False], [True, False, False, False]], device=DEVICE)
        assert torch.equal(nan_tokens, expected)
        assert torch.isnan(q_embed[0, :, 2]).all()


def test_in_place_matches_functional_and_mutates_the_inputs():
    q = _heads(2, 4, 9, 24, 1, hf_transposed=True)
    k = _heads(2, 2, 9, 24, 1, hf_transposed=True)
    cos, sin, position_ids = _tables("positions", 2, 9, 16)
    expected = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    q_storage, k_storage = q.data_ptr(), k.data_ptr()
    q_pass = q[..., 16:].clone()
    with torch.no_grad():
        out = apply_rotary_pos_emb_(q, k, cos, sin, position_ids)
    assert out[0] is q and out[1] is k and q.data_ptr() == q_storage and k.data_ptr() == k_storage
    torch.testing.assert_close(q, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(k, expected[1], rtol=0, atol=0)
    assert torch.equal(q[..., 16:], q_pass)
    # through the registered op (what tracing sees): the same
    q2, k2 = _heads(2, 4, 9, 24, 2), _heads(2, 2, 9, 24, 2)
    expected = apply_rotary_pos_emb_ref(q2, k2, cos, sin, position_ids, 2)
    torch.ops.fastops.rope_inplace(q2, k2, cos, sin, position_ids, 2)
    assert rel_err(q2, expected[0]) < OUTPUT[torch.float32] and rel_err(k2, expected[1]) < OUTPUT[torch.float32]


def test_in_place_with_non_unit_last_stride():
    base = torch.randn(2, 3, 16, 5, device=DEVICE)
    q = base.transpose(-1, -2)  # (2, 3, 5, 16), last stride 5
    k = _heads(2, 1, 5, 16, 1)
    cos, sin, _ = _tables("batch", 2, 5, 16)
    expected = apply_rotary_pos_emb_ref(q, k, cos, sin)
    with torch.no_grad():
        apply_rotary_pos_emb_(q, k, cos, sin)
    assert q.data_ptr() == base.data_ptr()
    assert rel_err(q, expected[0]) < OUTPUT[torch.float32] and rel_err(k, expected[1]) < OUTPUT[torch.float32]


def test_in_place_schema_declares_the_mutation():
    schema = torch.ops.fastops.rope_inplace.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["q", "k"]
    assert len(schema.returns) == 0
    functional = torch.ops.fastops.rope_fwd.default._schema
    assert not any(a.alias_info is not None for a in functional.arguments)


def test_every_output_element_written():
    empty_like = torch.empty_like

    def poisoned_empty_like(t, *a, **k):
        return empty_like(t, *a, **k).fill_(float("nan"))

    q = _heads(3, 5, 11, 40, 1, hf_transposed=True)
    k = _heads(3, 2, 11, 40, 1, hf_transposed=True)
    cos, sin, _ = _tables("shared3d", 3, 11, 24)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty_like", poisoned_empty_like)
        assert torch.isnan(torch.empty_like(q)).all()  # the poison is in place
        outputs = _fwd_bwd(apply_rotary_pos_emb, q, k, cos, sin, None, 1, torch.randn_like(q), torch.randn_like(k))
    for t in outputs:
        assert torch.isfinite(t).all()


def test_gradient_of_one_output_only():
    """The eager path gets None for the unused output's gradient: k's gradient is then zero."""
    q = _heads(1, 2, 5, 8, 1).requires_grad_()
    k = _heads(1, 1, 5, 8, 1).requires_grad_()
    cos, sin, _ = _tables("batch", 1, 5, 8)
    q_embed, _ = apply_rotary_pos_emb(q, k, cos, sin)
    q_embed.square().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert k.grad is None or not k.grad.any()


def test_non_unit_last_stride_and_expanded_gradient():
    q = torch.randn(2, 3, 16, 6, device=DEVICE).transpose(-1, -2)  # (2, 3, 6, 16), last stride 6: copied
    k = torch.randn(2, 1, 6, 16, device=DEVICE)
    cos, sin, _ = _tables("batch", 2, 6, 16)
    for o, r in zip(apply_rotary_pos_emb(q, k, cos, sin), apply_rotary_pos_emb_ref(q, k, cos, sin)):
        assert rel_err(o, r) < OUTPUT[torch.float32]
    # sum() hands the backward an expanded (all-zero-stride) gradient
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    ours = torch.autograd.grad(sum(t.sum() for t in apply_rotary_pos_emb(q, k, cos, sin)), (q, k))
    ref = torch.autograd.grad(sum(t.sum() for t in apply_rotary_pos_emb_ref(q, k, cos, sin)), (q, k))
    for o, r in zip(ours, ref):
        assert rel_err(o, r) < OUTPUT[torch.float32]


@pytest.mark.parametrize("batch,seq", [(0, 5), (2, 0)])
def test_zero_size(batch, seq):
    q = _heads(batch, 2, seq, 8, 1).requires_grad_()
    k = _heads(batch, 1, seq, 8, 1).requires_grad_()
    cos, sin, _ = _tables("shared2d", batch, seq, 8)
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    with torch.no_grad():
        apply_rotary_pos_emb_(q.detach(), k.detach(), cos, sin)


def _good_args():
    return {
        "q": torch.randn(2, 4, 5, 8),
        "k": torch.randn(2, 2, 5, 8),
        "cos": torch.randn(2, 5, 8),
        "sin": torch.randn(2, 5, 8),
        "position_ids": None,
        "unsqueeze_dim": 1,
    }


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"q": [1.0]}, TypeError, "q must be a Tensor"),
        ({"q": torch.ones(2, 4, 5, 8, dtype=torch.int32)}, TypeError, "q must be float32, bfloat16 or float16"),
        ({"k": torch.ones(2, 2, 5, 8, dtype=torch.bfloat16)}, TypeError, "k must have q's dtype"),
        ({"k": torch.ones(2, 2, 5, 8, device="meta")}, ValueError, "k is on meta but q is on"),
        ({"q": torch.ones(2, 4, 5)}, ValueError, r"q must be 4-D \(B, H, S, D\) for unsqueeze_dim=1"),
        ({"k": torch.ones(2, 2, 6, 8)}, ValueError, "k must match q's batch, sequence and head dims"),
        ({"sin": torch.ones(2, 5, 6)}, ValueError, "sin must have cos's shape"),
        ({"cos": torch.ones(5, 5, 8, 1), "sin": torch.ones(5, 5, 8, 1)}, ValueError, "cos must be"),
        ({"cos": torch.ones(2, 5, 7), "sin": torch.ones(2, 5, 7)}, ValueError,
         r"rotary dim\) must be even and in \[2, 8\]"),
        ({"cos": torch.ones(2, 5, 10), "sin": torch.ones(2, 5, 10)}, ValueError, "must be even and in"),
        ({"cos": torch.ones(3, 5, 8), "sin": torch.ones(3, 5, 8)}, ValueError, r"cos must be \(1 or 2, 5, R\)"),
        ({"cos": torch.ones(6, 8), "sin": torch.ones(6, 8)}, ValueError, r"cos must be \(5, R\) to match"),
        ({"cos": torch.ones(9, 8), "sin": torch.ones(9, 8), "position_ids": torch.ones(2, 5)}, TypeError,
         "position_ids must be int32 or int64"),
        ({"cos": torch.ones(9, 8), "sin": torch.ones(9, 8), "position_ids": torch.ones(3, 5, dtype=torch.long)},
         ValueError, r"position_ids must be \(5,\), \(1, 5\) or \(2, 5\)"),
        ({"unsqueeze_dim": 3}, ValueError, "unsqueeze_dim must be 1"),
        ({"q": torch.ones(2, 4, 5, 2048), "k": torch.ones(2, 2, 5, 2048)}, ValueError, "head dim must be at most 1024"),
        ({"cos": torch.ones(2, 5, 8, requires_grad=True)}, ValueError, "cos and sin must not require grad"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(change, error, match):
    args = {**_good_args(), **change}
    with pytest.raises(error, match=match):
        apply_rotary_pos_emb(**args)


def test_in_place_bad_input():
    args = _good_args()
    with pytest.raises(ValueError, match="q and k must not require grad"):
        apply_rotary_pos_emb_(**{**args, "q": args["q"].requires_grad_()})
    args = _good_args()
    with pytest.raises(ValueError, match="k has elements sharing memory"):
        apply_rotary_pos_emb_(**{**args, "k": args["k"][:, :1].expand(2, 2, 5, 8)})
    with pytest.raises(TypeError, match="would promote q's"):
        apply_rotary_pos_emb_(**{**args, "q": args["q"].bfloat16(), "k": args["k"].bfloat16()})


def test_opcheck_all_ops():
    ops = torch.ops.fastops
    cos, sin, position_ids = _tables("positions", 2, 5, 8)
    q = _heads(2, 4, 5, 12, 1, hf_transposed=True).requires_grad_()
    k = _heads(2, 2, 5, 12, 1, hf_transposed=True).requires_grad_()
    torch.library.opcheck(ops.rope_fwd.default, (q, k, cos, sin, position_ids, 1))
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    torch.library.opcheck(ops.rope_bwd.default, (dq, dk, cos, sin, position_ids, 1))
    q, k = _heads(2, 4, 5, 12, 2), _heads(2, 2, 5, 12, 2)
    torch.library.opcheck(ops.rope_inplace.default, (q, k, cos[:5], sin[:5], None, 2))
    # the other layout and table kind, without the (slow) AOT-dispatch checks
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.rope_fwd.default, (q.requires_grad_(), k, cos[:5], sin[:5], None, 2), test_utils=quick)


def test_eager_bypasses_the_dispatcher():
    q = _heads(1, 2, 4, 8, 1).requires_grad_()
    k = _heads(1, 1, 4, 8, 1).requires_grad_()
    cos, sin, _ = _tables("batch", 1, 4, 8)

    def step():
        q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
        (q_embed.sum() + k_embed.sum()).backward()
        with torch.no_grad():
            apply_rotary_pos_emb_(q.detach().clone(), k.detach().clone(), cos, sin)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = {e.name for e in prof.events()}
    assert not any(n.startswith("fastops::") for n in names), names
    assert any("rope_eager" in n for n in names), names


# torch.compile, cpp_wrapper and AOTInductor on CPU: the compiled graphs run the ops' CPU
# branch (aten math compiled to C++) while eager runs the interpreted kernels.


def _compiled_matches_eager(f, compiled, shapes, unsqueeze_dim=1, table="batch"):
    for batch, seq in shapes:
        q = _heads(batch, 4, seq, 24, unsqueeze_dim, hf_transposed=True)
        k = _heads(batch, 2, seq, 24, unsqueeze_dim, hf_transposed=True)
        cos, sin, position_ids = _tables(table, batch, seq, 16)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        got = _fwd_bwd(compiled, q, k, cos, sin, position_ids, unsqueeze_dim, dq, dk)
        expected = _fwd_bwd(f, q, k, cos, sin, position_ids, unsqueeze_dim, dq, dk)
        for name, o, e in zip(("q_embed", "k_embed", "dq", "dk"), got, expected):
            assert o.shape == e.shape and o.dtype == e.dtype, name
            assert rel_err(o, e) < OUTPUT[torch.float32], (name, rel_err(o, e))


def test_fullgraph_static_compile_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, dynamic=False)
    _compiled_matches_eager(apply_rotary_pos_emb, compiled, [(2, 7)], table="positions")
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_fullgraph_dynamic_compile_one_graph_for_two_lengths():
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, dynamic=True)
    # batch and length coincide with no other size (duck sizing would specialise on equal sizes)
    _compiled_matches_eager(apply_rotary_pos_emb, compiled, [(3, 7), (5, 11)], unsqueeze_dim=2)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0


def test_fullgraph_compile_of_the_in_place_form():
    torch._dynamo.reset()
    counters.clear()

    def f(q, k, cos, sin):
        apply_rotary_pos_emb_(q, k, cos, sin)
        return q * 2, k

    q, k = _heads(2, 4, 6, 16, 1), _heads(2, 2, 6, 16, 1)
    cos, sin, _ = _tables("batch", 2, 6, 16)
    expected = apply_rotary_pos_emb_ref(q, k, cos, sin)
    with torch.no_grad():
        q_out, k_out = torch.compile(f, fullgraph=True)(q, k, cos, sin)
    assert sum(counters["graph_break"].values()) == 0
    assert rel_err(q, expected[0]) < OUTPUT[torch.float32] and rel_err(k, expected[1]) < OUTPUT[torch.float32]
    assert rel_err(q_out, 2 * expected[0]) < OUTPUT[torch.float32] and k_out is k


def test_cpp_wrapper_matches_eager():
    torch._dynamo.reset()
    counters.clear()
    q, k = _heads(2, 4, 6, 16, 1).requires_grad_(), _heads(2, 2, 6, 16, 1).requires_grad_()
    cos, sin, _ = _tables("shared2d", 2, 6, 16)

    def step(f):
        q_embed, k_embed = f(q, k, cos, sin)
        return (q_embed, k_embed, *torch.autograd.grad((q_embed.square().sum() + k_embed.sum()), (q, k)))

    with torch._inductor.config.patch(cpp_wrapper=True):
        got, codes = run_and_get_code(step, torch.compile(apply_rotary_pos_emb, fullgraph=True))
    assert len(codes) == 2 and all("cpp_wrapper_src" in code and "def call(" not in code for code in codes)
    assert sum(counters["graph_break"].values()) == 0
    for o, e in zip(got, step(apply_rotary_pos_emb)):
        assert rel_err(o, e) < OUTPUT[torch.float32]


class _Attention(torch.nn.Module):
    """The RoPE part of LlamaAttention: q/k projections viewed as heads and transposed, then rotated."""

    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = inductor_ext.apply_rotary_pos_emb(q, k, cos, sin)
        return q.sum(1) + k.sum(1)


def test_aoti_package_keeps_the_op_and_matches_eager(tmp_path):
    model = _Attention().eval()
    x = torch.randn(2, 6, 32)
    cos, sin, _ = _tables("batch", 2, 6, 8, hf=True)
    ep = torch.export.export(model, (x, cos, sin))
    assert torch.ops.fastops.rope_fwd.default in [n.target for n in ep.graph.nodes]
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "rope.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        for inputs in (x, torch.randn_like(x)):
            assert rel_err(runner(inputs, cos, sin), model(inputs, cos, sin)) < OUTPUT[torch.float32]

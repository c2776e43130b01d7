"""RoPE on a real GPU: numerics on real shapes and layouts, every config, the in-place form (autotuned
without rotating twice, and compiled), NaN rows for bad positions, compiled-graph contents,
cpp_wrapper compile-time autotuning."""

import pytest
import torch
import triton

import inductor_ext
from inductor_ext.kernels.rope import search_space
from inductor_ext.ops.rope import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_,
    apply_rotary_pos_emb_ref,
)
from inductor_ext.tuning.launch_settings import force_launch_config
from tests.gpu.compile_checks import compile_with_cpp_wrapper_counting_tuning, run_and_get_joined_code
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (batch, q heads, k heads, seq, head dim, rotary dim, unsqueeze_dim, table kind)
CASES = [
    (2, 32, 8, 1024, 128, 128, 1, "batch"),  # Llama-3 GQA, HF layout and tables
    (1, 16, 16, 777, 64, 64, 2, "shared"),  # (B, S, H, D), odd length
    (3, 32, 32, 300, 80, 32, 1, "positions"),  # Phi-2 style partial rotary, position_ids into a table
    (2, 8, 1, 513, 96, 48, 2, "batch"),  # MQA, rotary half of 24 (not a power of two)
]


def _inputs(batch, hq, hk, seq, dim, rot, unsqueeze_dim, table, dtype):
    def heads(h):
        if unsqueeze_dim == 1:  # HF: a (B, S, H, D) projection viewed as (B, H, S, D)
            return torch.randn(batch, seq, h, dim, device="cuda", dtype=dtype).transpose(1, 2)
        return torch.randn(batch, seq, h, dim, device="cuda", dtype=dtype)

    n_rows = 4096 if table == "positions" else seq
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, device="cuda").float() / rot))
    offsets = torch.randint(0, 1000, (batch if table == "batch" else 1, 1), device="cuda").float()
    emb = torch.arange(n_rows, device="cuda").float()[None, :, None] + offsets[..., None]
    emb = torch.cat([emb * inv_freq] * 2, -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    position_ids = None
    if table == "positions":
        cos, sin = cos[0], sin[0]
        position_ids = torch.randint(0, n_rows, (batch, seq), device="cuda")
    elif table == "shared":
        cos, sin = cos[0], sin[0]
    dq, dk = torch.randn_like(heads(hq)), torch.randn_like(heads(hk))
    return heads(hq), heads(hk), cos, sin, position_ids, unsqueeze_dim, dq, dk


def _fwd_bwd(f, q, k, cos, sin, position_ids, unsqueeze_dim, dq, dk):
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    q_embed, k_embed = f(q, k, cos, sin, position_ids, unsqueeze_dim)
    return (q_embed, k_embed, *torch.autograd.grad((q_embed, k_embed), (q, k), (dq, dk)))


def _as64(args):
    q, k, cos, sin, position_ids, unsqueeze_dim, dq, dk = args
    return q.double(), k.double(), cos.double(), sin.double(), position_ids, unsqueeze_dim, dq.double(), dk.double()


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_as_closely_as_compiled_reference(case, dtype):
    torch._dynamo.reset()
    args = _inputs(*case, dtype)
    ref = _fwd_bwd(apply_rotary_pos_emb_ref, *_as64(args))
    ours = _fwd_bwd(apply_rotary_pos_emb, *args)
    compiled = _fwd_bwd(torch.compile(apply_rotary_pos_emb_ref), *args)
    for name, o, c, r in zip(("q_embed", "k_embed", "dq", "dk"), ours, compiled, ref):
        assert o.dtype == dtype and torch.isfinite(o).all(), name
        assert rel_err(o, r) <= 1.1 * rel_err(c, r) + 2e-6, (name, rel_err(o, r), rel_err(c, r))
    q = args[0]
    assert ours[0].stride() == q.stride()  # no hidden copy: the output has q's (strided) layout


def test_every_config_is_correct():
    for case in CASES[:3]:
        args = _inputs(*case, torch.bfloat16)
        ref = _fwd_bwd(apply_rotary_pos_emb_ref, *_as64(args))
        half_pad = triton.next_power_of_2(case[5] // 2)
        pass_pad = triton.next_power_of_2(case[4] - case[5]) if case[4] > case[5] else 0
        for config in search_space(case[1], case[2], half_pad, pass_pad):
            with force_launch_config(config.to_triton().all_kwargs()):
                ours = _fwd_bwd(apply_rotary_pos_emb, *args)
            for name, o, r in zip(("q_embed", "k_embed", "dq", "dk"), ours, ref):
                assert rel_err(o, r) < 1e-2, (case, config, name)


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_in_place_first_call_autotunes_and_rotates_once(case):
    """The first eager call of the in-place kernel for these head counts runs the autotuner, which
    times the kernel many times: restore_value must put q and k back, so they are rotated once.
    (A second rotation would move them by the full angle again: far outside the tolerance.)"""
    q, k, cos, sin, position_ids, unsqueeze_dim, _, _ = _inputs(*case, torch.bfloat16)
    expected = apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)
    with torch.no_grad():
        apply_rotary_pos_emb_(q, k, cos, sin, position_ids, unsqueeze_dim)
    torch.testing.assert_close(q, expected[0])
    torch.testing.assert_close(k, expected[1])


def test_in_place_under_compile():
    q, k, cos, sin, _, _, _, _ = _inputs(2, 32, 8, 512, 128, 128, 1, "batch", torch.bfloat16)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(q, k, cos, sin):
        apply_rotary_pos_emb_(q, k, cos, sin)
        return q.float().sum() + k.float().sum()

    with torch.no_grad():
        total = f(q, k, cos, sin)
    torch.testing.assert_close(q, expected[0])
    torch.testing.assert_close(k, expected[1])
    torch.testing.assert_close(total, expected[0].float().sum() + expected[1].float().sum(), rtol=1e-4, atol=1e-2)


def test_out_of_range_positions_give_nan_rows_on_gpu():
    q, k, cos, sin, position_ids, _, _, _ = _inputs(2, 4, 2, 16, 64, 64, 1, "positions", torch.float32)
    position_ids[0, 3] = cos.shape[0]
    position_ids[1, 5] = -1
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    bad = torch.zeros(2, 16, dtype=torch.bool, device="cuda")
    bad[0, 3] = bad[1, 5] = True
    for out in (q_embed, k_embed):
        assert torch.isnan(out).all(-1).all(1).eq(bad).all()
        assert torch.isfinite(out.transpose(1, 2)[~bad]).all()


def test_compiled_graph_launches_our_kernel_as_user_defined_triton_kernel():
    q, k, cos, sin, _, _, _, _ = _inputs(2, 32, 8, 512, 128, 128, 1, "batch", torch.bfloat16)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(inductor_ext.apply_rotary_pos_emb, fullgraph=True)

    def train_step():
        q_embed, k_embed = compiled(q, k, cos, sin)
        (q_embed.float().square().sum() + k_embed.float().sum()).backward()

    _, code = run_and_get_joined_code(train_step)
    assert code.count("_rope_kernel") >= 2  # forward and backward graphs
    assert "fastops.rope" not in code
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_cpp_wrapper_autotunes_our_kernel_at_compile_time(monkeypatch):
    q, k, cos, sin, _, _, _, _ = _inputs(2, 32, 8, 512, 128, 128, 1, "batch", torch.bfloat16)
    out, out2 = compile_with_cpp_wrapper_counting_tuning(
        monkeypatch, lambda q, k, c, s: inductor_ext.apply_rotary_pos_emb(q, k, c, s), (q, k, cos, sin), "_rope_kernel"
    )
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    for o, o2, e in zip(out, out2, expected):
        torch.testing.assert_close(o, e)  # configs may differ from eager's pick: same math, maybe other FMAs
        torch.testing.assert_close(o2, o, atol=0, rtol=0)

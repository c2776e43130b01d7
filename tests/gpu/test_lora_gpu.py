"""Fused LoRA blocks on CUDA at the Llama-3.2-1B shape (hidden 2048, intermediate 8192, 8 KV heads of
64, rank 16, 4096 tokens, bf16): outputs and adapter gradients as close to float64 as PEFT's unfused
layers are (eager and ``torch.compile`` of them), dropout with PEFT's own masks, the memory a forward
keeps for the backward, and the MLP under ``fastops_inductor``."""

import pytest
import torch
from torch._dynamo.utils import counters

from inductor_ext.ops.lora import lora_linear, lora_linear_ref, lora_mlp, lora_mlp_ref, lora_qkv, lora_qkv_ref
from tests.ops.test_lora import (
    _Attention,
    _leaves,
    _Mlp,
    _ours_and_float64,
    _outputs_and_grads,
    _peft,
    _projection,
    _record_dropout,
    _recorded_masks,
)
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HIDDEN, KV, INTERMEDIATE, RANK, TOKENS = 2048, 512, 8192, 16, 4096
DTYPE = torch.bfloat16


def _peft_llama(module: str, targets: list[str], dropout_p: float) -> torch.nn.Module:
    """Llama-3.2-1B's attention projections (no biases) or SwiGLU MLP with rank-16 PEFT adapters in bf16."""
    layers = _Attention(HIDDEN, KV, qkv_bias=False) if module == "attention" else _Mlp("silu", HIDDEN, INTERMEDIATE)
    return _peft(layers, targets, DTYPE, dropout_p, rank=RANK).to(DTYPE)  # adapters in bf16 too


def _x(features: int = HIDDEN) -> torch.Tensor:
    return torch.randn(TOKENS, features, device="cuda").to(DTYPE)


def _assert_as_close_as_peft(name: str, ours, peft_eager, peft_compiled, ref) -> None:
    """Each output and gradient of ours within 1.5× the larger float64 error of PEFT eager and compiled."""
    for i, (o, e, c, r) in enumerate(zip(ours, peft_eager, peft_compiled, ref)):
        assert o.dtype == e.dtype and torch.isfinite(o).all(), (name, i)
        noise = max(rel_err(e, r), rel_err(c, r))
        assert rel_err(o, r) <= 1.5 * noise + 1e-4, (name, i, rel_err(o, r), noise)


@pytest.mark.parametrize("dropout_p", [0.0, 0.05])
def test_qkv_and_o_match_float64_as_closely_as_peft(dropout_p):
    model = _peft_llama("attention", ["q_proj", "k_proj", "v_proj", "o_proj"], dropout_p)
    qkv_layers = [model.q_proj, model.k_proj, model.v_proj]
    recorders = _record_dropout(qkv_layers + [model.o_proj], dropout_p) if dropout_p > 0 else []
    x = _x()

    def peft_qkv(x):
        return tuple(layer(x) for layer in qkv_layers)

    params = _leaves(qkv_layers)
    torch.manual_seed(1)
    peft_eager = _outputs_and_grads(peft_qkv, x, params)
    masks = _recorded_masks(recorders[:3]) if recorders else None
    if recorders:  # the compiled PEFT draws its own masks: compare it without dropout's randomness
        peft_compiled = peft_eager
    else:
        peft_compiled = _outputs_and_grads(torch.compile(peft_qkv, fullgraph=True), x, params)
    q, k, v = (_projection(layer) for layer in qkv_layers)
    kw = {"dropout_p": dropout_p, "dropout_masks": masks}
    ours, ref = _ours_and_float64(lora_qkv, lora_qkv_ref, [q, k, v], x, params, **kw)
    _assert_as_close_as_peft("qkv", ours, peft_eager, peft_compiled, ref)

    o_params = _leaves([model.o_proj])
    peft_o = _outputs_and_grads(model.o_proj, x, o_params)
    o_mask = _recorded_masks(recorders[3:])[0] if recorders else None
    o = _projection(model.o_proj)
    kw_o = {"dropout_p": dropout_p, "dropout_mask": o_mask}
    ours_o, ref_o = _ours_and_float64(lora_linear, lora_linear_ref, [o], x, o_params, **kw_o)
    _assert_as_close_as_peft("o", ours_o, peft_o, peft_o, ref_o)


@pytest.mark.parametrize("dropout_p", [0.0, 0.05])
def test_mlp_matches_float64_as_closely_as_peft(dropout_p):
    model = _peft_llama("mlp", ["gate_proj", "up_proj", "down_proj"], dropout_p)
    layers = [model.gate_proj, model.up_proj, model.down_proj]
    recorders = _record_dropout(layers, dropout_p) if dropout_p > 0 else []
    params = _leaves(layers)
    x = _x()
    peft_eager = _outputs_and_grads(model, x, params)
    masks = _recorded_masks(recorders)
    peft_compiled = peft_eager if recorders else _outputs_and_grads(torch.compile(model), x, params)
    gate, up, down = (_projection(layer) for layer in layers)
    kw = {"dropout_p": dropout_p, "dropout_masks": masks}
    ours, ref = _ours_and_float64(lora_mlp, lora_mlp_ref, [gate, up, down], x, params, **kw)
    _assert_as_close_as_peft("mlp", ours, peft_eager, peft_compiled, ref)


def test_mlp_forward_keeps_gate_up_and_rank_r_products_only():
    """What a forward leaves allocated for the backward, beside its output: ``G`` and ``U``
    (``2 N I`` bf16) and the three ``(N, r)`` products; no copy of a base weight (each is
    ``H I`` bf16, 32 MiB) and not ``h`` (``N I``, 64 MiB)."""
    model = _peft_llama("mlp", ["gate_proj", "up_proj", "down_proj"], 0.0)
    gate, up, down = (_projection(layer) for layer in (model.gate_proj, model.up_proj, model.down_proj))
    x = _x().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = lora_mlp(x, gate, up, down)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    expected = 2 * TOKENS * INTERMEDIATE * 2 + 3 * TOKENS * RANK * 2
    assert expected <= kept <= expected + 2**20, (kept, expected)
    y.sum().backward()


def test_mlp_under_fastops_inductor_matches_eager():
    """The LoRA MLP compiled by our backend (fullgraph, no graph break), given PEFT's dropout masks:
    the eager op's output and gradients within bf16 noise."""
    torch._dynamo.reset()
    counters.clear()
    model = _peft_llama("mlp", ["gate_proj", "up_proj", "down_proj"], 0.05)
    gate, up, down = (_projection(layer) for layer in (model.gate_proj, model.up_proj, model.down_proj))
    params = _leaves([model.gate_proj, model.up_proj, model.down_proj])
    x = _x()
    masks = tuple(torch.rand(TOKENS, n, device="cuda") >= 0.05 for n in (HIDDEN, HIDDEN, INTERMEDIATE))

    def block(x):
        return lora_mlp(x, gate, up, down, dropout_p=0.05, dropout_masks=masks)

    eager = _outputs_and_grads(block, x, params)
    compiled = _outputs_and_grads(torch.compile(block, backend="fastops_inductor", fullgraph=True), x, params)
    assert not counters["graph_break"]
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert rel_err(c, e) < 1e-2, (i, rel_err(c, e))

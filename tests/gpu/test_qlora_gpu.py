"""Fused LoRA over 4-bit bases on CUDA at the Llama-3.1-8B shape (hidden 4096, intermediate 14336, 8 KV
heads of 128, rank 16, 4096 tokens, bf16, float32 adapters as PEFT keeps them): the dequantisation
kernel against bitsandbytes' CUDA one; outputs and adapter gradients as close to float64 (on the
dequantised weights) as PEFT's ``lora.bnb.Linear4bit`` layers are, eager and compiled; what a forward
keeps for the backward; peak memory against PEFT + bitsandbytes; the MLP under ``fastops_inductor``."""

import pytest
import torch
from torch._dynamo.utils import counters

from inductor_ext.ops.lora import lora_mlp, lora_mlp_ref, lora_qkv, lora_qkv_ref
from inductor_ext.ops.nf4 import Nf4Weight, _dequantize_kernel, nf4_dequantize
from tests.gpu.test_lora_gpu import _assert_as_close_as_peft
from tests.ops.test_lora import _Attention, _leaves, _Mlp, _outputs_and_grads
from tests.ops.test_lora_nf4 import _qlora_module, _qlora_projection, _quantized, ours_peft_and_float64
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
bnb = pytest.importorskip("bitsandbytes")

HIDDEN, KV, INTERMEDIATE, RANK, TOKENS = 4096, 1024, 14336, 16, 4096
DTYPE = torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax_fp32", "double_quant"])
def test_dequantize_kernel_matches_bitsandbytes_cuda(nested, dtype):
    param = _quantized(torch.randn(INTERMEDIATE, HIDDEN, device="cuda").to(dtype), nested=nested)
    expected = bnb.functional.dequantize_4bit(param.data, param.quant_state)
    packed, quant = Nf4Weight.from_bnb(param).op_arguments()
    ours = _dequantize_kernel(packed, quant, dtype)
    # The scales' product and offset may be one fused multiply-add here, two roundings there: the
    # block's fp32 scale may differ by one rounding (relative eps of fp32), and so the product. A 16-bit
    # output rounds that away but for the rare value next to a tie (1 ulp of its dtype); a float32 output
    # keeps it: the scale's rounding plus the product's, under 2 eps relative.
    eps = torch.finfo(dtype).eps
    tolerance = (2 * eps if dtype == torch.float32 else eps) * expected.float().abs()
    assert ((ours.float() - expected.float()).abs() <= tolerance).all()
    if dtype != torch.float32:
        assert (ours == expected).float().mean() > 0.999


def _qlora_llama(module: str) -> torch.nn.Module:
    layers = _Attention(HIDDEN, KV, qkv_bias=False) if module == "attention" else _Mlp("silu", HIDDEN, INTERMEDIATE)
    targets = ["q_proj", "k_proj", "v_proj"] if module == "attention" else ["gate_proj", "up_proj", "down_proj"]
    return _qlora_module(layers, targets, DTYPE, adapter_dtype=torch.float32, rank=RANK)


def _x() -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, device="cuda").to(DTYPE)


@pytest.mark.parametrize("module", ["attention", "mlp"])
def test_matches_float64_as_closely_as_peft_over_bitsandbytes(module):
    model = _qlora_llama(module)
    attention = module == "attention"
    names = ["q_proj", "k_proj", "v_proj"] if attention else ["gate_proj", "up_proj", "down_proj"]
    fused, ref = (lora_qkv, lora_qkv_ref) if attention else (lora_mlp, lora_mlp_ref)
    x = _x()
    ours, peft_eager, reference = ours_peft_and_float64(model, names, x, fused, ref)
    layers = [getattr(model, name) for name in names]
    torch._dynamo.reset()
    compiled = torch.compile(model if not attention else (lambda x: tuple(layer(x) for layer in layers)))
    peft_compiled = _outputs_and_grads(compiled, x, _leaves(layers))
    _assert_as_close_as_peft(module, ours, peft_eager, peft_compiled, reference)


def test_mlp_forward_keeps_the_4bit_weights_and_activations_only():
    """Beside its output, a forward keeps ``G`` and ``U`` (``2 N I`` bf16) and the three ``(N, r)``
    float32 products: no dequantised weight (each is ``H I`` bf16, 112 MiB)."""
    model = _qlora_llama("mlp")
    projs = [_qlora_projection(layer) for layer in (model.gate_proj, model.up_proj, model.down_proj)]
    x = _x().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = lora_mlp(x, *projs)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    expected = 2 * TOKENS * INTERMEDIATE * 2 + 3 * TOKENS * RANK * 4
    assert expected <= kept <= expected + 2**20, (kept, expected)
    y.sum().backward()


def test_mlp_peak_memory_is_below_peft_over_bitsandbytes():
    model = _qlora_llama("mlp")
    layers = [model.gate_proj, model.up_proj, model.down_proj]
    projs = [_qlora_projection(layer) for layer in layers]
    x = _x().requires_grad_()

    def peak(f) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        f(x).float().sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    ours, theirs = peak(lambda x: lora_mlp(x, *projs)), peak(model)
    assert ours < theirs, (ours / 2**20, theirs / 2**20)


def _compiled_mlp_setup() -> tuple[list, list[torch.Tensor]]:
    """A fresh Dynamo and the 8B-shape QLoRA MLP's fused projections and adapter parameters."""
    torch._dynamo.reset()
    counters.clear()
    model = _qlora_llama("mlp")
    layers = [model.gate_proj, model.up_proj, model.down_proj]
    return [_qlora_projection(layer) for layer in layers], _leaves(layers)


def test_mlp_under_fastops_inductor_matches_eager():
    projs, params = _compiled_mlp_setup()
    x = _x()

    def block(x):
        return lora_mlp(x, *projs)

    eager = _outputs_and_grads(block, x, params)
    step = torch.compile(block, backend="fastops_inductor", fullgraph=True)
    compiled = _outputs_and_grads(step, x, params)
    assert not counters["graph_break"]
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert rel_err(c, e) < 1e-2, (i, rel_err(c, e))
    # the backward dequantises again (our kernel, traced, anchored to the gradient): of the tensors as
    # large as a weight (H I elements) the forward saves G and U (N I: N = H here) and no weight
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        step(x.requires_grad_())
    assert saved.count(HIDDEN * INTERMEDIATE) == 2 and TOKENS == HIDDEN, saved
    # traced, the dequantisation is our kernel: bit for bit the eager launch's
    weight = projs[0].weight
    assert torch.equal(torch.compile(nf4_dequantize)(weight), nf4_dequantize(weight))


@pytest.mark.parametrize("keep", [False, True], ids=["recompute", "keep_lora_mlp_outputs"])
def test_checkpointed_mlp_under_fastops_inductor_keeps_gate_and_up_only_when_asked(keep):
    """Checkpointed with ``models.keep_lora_mlp_outputs``, the compiled forward keeps ``G`` and ``U``
    (``2 N I`` bf16) for the backward, and no dequantised weight, no dropped input and no float32 copy;
    plainly checkpointed it keeps none of the MLP's activations. With dropout, as the benchmark's
    fine-tune. Outputs and gradients as eager's without checkpointing either way."""
    from torch.utils.checkpoint import checkpoint

    from inductor_ext.models import keep_lora_mlp_outputs

    projs, params = _compiled_mlp_setup()
    kwargs = {"context_fn": keep_lora_mlp_outputs()} if keep else {}
    masks = tuple(torch.rand(TOKENS, n, device="cuda") > 0.05 for n in (HIDDEN, HIDDEN, INTERMEDIATE))

    def mlp(x):
        return lora_mlp(x, *projs, dropout_p=0.05, dropout_masks=masks)

    def block(x):
        return checkpoint(mlp, x, use_reentrant=False, **kwargs)

    compiled = torch.compile(block, backend="fastops_inductor", fullgraph=True)
    x = _x().requires_grad_()
    compiled(x).sum().backward()  # compile first: the kept memory below is the steady state's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = compiled(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    y.sum().backward()
    gate_and_up = 2 * TOKENS * INTERMEDIATE * 2
    if keep:
        assert gate_and_up <= kept <= gate_and_up + 2**24, (kept, gate_and_up)
    else:
        assert kept <= 2**24, kept
    assert not counters["graph_break"]
    eager = _outputs_and_grads(mlp, x, params)
    for i, (c, e) in enumerate(zip(_outputs_and_grads(compiled, x, params), eager)):
        assert rel_err(c, e) < 1e-2, (i, rel_err(c, e))

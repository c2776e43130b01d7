"""Fused LoRA over 4-bit (QLoRA) bases: bitsandbytes' NF4/FP4 weights, double quantisation included.

The dequantisation (aten math, and our Triton kernel under the interpreter) against bitsandbytes' own;
the fused ops on 4-bit bases against float64 on the dequantised weights and against PEFT's
``lora.bnb.Linear4bit`` layers; what the forward keeps for the backward (the 4-bit form only);
opcheck, torch.compile, and bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inductor_ext.ops.lora import (
    LoraProjection,
    lora_linear,
    lora_linear_ref,
    lora_mlp,
    lora_mlp_ref,
    lora_qkv,
    lora_qkv_ref,
)
from inductor_ext.ops.nf4 import Nf4Weight, _dequantize_kernel, dequantize_math, nf4_dequantize
from tests.conftest import DEVICE
from tests.ops.test_lora import (
    ADAPTER,
    BATCH,
    HIDDEN,
    INTERMEDIATE,
    KV,
    RANK,
    SEQ,
    _Attention,
    _bwd_args,
    _compare,
    _fwd_args,
    _leaves,
    _Mlp,
    _outputs_and_grads,
    _x,
)
from tests.tolerances import rel_err

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

DTYPES = [torch.float32, torch.bfloat16]


def _quantized(weight: torch.Tensor, *, nested: bool = True, quant_type: str = "nf4", blocksize: int = 64):
    """bitsandbytes' ``Params4bit`` of ``weight``, quantised on ``weight``'s device."""
    param = bnb.nn.Params4bit(
        weight.detach().cpu(), requires_grad=False, quant_type=quant_type, compress_statistics=nested,
        blocksize=blocksize,
    )  # fmt: skip
    return param.to(weight.device)


def _bnb_dequantized(param) -> torch.Tensor:
    return bnb.functional.dequantize_4bit(param.data, param.quant_state)


# --- dequantisation -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["absmax_fp32", "double_quant"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_matches_bitsandbytes(quant_type, nested, dtype):
    # 96 x 320 = 480 blocks of 64: the nested scales' last block holds 224 of 256
    param = _quantized(torch.randn(96, 320, device=DEVICE).to(dtype), nested=nested, quant_type=quant_type)
    expected = _bnb_dequantized(param)
    weight = Nf4Weight.from_bnb(param)
    packed, quant = weight.op_arguments()
    assert torch.equal(dequantize_math(packed, quant, dtype), expected)
    kernel = _dequantize_kernel(packed, quant, dtype)
    assert torch.equal(nf4_dequantize(weight), kernel)  # the kernel on the GPU or under the interpreter
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        # the interpreter's float32 -> bf16 cast truncates: at most one unit in the last place
        ulp = torch.finfo(dtype).eps * expected.float().abs()
        assert ((kernel.float() - expected.float()).abs() <= ulp).all()
    else:
        assert torch.equal(kernel, expected)


def test_rows_that_split_a_block_dequantize_within_nf4_error():
    """48 features: blocks of 64 straddle rows. bitsandbytes 0.50.2's own CPU dequantisation is wrong
    there (0.2-0.4 relative error against the weight it quantised, measured; 0.09 is NF4's), so ours
    is checked against the weight itself: within NF4's error, as at whole-block rows."""
    weight = torch.randn(96, 48, device=DEVICE)
    for nested in (False, True):
        dequantized = nf4_dequantize(Nf4Weight.from_bnb(_quantized(weight, nested=nested)))
        assert rel_err(dequantized, weight) < 0.1


SM90_COMPILE = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from benchmarks.compile_cost import compile_one, fake_cuda
from inductor_ext.kernels.nf4 import BLOCK, NESTED_BLOCKSIZE, NUM_WARPS, nf4_dequantize_kernel

n = 4096 * 64
for nested in (False, True):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        absmax = torch.uint8 if nested else torch.float32
        shapes = [(n // 2, torch.uint8), (16, torch.float32), (n // 64, absmax), (256, torch.float32),
                  (n // 64 // 256, torch.float32), ((), torch.float32), (n, dtype), (n // 2, torch.uint8)]
        meta = tuple(torch.empty(shape, dtype=dt, device="meta") for shape, dt in shapes)
        with FakeTensorMode():
            kwargs = {"NESTED": nested, "NESTED_BLOCK": NESTED_BLOCKSIZE, "BLOCK": BLOCK, "num_warps": NUM_WARPS}
            cost = compile_one(nf4_dequantize_kernel, (*fake_cuda(meta), n, 64), kwargs, GPUTarget("cuda", 90, 32))
        print(nested, dtype, cost["registers"], cost["spill bytes"])
"""


def test_the_kernel_compiles_for_sm90_without_spills():
    """The interpreter checks no types: every variant through Triton's full sm_90 compile (no GPU needed)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TRITON_INTERPRET": "0"}
    run = subprocess.run(
        [sys.executable, "-c", SM90_COMPILE], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    assert len(rows) == 6 and all(int(registers) > 0 and spills == "0" for *_, registers, spills in rows), rows


def test_block_sizes_other_than_64_dequantize():
    param = _quantized(torch.randn(64, 256, device=DEVICE), blocksize=128)  # float32: the kernel is exact
    assert torch.equal(nf4_dequantize(Nf4Weight.from_bnb(param)), _bnb_dequantized(param))


# --- the fused ops on 4-bit bases ---------------------------------------------------------------


def _nf4_projection(dense: LoraProjection) -> LoraProjection:
    return dense._replace(weight=Nf4Weight.from_bnb(_quantized(dense.weight)))


def _random_projection(i: int, o: int, dtype: torch.dtype, bias: bool = False) -> LoraProjection:
    return LoraProjection(
        (torch.randn(o, i, device=DEVICE) / i**0.5).to(dtype),
        (torch.randn(RANK, i, device=DEVICE) / i**0.5).to(dtype).requires_grad_(),
        (torch.randn(o, RANK, device=DEVICE) / RANK**0.5).to(dtype).requires_grad_(),
        2.0,
        torch.randn(o, device=DEVICE).to(dtype) if bias else None,
    )


def _dense(proj: LoraProjection) -> LoraProjection:
    """The same projection over the dequantised weight."""
    return proj._replace(weight=nf4_dequantize(proj.weight))


def _float64(proj: LoraProjection) -> LoraProjection:
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().double().requires_grad_(t.requires_grad)

    bias = None if proj.bias is None else proj.bias.double()
    return LoraProjection(
        nf4_dequantize(proj.weight).double(), leaf(proj.lora_a), leaf(proj.lora_b), proj.scaling, bias
    )


CASES = {
    "linear": (lora_linear, lora_linear_ref, [(HIDDEN, KV)], 1, {}),
    "qkv": (lora_qkv, lora_qkv_ref, [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV)], 3, {}),
    "mlp": (lora_mlp, lora_mlp_ref, [(HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)], 1,
            {"activation": "silu"}),
}  # fmt: skip


def _mask_kwargs(name: str, shapes, dropout_p: float) -> dict:
    if dropout_p == 0.0:
        return {}
    masks = [torch.rand(BATCH, SEQ, i, device=DEVICE) >= dropout_p for i, _ in shapes]
    key = "dropout_mask" if name == "linear" else "dropout_masks"
    return {"dropout_p": dropout_p, key: masks[0] if name == "linear" else tuple(masks)}


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_nf4_bases_match_float64_and_the_dense_op_on_the_dequantised_weights(name, dtype, dropout_p):
    fused, ref, shapes, n_outputs, kw = CASES[name]
    projs = [_nf4_projection(_random_projection(i, o, dtype, bias=name == "qkv")) for i, o in shapes]
    kw = {**kw, **_mask_kwargs(name, shapes, dropout_p)}
    params = [t for p in projs for t in (p.lora_a, p.lora_b)]
    x = _x(dtype)
    ours = _outputs_and_grads(lambda x: fused(x, *projs, **kw), x, params)
    dense = _outputs_and_grads(lambda x: fused(x, *[_dense(p) for p in projs], **kw), x, params)
    for i, (o, d) in enumerate(zip(ours, dense)):
        assert torch.equal(o, d), (name, i)  # the same GEMMs on the same weights
    projs64 = [_float64(p) for p in projs]
    params64 = [t for p in projs64 for t in (p.lora_a, p.lora_b)]
    reference = _outputs_and_grads(lambda x: ref(x, *projs64, **kw), x.double(), params64)
    _compare(name, ours, reference, n_outputs, dtype, BATCH * SEQ)


def test_forward_keeps_the_4bit_weights_not_dequantised_copies():
    """What autograd holds between forward and backward: no tensor of a base weight's shape."""
    gate, up, down = (
        _nf4_projection(_random_projection(i, o, torch.bfloat16))
        for i, o in ((HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN))
    )
    q = _nf4_projection(_random_projection(HIDDEN, KV, torch.bfloat16))
    saved: list[torch.Tensor] = []
    x = _x(torch.bfloat16).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lora_mlp(x, gate, up, down) + lora_linear(x, q).sum()
    weight_shapes = {(INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE), (KV, HIDDEN)}
    assert saved and not [t.shape for t in saved if tuple(t.shape) in weight_shapes]
    assert any(t.dtype == torch.uint8 for t in saved)  # the codes themselves
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("checkpointing", ["none", "keep_lora_mlp_outputs"])
def test_compiled_forward_keeps_no_dequantised_weight(checkpointing):
    """Under ``torch.compile`` (AOTAutograd's min-cut partitioner) the forward graph hands the backward
    no dequantised weight and no float32 copy of an activation, with or without selective
    checkpointing: the backward op's recomputations (dequantisation, the GLU's upcasts, dropout
    applied to its input) are tied to its gradient, so they are not merged with the forward's and
    saved. Checkpointed with ``models.keep_lora_mlp_outputs``, ``G`` and ``U`` are handed over, in
    bf16. float32 adapters and dropout, as a QLoRA fine-tune has them."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import checkpoint

    from inductor_ext.models import keep_lora_mlp_outputs

    projs = [
        _nf4_projection(_random_projection(i, o, torch.bfloat16))
        for i, o in ((HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN))
    ]
    projs = [p._replace(lora_a=p.lora_a.float(), lora_b=p.lora_b.float()) for p in projs]
    tokens = BATCH * SEQ
    generator = torch.Generator().manual_seed(0)
    masks = tuple(torch.rand(BATCH, SEQ, n, generator=generator) > 0.1 for n in (HIDDEN, HIDDEN, INTERMEDIATE))
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def forward_graph(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        (outputs,) = [node.args[0] for node in gm.graph.nodes if node.op == "output"]
        saved.extend((tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in outputs if isinstance(o, torch.fx.Node))
        return gm

    backend = aot_autograd(fw_compiler=forward_graph, partition_fn=min_cut_rematerialization_partition)

    def mlp(x):
        return lora_mlp(x, *projs, dropout_p=0.1, dropout_masks=masks)

    def kept(x):
        return checkpoint(mlp, x, use_reentrant=False, context_fn=keep_lora_mlp_outputs())

    block = kept if checkpointing == "keep_lora_mlp_outputs" else mlp
    params = [t for p in projs for t in (p.lora_a, p.lora_b)]
    x = _x(torch.bfloat16)
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(block, backend=backend, fullgraph=True), x, params)
    shapes = {shape for shape, _ in saved}
    assert saved and not {(INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)} & shapes, saved
    activations = [(shape, dtype) for shape, dtype in saved if shape in {(tokens, INTERMEDIATE), (tokens, HIDDEN)}]
    # in 16 bits: bf16, or the int16 view of it that the backward's gradient tie reads
    assert all(dtype in (torch.bfloat16, torch.int16) for _, dtype in activations), activations
    if checkpointing == "keep_lora_mlp_outputs":
        assert [s for s, _ in activations].count((tokens, INTERMEDIATE)) == 2, activations  # G and U
    eager = _outputs_and_grads(mlp, x, params)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert rel_err(c, e) < 1e-2, (i, rel_err(c, e))


@pytest.mark.parametrize("fused", [True, False], ids=["lora_qkv", "lora_linear"])
def test_compiled_checkpointed_qkv_keeps_its_outputs_only(fused):
    """Checkpointed with ``models.keep_lora_outputs``, the compiled forward hands the backward ``x`` and
    the projections' ``q``, ``k`` and ``v`` (one ``lora_qkv``, or three ``lora_linear`` as
    ``models.apply`` routes attention; read by what follows in the region, here squares; plain
    checkpointing would run the op again), and no dropped copy of ``x`` (the backward's dropout is tied
    to its gradient) nor a dequantised weight. float32 adapters and dropout, as a QLoRA fine-tune has
    them."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils.checkpoint import checkpoint

    from inductor_ext.models import keep_lora_outputs

    projs = [_nf4_projection(_random_projection(HIDDEN, o, torch.bfloat16)) for o in (HIDDEN, KV, KV)]
    projs = [p._replace(lora_a=p.lora_a.float(), lora_b=p.lora_b.float()) for p in projs]
    tokens = BATCH * SEQ
    generator = torch.Generator().manual_seed(0)
    masks = tuple(torch.rand(tokens, HIDDEN, generator=generator) > 0.1 for _ in range(3))
    graphs: list[list[torch.Tensor]] = []  # each compiled graph's outputs: the forward's first

    def forward_graph(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        (outputs,) = [node.args[0] for node in gm.graph.nodes if node.op == "output"]
        graphs.append([o.meta["val"] for o in outputs if isinstance(o, torch.fx.Node)])
        return gm

    backend = aot_autograd(fw_compiler=forward_graph, partition_fn=min_cut_rematerialization_partition)

    def qkv(x):
        if fused:
            outputs = lora_qkv(x, *projs, dropout_p=0.1, dropout_masks=masks)
        else:
            outputs = tuple(lora_linear(x, p, dropout_p=0.1, dropout_mask=m) for p, m in zip(projs, masks))
        return tuple(t * t for t in outputs)

    def kept(x):
        return checkpoint(qkv, x, use_reentrant=False, context_fn=keep_lora_outputs())

    params = [t for p in projs for t in (p.lora_a, p.lora_b)]
    x = _x(torch.bfloat16).view(tokens, HIDDEN).clone()
    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(kept, backend=backend, fullgraph=True), x, params)
    saved = [(tuple(t.shape), t.dtype) for t in graphs[0][3:]]  # after the region's three outputs
    assert not {(HIDDEN, HIDDEN), (KV, HIDDEN)} & {shape for shape, _ in saved}, saved
    activations = sorted(shape for shape, dtype in saved if dtype == torch.bfloat16 and shape[0] == tokens)
    assert activations == sorted([(tokens, HIDDEN), (tokens, HIDDEN), (tokens, KV), (tokens, KV)]), saved
    eager = _outputs_and_grads(qkv, x, params)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert rel_err(c, e) < 1e-2, (i, rel_err(c, e))


def _qlora_module(
    module: torch.nn.Module, targets: list[str], dtype: torch.dtype, adapter_dtype: torch.dtype | None = None,
    rank: int = RANK,
) -> torch.nn.Module:  # fmt: skip
    """``module``'s ``targets`` as bitsandbytes ``Linear4bit`` (NF4, double quantisation) wrapped by PEFT's
    ``lora.bnb.Linear4bit`` (scaling 2, adapters in ``adapter_dtype``, default ``dtype``, B random)."""
    module = module.to(device=DEVICE, dtype=dtype)
    for name in targets:
        linear = getattr(module, name)
        quantized = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=dtype,
            quant_type="nf4", compress_statistics=True,
        )  # fmt: skip
        quantized.weight = _quantized(linear.weight)
        if linear.bias is not None:
            quantized.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        setattr(module, name, quantized)
    module.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layers
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets)
    module = peft.inject_adapter_in_model(config, module)
    for name in targets:
        layer = getattr(module, name)
        assert type(layer).__name__ == "Linear4bit" and type(layer).__module__ == "peft.tuners.lora.bnb", type(layer)
        layer.lora_A[ADAPTER].to(adapter_dtype or dtype)
        lora_b = layer.lora_B[ADAPTER].to(adapter_dtype or dtype).weight
        with torch.no_grad():
            lora_b.copy_(torch.randn_like(lora_b) / rank**0.5)
    return module


def _qlora_projection(layer: torch.nn.Module) -> LoraProjection:
    base = layer.base_layer
    return LoraProjection(
        Nf4Weight.from_bnb(base.weight), layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
        layer.scaling[ADAPTER], base.bias,
    )  # fmt: skip


def ours_peft_and_float64(module: torch.nn.Module, names: list[str], x: torch.Tensor, fused, ref) -> tuple:
    """Outputs and gradients (``x``'s, the adapters') of PEFT's 4-bit layers ``names`` of ``module`` (the
    module itself for an MLP, the layers one by one for q/k/v), of ``fused`` on the same weights, and of
    ``ref`` in float64 on the dequantised weights."""
    layers = [getattr(module, name) for name in names]
    params = _leaves(layers)
    mlp = fused is lora_mlp
    peft_out = _outputs_and_grads(module if mlp else (lambda x: tuple(layer(x) for layer in layers)), x, params)
    projs = [_qlora_projection(layer) for layer in layers]
    ours = _outputs_and_grads(lambda x: fused(x, *projs), x, params)
    projs64 = [_float64(p) for p in projs]
    params64 = [t for p in projs64 for t in (p.lora_a, p.lora_b)]
    return ours, peft_out, _outputs_and_grads(lambda x: ref(x, *projs64), x.double(), params64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qkv_and_mlp_match_peft_over_bitsandbytes_and_float64(dtype):
    # whole blocks of 64 per row: bitsandbytes' CPU dequantisation is right there only (see above)
    hidden, kv, intermediate = 128, 64, 192
    x = _x(dtype, hidden)
    names = ["q_proj", "k_proj", "v_proj"]
    attention = _qlora_module(_Attention(hidden, kv), names, dtype)
    ours, peft_out, reference = ours_peft_and_float64(attention, names, x, lora_qkv, lora_qkv_ref)
    _compare("qkv", ours, reference, 3, dtype, BATCH * SEQ, peft_out)
    names = ["gate_proj", "up_proj", "down_proj"]
    mlp = _qlora_module(_Mlp("silu", hidden, intermediate), names, dtype)
    ours, peft_out, reference = ours_peft_and_float64(mlp, names, x, lora_mlp, lora_mlp_ref)
    _compare("mlp", ours, reference, 1, dtype, BATCH * SEQ, peft_out)


# --- registration, compile, bad input ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_opcheck_with_4bit_bases(dtype):
    """Not bf16 on CPU: eager runs the kernel, whose bf16 stores the interpreter truncates, and opcheck
    wants it bitwise equal to the traced math."""
    n = 6
    x = torch.randn(n, HIDDEN, device=DEVICE).to(dtype)
    dy = torch.randn(n, KV, device=DEVICE).to(dtype)
    ops = torch.ops.fastops
    proj = _nf4_projection(_random_projection(HIDDEN, KV, dtype, bias=True))
    torch.library.opcheck(ops.lora_linear_fwd.default, (x.requires_grad_(), *_fwd_args(proj, None), 0.0))
    _, xa = ops.lora_linear_fwd(x.detach(), *_fwd_args(proj, None), 0.0)
    torch.library.opcheck(ops.lora_linear_bwd.default, (dy, x.detach(), *_bwd_args(proj, xa, None), 0.0, True))
    mlp = [_nf4_projection(_random_projection(i, o, dtype))
           for i, o in ((HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, KV))]  # fmt: skip
    fwd = [a for p in mlp for a in _fwd_args(p, None)]
    torch.library.opcheck(ops.lora_mlp_fwd.default, (x, *fwd, "silu", 0.0))


def test_route_timing_inputs_of_4bit_bases_are_random_bytes():
    """The backend times routes on random inputs built from the call's shapes: a 4-bit base's codes
    and its quantised absmax are uint8 (inside the Tensor[] of constants), and every byte is valid."""
    from inductor_ext.tuning.inputs import random_inputs
    from inductor_ext.tuning.timing import meta_templates

    mlp = [_nf4_projection(_random_projection(i, o, torch.float32))
           for i, o in ((HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, KV))]  # fmt: skip
    x = torch.randn(64, HIDDEN, device=DEVICE)
    call = [x, *[a for p in mlp for a in _fwd_args(p, None)], "silu", 0.0]
    made = random_inputs(torch.ops.fastops.lora_mlp_fwd.default, meta_templates(call), DEVICE)
    codes, constants = made[1], made[2]
    assert codes.dtype == torch.uint8 and codes.shape == call[1].shape and codes.unique().numel() > 250
    assert [(t.dtype, t.shape) for t in constants] == [(t.dtype, t.shape) for t in call[2]]
    absmax_codes = next(t for t in constants if t.dtype == torch.uint8)
    assert absmax_codes.max() - absmax_codes.min() > 200  # the whole byte range, not zeros
    y, *_ = torch.ops.fastops.lora_mlp_fwd(*made)
    assert y.shape == (64, KV)


def test_inductor_route_compiles_the_math_over_4bit_constants():
    """Route timing compiles the op's aten math with every tensor a graph input, the 4-bit base's
    constants inside their Tensor[] too (a real tensor left in the list fails fake tracing), and keys
    the decision by the constants' shapes."""
    from inductor_ext.inductor.options import BackendOptions
    from inductor_ext.library.registration import DECOMPOSITIONS
    from inductor_ext.tuning.inputs import random_inputs
    from inductor_ext.tuning.routes import compile_math
    from inductor_ext.tuning.timing import meta_templates, signature

    op = torch.ops.fastops.lora_linear_fwd.default
    proj = _nf4_projection(_random_projection(HIDDEN, KV, torch.float32))
    call = [torch.randn(8, HIDDEN, device=DEVICE), *_fwd_args(proj, None), 0.0]
    templates = meta_templates(call)
    assert all(t.device.type == "meta" for t in templates[2])
    constants = ", ".join(f"{str(t.dtype)[6:]}[{','.join(map(str, t.shape))}]" for t in call[2])
    assert signature(templates) == signature(call) and f", [{constants}], " in signature(call)
    compiled = compile_math(DECOMPOSITIONS[op], call, BackendOptions())
    other = random_inputs(op, templates, DEVICE)
    for got, expected in zip(compiled(other), op(*other)):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("backend", ["inductor", "fastops_inductor"])
def test_compiled_fullgraph_matches_eager(backend, fresh_dynamo):
    projs = [_nf4_projection(_random_projection(i, o, torch.float32))
             for i, o in ((HIDDEN, INTERMEDIATE), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN))]  # fmt: skip
    q = _nf4_projection(_random_projection(HIDDEN, HIDDEN, torch.float32))
    params = [t for p in (*projs, q) for t in (p.lora_a, p.lora_b)]

    def block(x: torch.Tensor) -> torch.Tensor:
        return lora_mlp(lora_linear(x, q), *projs)

    x = _x(torch.float32)
    eager = _outputs_and_grads(block, x, params)
    compiled = _outputs_and_grads(torch.compile(block, backend=backend, fullgraph=True), x, params)
    for i, (c, e) in enumerate(zip(compiled, eager)):
        assert rel_err(c, e) < 1e-5, (i, rel_err(c, e))


def test_bad_4bit_weights_are_named():
    proj = _nf4_projection(_random_projection(HIDDEN, KV, torch.float32))
    x = _x(torch.float32)
    with pytest.raises(TypeError, match=r"proj\.weight must dequantise to x's dtype \(torch\.bfloat16\)"):
        lora_linear(x.bfloat16(), proj._replace(lora_a=proj.lora_a.bfloat16(), lora_b=proj.lora_b.bfloat16()))
    weight = proj.weight
    with pytest.raises(ValueError, match=r"one scale per block of 64 of its 768 elements .* got 5 scales"):
        lora_linear(x, proj._replace(weight=weight._replace(absmax=weight.absmax[:5])))
    with pytest.raises(ValueError, match=r"proj\.weight\.packed holds 383 bytes, expected 384"):
        lora_linear(x, proj._replace(weight=weight._replace(packed=weight.packed.reshape(-1)[:-1])))
    with pytest.raises(ValueError, match=r"nested_code, nested_absmax and offset together"):
        lora_linear(x, proj._replace(weight=weight._replace(offset=None)))
    with pytest.raises(ValueError, match=r"shape \(out, 48\)"):
        lora_linear(x, proj._replace(weight=weight._replace(shape=(KV * 2, HIDDEN // 2))))
    with pytest.raises(TypeError, match="weight must be an Nf4Weight"):
        nf4_dequantize(weight.packed)  # type: ignore[arg-type]
    param = bnb.nn.Params4bit(torch.randn(8, 8), requires_grad=False, quant_type="nf4")  # not yet quantised
    with pytest.raises(ValueError, match="not quantised yet"):
        Nf4Weight.from_bnb(param)


def test_codes_stored_in_another_dtype_are_read_as_bytes():
    """bitsandbytes' ``quant_storage`` (bf16 storage, as FSDP-sharded QLoRA uses) holds the same bytes."""
    weight = torch.randn(64, 128, device=DEVICE)
    param = bnb.nn.Params4bit(
        weight.cpu(), requires_grad=False, quant_type="nf4", compress_statistics=True, quant_storage=torch.bfloat16
    ).to(weight.device)
    assert param.dtype == torch.bfloat16
    assert torch.equal(nf4_dequantize(Nf4Weight.from_bnb(param)), _bnb_dequantized(param))

"""NF4 dequantisation benchmark (a QLoRA base's weight to a dense one): bitsandbytes' ``dequantize_4bit``,
torch.compile of our op's aten math (the baseline: what the backend emits inside a compiled model
today), and our Triton kernel.

Shapes are weight shapes ``out x in`` (Llama-3.1-8B's MLP and attention projections). The weight is
random normal in the output dtype, quantised as QLoRA's bases are (:mod:`inductor_ext.bench.train.qlora`:
NF4, blocks of 64, double quantisation, codes packed two a byte). Forward only: the base is frozen.
Minimal bytes (``n = out · in``, ``s`` bytes per output element): the packed codes read and the
weight written, ``n / 2 + n · s``. The scales are left out: with double quantisation one uint8 per
64 weights plus one float32 per 16384, 0.6% more bytes in bf16 (0.35% in fp32). Needs bitsandbytes.
"""

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Inputs, Provider, Result, run_providers
from inductor_ext.bench.train.qlora import NF4, NF4_BLOCKSIZE
from inductor_ext.ops.nf4 import Nf4Weight, _dequantize_kernel, dequantize_math

SHAPES = [(14336, 4096), (4096, 14336), (4096, 4096), (1024, 4096)]


def _make_inputs(out: int, in_features: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        import bitsandbytes as bnb

        weight = torch.randn(out, in_features, device="cuda", dtype=dtype)
        param: Any = bnb.nn.Params4bit(weight, requires_grad=False, blocksize=NF4_BLOCKSIZE, **NF4)
        param = param.to("cuda")  # Params4bit quantises when moved to a device, the same one included
        packed, quant = Nf4Weight.from_bnb(param).op_arguments()
        return {"param": param, "packed": packed, "quant": quant}

    return make


def _bitsandbytes(inp: Inputs) -> Callable[[], Any]:
    from bitsandbytes.functional import dequantize_4bit

    data, state = inp["param"].data, inp["param"].quant_state
    return lambda: dequantize_4bit(data, state)


def _ours(f: Callable[..., torch.Tensor], dtype: torch.dtype) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        packed, quant = inp["packed"], inp["quant"]
        return lambda: f(packed, quant, dtype)

    return build


def providers(dtype: torch.dtype) -> list[Provider]:
    return [
        Provider("bitsandbytes", _bitsandbytes),
        Provider("torch_compile", _ours(torch.compile(dequantize_math, fullgraph=True), dtype)),
        Provider("fastops", _ours(_dequantize_kernel, dtype)),
    ]


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("the nf4_dequantize benchmark needs bitsandbytes: pip install bitsandbytes")
    results = []
    s = torch.finfo(dtype).bits // 8
    for out, in_features in shapes:
        torch._dynamo.reset()
        min_bytes = out * in_features // 2 + out * in_features * s
        results += run_providers(
            "nf4_dequantize", "fwd", f"{out}x{in_features}", dtype, _make_inputs(out, in_features, dtype),
            min_bytes, providers(dtype), copy_gbps, baseline="torch_compile",
        )  # fmt: skip
    return results

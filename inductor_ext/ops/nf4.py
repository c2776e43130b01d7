"""Frozen 4-bit base weights in bitsandbytes' format (NF4, FP4; double quantisation): :class:`Nf4Weight`
and their dequantisation, for the fused LoRA ops (:mod:`inductor_ext.ops.lora`).

The format and the math are in :mod:`inductor_ext.kernels.nf4`. Inside the LoRA ops a 4-bit weight
travels as two op arguments: ``weight``, the packed codes viewed as ``(out, in / 2)`` uint8 (so the
shape rides on it), and ``weight_quant``, a list of tensors::

    [code, absmax]                                              float32 scales
    [code, absmax, nested_code, nested_absmax, offset]          double quantisation (absmax uint8)

A dense weight has an empty ``weight_quant``. The block size is ``out · in / absmax.numel()``.

:func:`dequantize` runs our Triton kernel on a GPU, launched directly in plain eager and traced
(``wrap_triton``) under ``torch.compile`` and export, whatever route the backend picks for the op that
calls it: Inductor's code of the same math (two nibble extractions, two table gathers, the products) is
slower (``python -m benchmarks nf4_dequantize``), and the GEMM reading the result is an extern kernel,
so there is no fusion to lose. On CPU it runs the kernel under ``TRITON_INTERPRET=1`` in plain eager,
and the aten math otherwise (the only code a CPU compile can run).
"""

from typing import Any, NamedTuple

import torch
import triton
from torch import Tensor

from inductor_ext.kernels.nf4 import BLOCK, NESTED_BLOCKSIZE, NUM_WARPS, nf4_dequantize_kernel
from inductor_ext.library.launch import DirectLaunch, Launch, TraceableLaunch, kernels_run_on
from inductor_ext.library.registration import use_eager_bypass
from inductor_ext.ops._gradient_tie import tied_to_gradient

DEQUANTIZED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Nf4Weight(NamedTuple):
    """A frozen ``(out, in)`` weight in bitsandbytes' 4-bit format (:mod:`inductor_ext.kernels.nf4`).

    From a quantised ``bitsandbytes.nn.Params4bit`` ``p``: :meth:`from_bnb` (the tensors are
    ``p``'s and its ``quant_state``'s, not copies).
    """

    packed: Tensor
    """``out · in / 2`` bytes (uint8, or bitsandbytes' ``quant_storage`` dtype viewed as bytes), any shape."""
    code: Tensor
    """The 16 code values, float32 (NF4's or FP4's table)."""
    absmax: Tensor
    """One scale per block: float32, or uint8 when ``nested_code`` is given."""
    blocksize: int
    shape: tuple[int, int]
    """``(out, in)``."""
    dtype: torch.dtype
    """What it dequantises to (bitsandbytes' ``quant_state.dtype``)."""
    nested_code: Tensor | None = None
    """Double quantisation: the 256 values of the scales' 8-bit code, float32."""
    nested_absmax: Tensor | None = None
    """Double quantisation: one float32 scale per 256 scales."""
    offset: Tensor | None = None
    """Double quantisation: the scales' mean, a float32 scalar tensor."""

    @classmethod
    def from_bnb(cls, param: Any) -> "Nf4Weight":
        """The weight of a quantised ``bitsandbytes.nn.Params4bit`` (``Linear4bit.weight``)."""
        state = getattr(param, "quant_state", None)
        if state is None or not getattr(param, "bnb_quantized", True):
            raise ValueError("Nf4Weight.from_bnb: the parameter is not quantised yet (no quant_state)")
        nested = bool(state.nested)
        if nested and state.state2.blocksize != NESTED_BLOCKSIZE:
            raise ValueError(
                f"Nf4Weight.from_bnb: nested block size {state.state2.blocksize}, expected {NESTED_BLOCKSIZE}"
            )
        return cls(
            packed=param.data,
            code=state.code,
            absmax=state.absmax,
            blocksize=int(state.blocksize),
            shape=(int(state.shape[0]), int(state.shape[1])),
            dtype=state.dtype,
            nested_code=state.state2.code if nested else None,
            nested_absmax=state.state2.absmax if nested else None,
            offset=state.offset if nested else None,
        )

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def op_arguments(self) -> tuple[Tensor, list[Tensor]]:
        """``(weight, weight_quant)`` as the LoRA ops take them (module docstring): views, no copies."""
        out, in_features = self.shape
        weight = self.packed.reshape(-1).view(torch.uint8).view(out, in_features // 2)
        quant = [self.code, self.absmax]
        if self.nested_code is not None:
            assert self.nested_absmax is not None and self.offset is not None
            quant += [self.nested_code, self.nested_absmax, self.offset.reshape(())]
        return weight, quant


def check_nf4_weight(fn: str, name: str, weight: Nf4Weight) -> None:
    """A clear error for a malformed :class:`Nf4Weight` (naming ``fn`` and the argument ``name``)."""
    out, in_features = weight.shape
    n = out * in_features
    if in_features % 2:
        raise ValueError(f"{fn}: {name} has {in_features} input features; 4-bit weights need an even number")
    if weight.packed.numel() * weight.packed.element_size() != n // 2:
        raise ValueError(
            f"{fn}: {name}.packed holds {weight.packed.numel() * weight.packed.element_size()} bytes, "
            f"expected {n // 2} for shape {weight.shape}"
        )
    if weight.dtype not in DEQUANTIZED_DTYPES:
        raise TypeError(f"{fn}: {name}.dtype must be float32, bfloat16 or float16, got {weight.dtype}")
    if tuple(weight.code.shape) != (16,) or weight.code.dtype != torch.float32:
        raise ValueError(
            f"{fn}: {name}.code must be 16 float32 values, got {weight.code.dtype} {tuple(weight.code.shape)}"
        )
    blocks = n // weight.blocksize if weight.blocksize > 0 else -1
    if weight.blocksize <= 0 or blocks * weight.blocksize != n or weight.absmax.numel() != blocks:
        raise ValueError(
            f"{fn}: {name} must have one scale per block of {weight.blocksize} of its {n} elements "
            f"(a block size dividing out · in), got {weight.absmax.numel()} scales"
        )
    nested = (weight.nested_code, weight.nested_absmax, weight.offset)
    if any(t is None for t in nested) and not all(t is None for t in nested):
        raise ValueError(f"{fn}: {name} needs nested_code, nested_absmax and offset together (double quantisation)")
    expected_absmax = torch.float32 if weight.nested_code is None else torch.uint8
    if weight.absmax.dtype != expected_absmax:
        raise TypeError(f"{fn}: {name}.absmax must be {expected_absmax}, got {weight.absmax.dtype}")
    if weight.nested_code is not None:
        assert weight.nested_absmax is not None and weight.offset is not None
        if tuple(weight.nested_code.shape) != (256,) or weight.nested_code.dtype != torch.float32:
            raise ValueError(f"{fn}: {name}.nested_code must be 256 float32 values")
        if weight.nested_absmax.numel() != triton.cdiv(blocks, NESTED_BLOCKSIZE):
            raise ValueError(
                f"{fn}: {name}.nested_absmax must hold one scale per {NESTED_BLOCKSIZE} scales "
                f"({triton.cdiv(blocks, NESTED_BLOCKSIZE)}), got {weight.nested_absmax.numel()}"
            )
        if weight.nested_absmax.dtype != torch.float32 or weight.offset.dtype != torch.float32:
            raise TypeError(f"{fn}: {name}.nested_absmax and {name}.offset must be float32")
        if weight.offset.numel() != 1:
            raise ValueError(f"{fn}: {name}.offset must be a scalar, got shape {tuple(weight.offset.shape)}")
    tensors = [t for t in (weight.packed, weight.code, weight.absmax, *nested) if t is not None]
    if any(t.device != weight.packed.device for t in tensors):
        raise ValueError(f"{fn}: {name}'s tensors must all be on {weight.packed.device}")


def dequantize(weight: Tensor, quant: list[Tensor], dtype: torch.dtype, *, grad: Tensor | None = None) -> Tensor:
    """The ``(out, in)`` weight in ``dtype`` from the LoRA ops' ``(weight, weight_quant)``; ``weight`` itself
    when ``quant`` is empty (a dense weight). ``grad``: in a backward op, its incoming gradient, on which
    a traced dequantisation is made to depend (:mod:`inductor_ext.ops._gradient_tie` says why)."""
    if not quant:
        return weight
    if use_eager_bypass([weight]):
        if kernels_run_on(weight.device):
            return _dequantize_kernel(weight, quant, dtype)
    elif weight.is_cuda:  # traced: the backward's launch depends on the gradient (kernels.nf4: ANCHOR)
        return _launch_dequantize(_TRACEABLE, weight, quant, dtype, anchor=grad)
    return dequantize_math(weight, quant, dtype, grad=grad)


def dequantize_math(weight: Tensor, quant: list[Tensor], dtype: torch.dtype, *, grad: Tensor | None = None) -> Tensor:
    """Aten-only :func:`dequantize` (what a compile off the GPU traces; the kernel's math in the
    docstring of :mod:`inductor_ext.kernels.nf4`).

    ``grad`` (a backward op's incoming gradient): the codes are read through
    :func:`~inductor_ext.ops._gradient_tie.tied_to_gradient`, so that under ``torch.compile`` the
    backward's dequantisation stays in the backward instead of being merged with the forward's and its
    output, a whole dequantised weight, saved from forward to backward."""
    if grad is not None:
        weight = tied_to_gradient(weight, grad)
    out, half = weight.shape
    code, absmax = quant[0], quant[1]
    n = out * half * 2
    blocks = absmax.numel()
    if len(quant) == 5:
        nested_code, nested_absmax, offset = quant[2:]
        per_scale = nested_absmax.view(-1, 1).expand(-1, NESTED_BLOCKSIZE).reshape(-1)[:blocks]
        absmax = nested_code[absmax.long()] * per_scale + offset
    codes = torch.stack((weight >> 4, weight & 0xF), dim=-1).view(out, half * 2).long()
    values = code[codes].view(blocks, n // blocks) * absmax.view(blocks, 1)
    return values.view(out, half * 2).to(dtype)


_DIRECT, _TRACEABLE = DirectLaunch(), TraceableLaunch()


def _dequantize_kernel(weight: Tensor, quant: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Our kernel, launched directly (plain eager)."""
    return _launch_dequantize(_DIRECT, weight, quant, dtype)


def _launch_dequantize(
    launch: Launch, weight: Tensor, quant: list[Tensor], dtype: torch.dtype, *, anchor: Tensor | None = None
) -> Tensor:
    """Our kernel through ``launch``; ``anchor``: a tensor the launch depends on without reading it
    (:mod:`inductor_ext.kernels.nf4`), ``weight`` when None."""
    out, half = weight.shape
    n = out * half * 2
    code, absmax = quant[0], quant[1]
    nested = len(quant) == 5
    nested_code, nested_absmax, offset = quant[2:] if nested else (code, code, code)
    result = torch.empty((out, half * 2), dtype=dtype, device=weight.device)
    launch(
        nf4_dequantize_kernel, lambda meta: (triton.cdiv(n, BLOCK),),
        weight, code, absmax, nested_code, nested_absmax, offset, result, weight if anchor is None else anchor,
        n, n // absmax.numel(), NESTED=nested, NESTED_BLOCK=NESTED_BLOCKSIZE, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip
    return result


def nf4_dequantize(weight: Nf4Weight) -> Tensor:
    """``weight`` as a dense ``(out, in)`` tensor in ``weight.dtype`` (bitsandbytes' ``dequantize_4bit``)."""
    if not isinstance(weight, Nf4Weight):
        raise TypeError(f"nf4_dequantize: weight must be an Nf4Weight, got {type(weight).__name__}")
    check_nf4_weight("nf4_dequantize", "weight", weight)
    packed, quant = weight.op_arguments()
    return dequantize(packed, quant, weight.dtype)


__all__ = ["Nf4Weight", "check_nf4_weight", "dequantize", "dequantize_math", "nf4_dequantize"]

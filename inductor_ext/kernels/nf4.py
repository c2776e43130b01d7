"""4-bit (bitsandbytes NF4 / FP4) weight dequantisation kernel (device code and launch config only).

A frozen ``(out, in)`` weight ``W`` stored in bitsandbytes' 4-bit format: ``n = out * in`` codes
``q_i`` in ``[0, 16)``, two per byte, element ``2j`` in the high nibble of byte ``j`` and ``2j + 1``
in the low one (row-major over ``W``); a 16-entry ``code`` table (NF4's normal-distribution
quantiles, or FP4's values) and one scale per block of ``blocksize`` consecutive elements::

    W_i = code[q_i] · absmax[i // blocksize]                       (fp32, then rounded to the output dtype)

Double quantisation ("nested", bitsandbytes' ``compress_statistics``) stores the scales themselves
in 8 bits, blockwise over blocks of 256 scales, around their mean ``offset``::

    absmax[b] = nested_code[a_b] · nested_absmax[b // 256] + offset

All arithmetic is fp32, in bitsandbytes' order (the product, then the offset), so the result is
bitsandbytes' ``dequantize_4bit`` up to the final rounding to the output dtype. The kernel is
elementwise over ``W``: each program writes ``BLOCK`` consecutive elements and reads their
``BLOCK / 2`` bytes, the tiny ``code`` tables from cache. Offsets are int64.

``ANCHOR`` is never read: a tensor the launch depends on. A compiled backward passes its incoming
gradient there, so its dequantisation is a different node from the forward's and is scheduled after the
gradient exists (:mod:`inductor_ext.ops._gradient_tie` says why that matters).
"""

import triton
import triton.language as tl

NESTED_BLOCKSIZE = 256
"""Scales per block of the nested (double) quantisation: bitsandbytes' fixed choice."""

BLOCK, NUM_WARPS = 1024, 4
"""Elements per program (8 per thread: one 16-byte bf16 store) and warps: a bandwidth-bound elementwise
kernel, as Inductor's pointwise heuristic launches one. Not tuned."""


@triton.jit
def nf4_dequantize_kernel(
    PACKED, CODE, ABSMAX, NESTED_CODE, NESTED_ABSMAX, OFFSET, OUT, ANCHOR,
    n, blocksize,
    NESTED: tl.constexpr, NESTED_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """OUT[i] = code[q_i] · absmax[i // blocksize] for BLOCK elements (module docstring)."""
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(PACKED + offs // 2, mask=mask, other=0).to(tl.int32)
    q = (byte >> ((1 - offs % 2) * 4).to(tl.int32)) & 0xF
    value = tl.load(CODE + q, mask=mask, other=0.0)
    block = offs // blocksize
    if NESTED:
        a = tl.load(ABSMAX + block, mask=mask, other=0).to(tl.int32)
        scale = tl.load(NESTED_CODE + a, mask=mask, other=0.0) * tl.load(
            NESTED_ABSMAX + block // NESTED_BLOCK, mask=mask, other=0.0
        )
        scale = scale + tl.load(OFFSET)
    else:
        scale = tl.load(ABSMAX + block, mask=mask, other=0.0)
    tl.store(OUT + offs, (value * scale).to(OUT.dtype.element_ty), mask=mask)

"""Gated-linear-unit Triton kernels, SwiGLU and GeGLU (device code and launch configs only).

Forward, elementwise over ``(M, I)`` gate ``a`` and up ``b`` (all math in fp32)::

    y = act(a) * b

    silu:       act(a) = a * sigmoid(a)
    gelu:       act(a) = 0.5 * a * (1 + erf(a / sqrt(2)))
    gelu_tanh:  act(a) = 0.5 * a * (1 + tanh(u)) = a * sigmoid(2u),   u = sqrt(2/pi) * (a + 0.044715 * a**3)

Backward, recomputing the activation from the saved inputs (nothing else saved)::

    da = dy * b * act'(a)
    db = dy * act(a)

    silu:       act'(a) = s * (1 + a * (1 - s)),                     s = sigmoid(a)
    gelu:       act'(a) = 0.5 * (1 + erf(a / sqrt(2))) + a * exp(-a**2 / 2) / sqrt(2 pi)
    gelu_tanh:  act'(a) = s + 2 * a * s * (1 - s) * sqrt(2/pi) * (1 + 3 * 0.044715 * a**2),   s = sigmoid(2u)

(``tanh(u) = 2 sigmoid(2u) - 1`` and ``1 - tanh(u)**2 = 4 s (1 - s)``: no cancellation near 0.)

Three memory layouts, one kernel each way (``FLAT`` and ``PACKED`` are constexprs the
launcher picks from the strides, not tuning knobs):

* flat: every tensor is contiguous, so the op is 1-D over ``M * I`` elements; offsets
  are int64, so tensors past 2**31 elements are fine.
* rows: gate/up/dy rows have their own row strides (unit column stride), e.g. the two
  halves of one projection's output; programs walk ``(row, column block)`` pairs.
* packed: one ``(M, 2I)`` gate-up tensor, gate in columns ``[0, I)`` and up in
  ``[I, 2I)`` of each row; the backward writes ``[da | db]`` into one ``(M, 2I)`` tensor.

``BLOCK`` elements per program and ``num_warps`` are the only tuning knobs; every
config of :func:`search_space` is valid for every shape (no pruning).
"""

import dataclasses
from typing import Any

import triton
import triton.language as tl

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
"""Activation name -> the kernels' ``ACTIVATION`` constexpr."""


@dataclasses.dataclass(frozen=True)
class GLUConfig:
    """One launch configuration of a GLU kernel: ``block`` elements per program."""

    block: int
    num_warps: int

    def to_triton(self) -> triton.Config:
        return triton.Config({"BLOCK": self.block}, num_warps=self.num_warps)

    @classmethod
    def from_triton(cls, config: triton.Config) -> "GLUConfig":
        return cls(config.kwargs["BLOCK"], config.num_warps)


def search_space() -> list[GLUConfig]:
    """Every config, the heuristic's favourite first: 512-4096 elements, 8 or 16 per thread.

    8 bf16/fp16 elements are one 16-byte vector per tensor and thread; 16 give two in flight.
    """
    configs = [
        GLUConfig(block, num_warps)
        for block in (512, 1024, 2048, 4096)
        for num_warps in (1, 2, 4, 8, 16)
        if block // (32 * num_warps) in (8, 16)
    ]
    configs.sort(key=lambda c: (c != heuristic(),))
    return configs


def heuristic() -> GLUConfig:
    """1024 elements and 4 warps (8 per thread), what Inductor picks for large pointwise kernels."""
    return GLUConfig(1024, 4)


_AUTOTUNE: dict[str, Any] = {
    "configs": [c.to_triton() for c in search_space()],
    "key": ["n_cols", "ACTIVATION", "FLAT", "PACKED"],
}


@triton.jit
def _gelu_tanh_sigmoid(a):
    """s = sigmoid(2u), u = sqrt(2/pi) * (a + 0.044715 a^3): gelu_tanh(a) = a * s."""
    u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
    return tl.sigmoid(2.0 * u)


@triton.jit
def _activation(a, ACTIVATION: tl.constexpr):
    """act(a) in fp32; ACTIVATION: 0 silu, 1 gelu (erf), 2 gelu_tanh."""
    if ACTIVATION == 0:
        return a * tl.sigmoid(a)
    elif ACTIVATION == 1:
        return 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))
    else:
        return a * _gelu_tanh_sigmoid(a)


@triton.jit
def _activation_and_derivative(a, ACTIVATION: tl.constexpr):
    """(act(a), act'(a)) in fp32."""
    if ACTIVATION == 0:
        s = tl.sigmoid(a)
        act = a * s
        return act, s * (1.0 + a * (1.0 - s))
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476))
        return a * cdf, cdf + a * 0.3989422804014327 * tl.exp(-0.5 * a * a)
    else:
        s = _gelu_tanh_sigmoid(a)
        du = 0.7978845608028654 * (1.0 + 0.134145 * a * a)
        return a * s, s + 2.0 * a * s * (1.0 - s) * du


@triton.jit
def _flat_tile(pid, n_rows, n_cols, BLOCK: tl.constexpr):
    """(row 0, int64 element offsets, mask) of this program's BLOCK elements out of all M * I."""
    cols = tl.cast(pid, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return tl.cast(0, tl.int64), cols, cols < tl.cast(n_rows, tl.int64) * n_cols


@triton.jit
def _row_tile(pid, n_cols, BLOCK: tl.constexpr):
    """(row as int64, column offsets, mask) of this program's BLOCK columns of one row."""
    blocks_per_row = tl.cdiv(n_cols, BLOCK)
    row = pid // blocks_per_row
    cols = (pid - row * blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    return tl.cast(row, tl.int64), cols, cols < n_cols


@triton.autotune(**_AUTOTUNE)
@triton.jit
def glu_fwd_kernel(
    GATE, UP, Y,
    n_rows, n_cols, stride_gate, stride_up, stride_y,
    ACTIVATION: tl.constexpr, FLAT: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """y = act(a) * b over BLOCK elements (flat) or one row's BLOCK columns (rows, packed).

    PACKED: UP is unused; b is GATE's row shifted by n_cols (stride_up = stride_gate).
    """
    if FLAT:
        row, cols, mask = _flat_tile(tl.program_id(0), n_rows, n_cols, BLOCK)
    else:
        row, cols, mask = _row_tile(tl.program_id(0), n_cols, BLOCK)
    gate_row = GATE + row * stride_gate
    if PACKED:
        up_row = gate_row + n_cols
    else:
        up_row = UP + row * stride_up
    a = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_row + cols, mask=mask, other=0.0).to(tl.float32)
    y = _activation(a, ACTIVATION) * b
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.autotune(**_AUTOTUNE)
@triton.jit
def glu_bwd_kernel(
    DY, GATE, UP, DGATE, DUP,
    n_rows, n_cols, stride_dy, stride_gate, stride_up, stride_dgate, stride_dup,
    ACTIVATION: tl.constexpr, FLAT: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """da = dy * b * act'(a), db = dy * act(a), recomputing act(a) from a.

    PACKED: UP and DUP are unused; b sits n_cols after a in GATE's row and db n_cols
    after da in DGATE's row.
    """
    if FLAT:
        row, cols, mask = _flat_tile(tl.program_id(0), n_rows, n_cols, BLOCK)
    else:
        row, cols, mask = _row_tile(tl.program_id(0), n_cols, BLOCK)
    gate_row = GATE + row * stride_gate
    dgate_row = DGATE + row * stride_dgate
    if PACKED:
        up_row = gate_row + n_cols
        dup_row = dgate_row + n_cols
    else:
        up_row = UP + row * stride_up
        dup_row = DUP + row * stride_dup
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_row + cols, mask=mask, other=0.0).to(tl.float32)
    act, dact = _activation_and_derivative(a, ACTIVATION)
    tl.store(dgate_row + cols, (dy * b * dact).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(dup_row + cols, (dy * act).to(DGATE.dtype.element_ty), mask=mask)


glu_bwd_inplace_kernel = triton.autotune(**_AUTOTUNE, restore_value=["GATE", "UP"])(glu_bwd_kernel.fn)
""":func:`glu_bwd_kernel` writing ``DGATE``/``DUP`` over ``GATE``/``UP``: the autotuner restores them after
each timed config (else the first, tuning launch computes from gradients written by the configs it timed)."""

glu_packed_bwd_inplace_kernel = triton.autotune(**_AUTOTUNE, restore_value=["GATE"])(glu_bwd_kernel.fn)
"""The packed form of :data:`glu_bwd_inplace_kernel` (``UP`` is unused)."""

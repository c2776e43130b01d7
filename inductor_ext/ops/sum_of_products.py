"""A sum of matrix products accumulated in the GEMMs' epilogues: ``fastops::sum_of_products``.

Schema::

    fastops::sum_of_products(Tensor[] lhs, Tensor[] rhs) -> Tensor

``lhs[0] @ rhs[0] + lhs[1] @ rhs[1] + ...``, computed as::

    total  = lhs[0] @ rhs[0]              one GEMM, written
    total += lhs[i] @ rhs[i]              addmm_: the GEMM adds ``total`` in its epilogue (beta = 1)

Each product is accumulated in fp32 inside its GEMM and the running sum rounded once per product to
the inputs' dtype. The sum written out of place, ``mm + mm + mm``, holds every product at once and
adds them in a pointwise kernel that reads them all again; here no product is held beside the total.
For 16-bit inputs ``k`` products round ``k`` times (the out-of-place sum: ``k + 1``).

The backend's ``fastops.accumulate_products`` pass (:mod:`inductor_ext.inductor.accumulate_products`)
calls it for sums of products in compiled graphs: a backward's input gradient of a tensor that feeds
several linear layers (grouped-query attention's q/k/v, the MLP's gate and up). Opaque to Inductor,
which calls it as it is (an ATen GEMM, then ``addmm_``).
"""

import torch
from torch import Tensor


@torch.library.custom_op("fastops::sum_of_products", mutates_args=())
def sum_of_products(lhs: list[Tensor], rhs: list[Tensor]) -> Tensor:
    """``sum(a @ b for a, b in zip(lhs, rhs))``: the first product written, the others added in place."""
    _check(lhs, rhs)
    total = torch.mm(lhs[0], rhs[0])
    for a, b in zip(lhs[1:], rhs[1:], strict=True):
        total.addmm_(a, b)
    return total


@sum_of_products.register_fake
def _(lhs: list[Tensor], rhs: list[Tensor]) -> Tensor:
    _check(lhs, rhs)
    return lhs[0].new_empty((lhs[0].shape[0], rhs[0].shape[1]))


def _check(lhs: list[Tensor], rhs: list[Tensor]) -> None:
    if not lhs or len(lhs) != len(rhs):
        raise ValueError(
            f"fastops::sum_of_products: lhs and rhs must be non-empty lists of one length, got {len(lhs)} and {len(rhs)}"
        )
    m, n = lhs[0].shape[0], rhs[0].shape[-1]
    for i, (a, b) in enumerate(zip(lhs, rhs, strict=True)):
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or (a.shape[0], b.shape[1]) != (m, n):
            raise ValueError(
                f"fastops::sum_of_products: product {i} must be ({m}, K) @ (K, {n}), "
                f"got {tuple(a.shape)} @ {tuple(b.shape)}"
            )
        if a.dtype != lhs[0].dtype or b.dtype != lhs[0].dtype or a.device != lhs[0].device or b.device != a.device:
            raise ValueError(
                f"fastops::sum_of_products: every operand must be {lhs[0].dtype} on {lhs[0].device}, "
                f"got {a.dtype} on {a.device} and {b.dtype} on {b.device} in product {i}"
            )

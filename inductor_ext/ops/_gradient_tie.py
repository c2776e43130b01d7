"""Keep a backward op's recomputations in the backward graph: :func:`tied_to_gradient`.

Under ``torch.compile`` AOTAutograd traces the forward and backward ops into one joint graph, merges
identical nodes (common-subexpression elimination) and then cuts the graph in two, saving what the
backward reads from the forward. A backward op that recomputes what its forward op computed from the
same tensors (a 4-bit weight's dequantisation, the GLU's float32 upcasts of ``G`` and ``U``, a dropout
mask applied to the input) traces the very nodes the forward traced: they are merged, and the
partitioner then saves the forward's result instead of recomputing it. It does so whenever the result
is an operand of a backward GEMM ("materialised in the backward"), and always under selective
checkpointing, which tags every node of a kept op ``MUST_SAVE``: whole dequantised weights, or float32
copies of ``G`` and ``U``, are then held from forward to backward, on any device.

:func:`tied_to_gradient` gives the backward its own copy of such an input: the same bits, computed as
``t | z`` on ``t``'s bits with ``z`` a zero made from one element of the incoming gradient. The
partitioner cannot move anything that depends on the gradient into the forward, so the recomputation
stays in the backward, and Inductor fuses the ``|`` into the kernel that reads ``t`` anyway. In plain
eager nothing traces and ``t`` is returned as it is.
"""

import torch
from torch import Tensor

from inductor_ext.library.registration import use_eager_bypass

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tied_to_gradient(t: Tensor, grad: Tensor) -> Tensor:
    """``t``, bit for bit, as a value that depends on ``grad`` when something traces (module docstring)."""
    if grad.numel() == 0 or t.numel() == 0 or use_eager_bypass([t, grad]):
        return t
    bits = _SAME_SIZE_INT[t.element_size()]
    element = grad[(0,) * grad.dim()]
    zero = (element.view(_SAME_SIZE_INT[grad.element_size()]) & 0).to(bits)
    return (t.view(bits) | zero).view(t.dtype)

"""Layout helpers the op files share: what the kernels index by is a unit stride along the last dim."""

from torch import Tensor


def unit_last_stride(t: Tensor) -> Tensor:
    """``t`` itself when its last dim is unit-stride, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def rows_2d(t: Tensor) -> Tensor:
    """``t`` as ``(M, n)`` rows of its last dim with unit stride; a view whenever the leading dims allow.

    Public functions flatten before the autograd boundary, so ranks never change between
    recompiles; 2-D inputs pass as they are, adding no view nodes to the autograd graph.
    """
    t2d = t if t.dim() == 2 else (t.flatten(0, -2) if t.dim() > 2 else t.unsqueeze(0))
    return unit_last_stride(t2d)

"""Sibling projections exported as one matrix product: ``export_generation(..., fuse_projections=True)``.

A decoder layer's query, key and value projections read the same hidden state, and so do the MLP's gate
and up projections. A decode step at batch 1 makes each of them a matrix-vector product that reads its
weight once: the narrow key and value ones (2 MB each at the Llama-3.2-1B shape) cost about a kernel's
fixed time, not their bytes. Exported as one product over the concatenated weights (``(q + k + v) x H``,
``2 I x H``), a layer runs three launches fewer and reads the same bytes.

While :func:`fused_projections` is active, each group's modules are replaced by :class:`ProjectionSlice`
modules that share one :class:`FusedProjection`: the first slice called on a hidden state computes the
product over the concatenated weights, every slice returns its columns of it (a view, as
``torch.split``), and the model's own forward (transformers') runs unchanged. The concatenated weights
are new tensors (a copy of those projections' weights, for the duration of the export: 1.3 GB for
Llama-3.2-1B in bf16); the package stores them in place of the originals (one record per group, named
``<first projection>.fused.weight``), so it is no larger. A group is fused when its projections are
``nn.Linear`` modules of one input width, dtype and device, with biases on all or none.
"""

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Attribute names of the sibling projections fused together, as transformers' decoders name them."""


class FusedProjection(nn.Module):
    """``linear(x, cat(W_i), cat(b_i))`` for the group, computed once per hidden state."""

    def __init__(self, projections: Sequence[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([p.weight.detach() for p in projections]), requires_grad=False)
        biases = [p.bias.detach() for p in projections if p.bias is not None]
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if biases else None
        ends = list(itertools.accumulate(p.out_features for p in projections))
        self.columns = list(zip([0, *ends[:-1]], ends))
        self._input: Tensor | None = None
        self._output: Tensor | None = None

    def columns_of(self, index: int, x: Tensor) -> Tensor:
        """Projection ``index``'s output for ``x``: its columns of the group's product."""
        if self._input is not x:
            self._input, self._output = x, F.linear(x, self.weight, self.bias)
        assert self._output is not None
        start, end = self.columns[index]
        return self._output[..., start:end]

    def forget(self) -> None:
        self._input = self._output = None


class ProjectionSlice(nn.Module):
    """Stands in for one projection of a fused group; the first of the group holds the fused weights."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        if index == 0:
            self.fused = fused
        else:  # not a submodule: the fused weights are stored (and exported) once, under the first slice
            self.__dict__["fused"] = fused
        self.index = index

    def forward(self, x: Tensor) -> Tensor:
        return self.fused.columns_of(self.index, x)


def _fusable(projections: Sequence[object]) -> list[nn.Linear] | None:
    """The group's ``nn.Linear`` modules if they can be fused (one input width, dtype and device; biases on
    all or none), else None."""
    linears = [p for p in projections if type(p) is nn.Linear]
    if len(linears) != len(projections):
        return None
    first = linears[0]
    same = all(
        p.in_features == first.in_features
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        and (p.bias is None) == (first.bias is None)
        for p in linears
    )
    return linears if same else None


@contextmanager
def fused_projections(model: nn.Module) -> Iterator[int]:
    """Within the context, ``model``'s sibling projections (:data:`GROUPS`) run as fused groups; yields the
    number of groups fused. The original modules are put back on exit."""
    replaced: list[tuple[nn.Module, str, nn.Module]] = []
    fused: list[FusedProjection] = []
    try:
        for module in list(model.modules()):
            for names in GROUPS:
                linears = _fusable([getattr(module, name, None) for name in names])
                if linears is None:
                    continue
                group = FusedProjection(linears)
                fused.append(group)
                for index, (name, projection) in enumerate(zip(names, linears)):
                    replaced.append((module, name, projection))
                    setattr(module, name, ProjectionSlice(group, index))
        yield len(fused)
    finally:
        for module, name, original in reversed(replaced):
            setattr(module, name, original)
        for group in fused:
            group.forget()

"""A ``CustomGraphPass`` that versions the FX-graph and AOTAutograd caches by our rules.

Inductor's FX graph cache does not hash registered lowerings, and the AOTAutograd cache
does not hash the traced op bodies' route decisions: both would serve a graph compiled
under other rules. Both caches do hash the ``uuid()`` of the custom post-grad pass, so
ours folds in the package version, the source of every module whose code decides what
gets traced (ops, kernels, rewrites, route choice, options) and this compile's options
and route decisions. torch 2.11 takes one pass per slot: a user's pass already in the
slot is chained inside ours.
"""

import functools
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import get_donated_idxs

from inductor_ext.inductor.donated_buffers import write_over_donated_inputs
from inductor_ext.inductor.product_sums import accumulate_product_sums
from inductor_ext.version import __version__

_PACKAGE = Path(__file__).resolve().parent.parent
_VERSIONED_DIRS = ("ops", "kernels", "inductor", "tuning", "autotune")


@functools.cache
def source_digest() -> str:
    """sha256 of the package version and the source of the modules that shape compiled graphs."""
    digest = hashlib.sha256(__version__.encode())
    for directory in _VERSIONED_DIRS:
        for path in sorted((_PACKAGE / directory).rglob("*.py")):  # subpackages too (inductor/rewrites)
            digest.update(path.relative_to(_PACKAGE).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class FastopsGraphPass(CustomGraphPass):
    """Our post-grad passes (:mod:`.product_sums` where ``accumulate_products``, :mod:`.donated_buffers`),
    then the user's (if any); its ``uuid`` versions the caches (``state`` holds the options)."""

    def __init__(self, state: str, chained: Any = None, *, accumulate_products: bool = False) -> None:
        self.state = state
        self.chained = chained
        self.accumulate_products = accumulate_products

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.accumulate_products:
            accumulate_product_sums(graph)
        write_over_donated_inputs(graph, get_donated_idxs())
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Any:
        chained = None
        if self.chained is not None:
            chained = self.chained.uuid() if isinstance(self.chained, CustomGraphPass) else repr(self.chained)
        return hashlib.sha256(f"{source_digest()}|{self.state}|{chained}".encode()).hexdigest()
